"""Faults under load on real SGLang PD servers (our backend, softio's device path), GPU machine only.

Prefill on GPU base, decode on base+1, the identity model and flags of pd_identity.py. In order:
  warm      the 64 identity prompts at concurrency 16: token identity against the standalone reference
  aborts    48 streamed requests of 1-3K tokens at concurrency 16; a third are cancelled by the client
            right after sending (mid-prefill or mid-transfer), a third after their first token
            (mid-decode), a third run to the end. Then both servers must drain (every SGLang queue
            gauge back to 0) and the 64 prompts must come back token-identical.
  kill      32 requests of 2-3K tokens at concurrency 16; 0.4 s in, the decode server is SIGKILLed
            (its whole process group). Every request must return (an error with its cause, or its
            tokens) within the deadline: none may hang. 4 requests are sent while decode is down
            (prefill must fail them at SGLang's bootstrap timeout, with a cause). Decode is started
            again on the same GPU and port; prefill is not restarted; the 64 prompts must come back
            token-identical.
Bounded: each request has a client deadline, each wait a deadline; counts are fixed.
SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT=30 and SGLANG_DISAGGREGATION_WAITING_TIMEOUT=60 (SGLang's
defaults are 300 s) keep a request whose peer died within the call. Results: OUT/<tag>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List

import requests

from pd_identity import CHUNK, compare, prompts, run_prompts, write_json
from servers import PDClient, Server, generate, record_failure, sampling, server_argv

REQUEST_DEADLINE_S = 120


def queue_gauges(server: Server) -> Dict[str, float]:
    """SGLang's request gauges (running, queued, and the disaggregation queues), summed over labels."""
    try:
        text = requests.get(f"{server.url}/metrics", timeout=5).text
    except requests.RequestException as exc:
        return {"error": str(exc)}
    out: Dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        # Gauges only: the *_total counters (failed requests so far) never return to 0.
        if name.startswith("sglang:num_") and ("reqs" in name or "queue" in name) and not name.endswith("_total"):
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def drained(servers: List[Server], deadline_s: float) -> Dict:
    """Wait until every request gauge of every server reads 0; report what is left if not."""
    start = time.monotonic()
    while True:
        gauges = {s.name: queue_gauges(s) for s in servers}
        busy = {n: {k: v for k, v in g.items() if k != "error" and v} for n, g in gauges.items()}
        if not any(busy.values()) and not any("error" in g for g in gauges.values()):
            return {"drained": True, "after_s": round(time.monotonic() - start, 2)}
        if time.monotonic() - start > deadline_s:
            return {"drained": False, "left": busy, "gauges": gauges}
        time.sleep(0.5)


def load_items(count: int, lo: int, hi: int, seed: int, vocab: int) -> List[Dict]:
    rng = random.Random(seed)
    return [{"input_ids": [rng.randrange(10, vocab) for _ in range(rng.randint(lo, hi))],
             "sampling_params": sampling(48)} for _ in range(count)]


def streamed(client: PDClient, body: Dict, cancel: str) -> Dict:
    """One PD request streamed from decode; `cancel`: 'early' closes the connection 50 ms after
    sending, 'first' after the first token, 'none' reads to the end."""
    body = client.with_bootstrap(body)
    pre = client.pool.submit(generate, client.prefill.url, body, REQUEST_DEADLINE_S)
    start, tokens, outcome = time.monotonic(), 0, "done"
    try:
        with requests.post(f"{client.decode.url}/generate", json=dict(body, stream=True),
                           stream=True, timeout=REQUEST_DEADLINE_S) as r:
            if cancel == "early":
                time.sleep(0.05)
                outcome = "cancelled_early"
            else:
                for line in r.iter_lines(chunk_size=None):
                    if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                        chunk = json.loads(line[5:])
                        if "error" in chunk:
                            outcome = "error: " + json.dumps(chunk["error"])[:200]
                            break
                        tokens = chunk.get("meta_info", {}).get("completion_tokens") or tokens
                        if cancel == "first" and tokens:
                            outcome = "cancelled_after_first"
                            break
    except requests.RequestException as exc:
        outcome = f"error: {type(exc).__name__}: {exc}"[:300]
    try:
        pre_reply = pre.result(timeout=REQUEST_DEADLINE_S + 10)
    except Exception as exc:  # noqa: BLE001 - the prefill side never answered: hung
        pre_reply = {"error": f"hung: {type(exc).__name__}"}
    return {"cancel": cancel, "outcome": outcome, "tokens": tokens, "room": body["bootstrap_room"],
            "prefill": (pre_reply.get("error") or "ok")[:300], "s": round(time.monotonic() - start, 2)}


def identity_after(client: PDClient, items, ref: Dict) -> Dict:
    got = run_prompts(client, items, 16)
    return dict(compare(ref["c16"]["results"], got["results"]), wall_s=got["wall_s"])


def phase_aborts(client: PDClient, servers: List[Server], items, ref, vocab: int) -> Dict:
    load = load_items(48, 1000, 3000, seed=29, vocab=vocab)
    kinds = ["early", "first", "none"] * 16
    start = time.monotonic()
    with ThreadPoolExecutor(max_workers=16) as pool:
        replies = list(pool.map(lambda a: streamed(client, a[0], a[1]), zip(load, kinds)))
    res = {"wall_s": round(time.monotonic() - start, 2), "requests": replies,
           "outcomes": _count(r["outcome"].split(":")[0] for r in replies),
           "prefill_outcomes": _count(r["prefill"][:60] for r in replies)}
    res["drain"] = drained(servers, 60)
    res["identity_after"] = identity_after(client, items, ref)
    return res


def phase_kill(client: PDClient, prefill: Server, decode: Server, items, ref, args) -> Dict:
    load = load_items(32, 2000, 3000, seed=31, vocab=args.vocab)
    res: Dict = {}
    replies: List[Dict] = []

    def one(body):
        start = time.monotonic()
        try:
            reply = client(body)
        except Exception as exc:  # noqa: BLE001
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        return {"error": (reply.get("error") or "")[:300], "prefill_error": (reply.get("prefill_error") or "")[:300],
                "tokens": len(reply.get("output_ids") or []), "s": round(time.monotonic() - start, 2)}

    pool = ThreadPoolExecutor(max_workers=16)
    futures = [pool.submit(one, {"input_ids": x["input_ids"], "sampling_params": x["sampling_params"]}) for x in load]
    time.sleep(0.4)
    t_kill = time.monotonic()
    decode.proc.kill_hard()
    res["killed_at_s"] = 0.4
    # While decode is down: prefill gets requests whose decode never bootstraps.
    down = [pool.submit(one, {"input_ids": x["input_ids"], "sampling_params": x["sampling_params"]})
            for x in load_items(4, 500, 600, seed=37, vocab=args.vocab)]
    for f in futures + down:
        try:
            replies.append(f.result(timeout=REQUEST_DEADLINE_S + 20))
        except Exception as exc:  # noqa: BLE001
            replies.append({"error": f"hung: {type(exc).__name__}", "s": None})
    pool.shutdown(wait=False)
    res["all_returned_s"] = round(time.monotonic() - t_kill, 2)
    res["in_flight"] = replies[:32]
    res["while_down"] = replies[32:]
    res["hung"] = sum(1 for r in replies if r["error"].startswith("hung"))
    res["in_flight_outcomes"] = _count(("ok" if r["tokens"] and not r["error"] else r["error"][:70]) for r in replies[:32])
    res["while_down_prefill"] = [r["prefill_error"][:200] for r in replies[32:]]
    res["prefill_drain"] = drained([prefill], 60)
    res["prefill_metrics_after_kill"] = prefill.metrics()
    t0 = time.monotonic()
    decode.start()
    decode.wait_ready(args.start_timeout)
    res["decode_restart_s"] = round(time.monotonic() - t0, 1)
    res["identity_after"] = identity_after(client, items, ref)
    res["drain_after"] = drained([prefill, decode], 60)
    return res


def _count(values) -> Dict[str, int]:
    out: Dict[str, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--reference", required=True, help="pd_identity.json with the standalone phase (may appear later)")
    ap.add_argument("--gpu-base", type=int, default=0)
    ap.add_argument("--port-base", type=int, default=13000)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--mem", type=float, default=0.3)
    ap.add_argument("--start-timeout", type=float, default=420)
    ap.add_argument("--tag", default="pd_faults")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, SGLANG_MORI_ENGINE="soft", SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT="30",
               SGLANG_DISAGGREGATION_WAITING_TIMEOUT="60")
    flags = ["--enable-deterministic-inference", "--chunked-prefill-size", str(CHUNK),
             "--max-total-tokens", "262144", "--cuda-graph-max-bs-decode", "32"]
    p0, boot = args.port_base, args.port_base + 20
    pre = Server("faults-prefill", server_argv(args.model, p0, args.gpu_base, args.mem, [
        "--disaggregation-mode", "prefill", "--disaggregation-transfer-backend", "mori",
        "--disaggregation-bootstrap-port", str(boot)] + flags), env, out / "logs", p0)
    dec = Server("faults-decode", server_argv(args.model, p0 + 10, args.gpu_base + 1, args.mem, [
        "--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "mori"] + flags),
        env, out / "logs", p0 + 10)
    report: Dict = {"bootstrap_timeout_s": 30, "waiting_timeout_s": 60, "request_deadline_s": REQUEST_DEADLINE_S}
    items = prompts(64, args.vocab)
    try:
        pre.start(), dec.start()
        pre.wait_ready(args.start_timeout)
        dec.wait_ready(args.start_timeout)
        ref_path = Path(args.reference)
        deadline = time.monotonic() + args.start_timeout
        while not ref_path.exists() and time.monotonic() < deadline:
            time.sleep(2)
        ref = json.loads(ref_path.read_text())["phases"]["standalone"]
        client = PDClient(pre, dec, boot)
        report["warm"] = identity_after(client, items, ref)
        print("[faults] warm:", report["warm"], flush=True)
        report["aborts"] = phase_aborts(client, [pre, dec], items, ref, args.vocab)
        print("[faults] aborts:", {k: v for k, v in report["aborts"].items() if k != "requests"}, flush=True)
        write_json(out / f"{args.tag}.json", report)
        report["kill"] = phase_kill(client, pre, dec, items, ref, args)
        print("[faults] kill:", {k: v for k, v in report["kill"].items() if k not in ("in_flight",)}, flush=True)
        report["metrics"] = {s.name: s.metrics() for s in (pre, dec)}
    except Exception as exc:  # noqa: BLE001
        record_failure(report, "faults", [pre, dec], exc, 40)
    finally:
        pre.stop()
        dec.stop()
        write_json(out / f"{args.tag}.json", report)


if __name__ == "__main__":
    main()
