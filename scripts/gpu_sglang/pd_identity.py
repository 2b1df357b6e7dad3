"""Real SGLang 0.5.23 servers on the GPU machine: standalone, then prefill + decode with our backend
(`--disaggregation-transfer-backend mori`, softio's device path), greedy outputs compared token by token.

Run by device_run.sh there (it installs the wheels and sets PYTHONPATH); the PD front is
servers.PDClient (what sglang_router's mini_lb does).

Phases (--phases, comma-separated; each runs every prompt at concurrency 1, then 16):
  standalone       one server, the reference
  pd               prefill + decode, chunk-wise
  pd_lw            the same with SGLANG_MORI_LAYERWISE=on and thresholds lowered so it streams
  pd_lw_nograph    pd_lw with the prefill CUDA graph disabled on the prefill server
  pd_dcache        pd with decode's radix cache on (--disaggregation-decode-enable-radix-cache), so
                   prompts sharing a prefix with an earlier one are sent only past decode's cached part
  pd_tp            pd with SGLANG_MORI_TRANSFER_PROCESS=on on the prefill server; the phase fails by
                   name (tproc_check.py) unless the prefill log shows every rank's transfer process
                   accepted, proven and carrying a room to Success (no silent in-process fallback)
  <pd phase>_optimistic  that phase with --optimistic-prefill-attempts 1 on the prefill server
                   (SGLang runs a request's forward before decode's destinations arrive; with pd_lw
                   the request joins the layer-wise stream when they do), e.g. pd_lw_optimistic
Results: OUT/pd_identity.json (per phase: outputs' digest, mismatches vs standalone, start-up times,
our metrics from both servers); OUT/logs/*.log.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List

import kv_hash
import tproc_check
from servers import PDClient, Server, generate, record_failure, sampling, server_argv

CHUNK = 1024  # --chunked-prefill-size: prompts up to 3x this are prefilled (and sent) in chunks
OPTIMISTIC = "_optimistic"  # phase suffix: optimistic prefill on the prefill server
OPTIMISTIC_FLAGS = ["--optimistic-prefill-attempts", "1"]
TPROC_PHASE = "pd_tp"  # the prefill server's transfers in a transfer process (tproc_check.py)
LAYERWISE_ENV = {"SGLANG_MORI_LAYERWISE": "on", "SGLANG_MORI_LAYERWISE_MIN_TOKENS": "16",
                 "SGLANG_MORI_LAYERWISE_MIN_BATCH_TOKENS": "16"}


def prompts(count: int, vocab: int, seed: int = 27) -> List[Dict]:
    """Mixed lengths (a few tokens to 3 chunks); every fourth prompt extends a shared prefix of an
    earlier one, so decode's radix cache (and prefill's) hold part of it."""
    rng = random.Random(seed)
    lengths = [3, 9, 17, 40, 64, 100, 200, 333, 512, 700, 1000, 1023, 1025, 1500, 2100, 3000]
    out, prefixes = [], []
    for i in range(count):
        n = lengths[i % len(lengths)] + rng.randint(0, 7)
        if i % 4 == 3 and prefixes:
            base = prefixes[rng.randrange(len(prefixes))]
            ids = base + [rng.randrange(10, vocab) for _ in range(max(1, n // 4))]
        else:
            ids = [rng.randrange(10, vocab) for _ in range(n)]
            if n >= 64:
                prefixes.append(ids)
        out.append({"input_ids": ids, "max_new_tokens": 8 + (i * 7) % 41})
    return out


def run_prompts(send, items: List[Dict], concurrency: int) -> Dict:
    def one(item: Dict) -> Dict:
        body = {"input_ids": item["input_ids"], "sampling_params": sampling(item["max_new_tokens"])}
        start = time.monotonic()
        try:
            reply = send(body)
        except Exception as exc:  # a transport failure is a failed request, recorded with its cause
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        return {"output_ids": reply.get("output_ids"), "error": reply.get("error"),
                "e2e_s": round(time.monotonic() - start, 4)}

    start = time.monotonic()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        results = list(pool.map(one, items))
    return {"results": results, "wall_s": round(time.monotonic() - start, 3)}


def digest(results: List[Dict]) -> str:
    return hashlib.sha256(json.dumps([r["output_ids"] for r in results]).encode()).hexdigest()[:16]


def write_json(path: Path, data: Dict) -> None:
    """Whole or not at all: a run beside this one may be waiting to read it."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


def first_divergence(a, b) -> int:
    """Index of the first output token that differs (a numeric drift shows late, a wrong KV early)."""
    a, b = a or [], b or []
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def compare(ref: List[Dict], got: List[Dict]) -> Dict:
    """Prompt by prompt; a run of fewer prompts than the reference (--prompts N against a stored
    64-prompt reference: the prompts are generated in order, so its N are the reference's first N)
    counts only the prompts both have."""
    bad = [i for i, (a, b) in enumerate(zip(ref, got)) if a["output_ids"] != b["output_ids"] or b["error"]]
    errors = [got[i]["error"] for i in bad if got[i]["error"]]
    total = min(len(ref), len(got))
    return {"identical": total - len(bad), "total": total, "mismatched": bad[:20],
            "first_divergence": {i: first_divergence(ref[i]["output_ids"], got[i]["output_ids"]) for i in bad[:20]},
            "errors": errors[:5]}


def run_phase(name: str, args, items: List[Dict], logs: Path, ports: List[int]) -> Dict:
    env = dict(os.environ)
    model, two, base, tp = args.model, args.gpus >= 2, args.gpu_base, args.prefill_tp
    # Batch-invariant kernels (SGLang's own switch): without it the Triton decode attention splits
    # the KV by batch size, so even one standalone server's greedy tokens change with concurrency.
    flags = ["--enable-deterministic-inference"] if args.deterministic else []
    flags += ["--dtype", args.dtype] if args.dtype else []
    # Prompts up to 3 chunks; small pools (register and start fast); decode graphs up to batch 32
    # (SGLang's 256+ only lengthens capture here).
    flags += ["--chunked-prefill-size", str(CHUNK), "--max-total-tokens", "262144",
            "--cuda-graph-max-bs-decode", "32"]
    phase: Dict = {"phase": name}
    servers: List[Server] = []
    try:
        if name == "standalone":
            if args.kv_hash:  # no rooms here: the plugin records the process's float32 matmul settings
                env.update(kv_hash_env(args, name))
            srv = Server(name, server_argv(model, ports[0], base, args.mem, flags, tp=args.standalone_tp),
                         env, logs, ports[0]).start()
            servers.append(srv)
            srv.wait_ready(args.start_timeout)
            send = lambda body: generate(srv.url, body)  # noqa: E731
        else:
            base_phase = name.removesuffix(OPTIMISTIC)  # what the servers run, the flag aside
            penv = dict(env, SGLANG_MORI_ENGINE="soft")
            if base_phase.startswith("pd_lw"):
                penv.update(LAYERWISE_ENV)
            if args.kv_hash:
                penv.update(kv_hash_env(args, name))
            denv = dict(penv)  # decode never runs a transfer process
            if base_phase == TPROC_PHASE:  # chunk-wise: layer-wise is refused by the prototype
                penv.update(tproc_check.ENV, SGLANG_MORI_LAYERWISE="off")
            boot = ports[2]
            pextra = ["--disaggregation-mode", "prefill", "--disaggregation-transfer-backend", "mori",
                      "--disaggregation-bootstrap-port", str(boot)]
            if base_phase == "pd_lw_nograph":
                pextra += ["--cuda-graph-backend-prefill", "disabled"]
            if name.endswith(OPTIMISTIC):
                pextra += OPTIMISTIC_FLAGS
            dextra = ["--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "mori"]
            if base_phase == "pd_dcache":
                dextra.append("--disaggregation-decode-enable-radix-cache")
            pre = Server(f"{name}-prefill", server_argv(model, ports[0], base, args.mem, pextra + flags, tp=tp),
                         penv, logs, ports[0])
            # On a GPU of the prefill's the decode sizes its pool from what the prefill left: start it after.
            dgpu = decode_gpu(args)
            shared = base <= dgpu < base + tp
            dmem = args.mem_decode_shared if shared else args.mem
            dec = Server(f"{name}-decode", server_argv(model, ports[1], dgpu, dmem, dextra + flags), denv, logs, ports[1])
            servers.append(pre.start())
            if shared:
                pre.wait_ready(args.start_timeout)
            servers.append(dec.start())
            if not shared:  # waited above: a second wait would overwrite its ready_s with ~1 s
                pre.wait_ready(args.start_timeout)
            dec.wait_ready(args.start_timeout)
            send = PDClient(pre, dec, boot)
        phase["ready_s"] = {s.name: round(s.ready_s, 1) for s in servers}
        print(f"[{name}] ready_s: {json.dumps(phase['ready_s'])}", flush=True)
        for conc in args.concurrency:
            phase[f"c{conc}"] = run_prompts(send, items, conc)
            print(f"[{name}] concurrency {conc}: {phase[f'c{conc}']['wall_s']} s", flush=True)
        phase["metrics"] = {s.name: s.metrics() for s in servers}
    except Exception as exc:
        record_failure(phase, name, servers, exc, 40)
    finally:
        for s in servers:
            s.stop()
    if name.removesuffix(OPTIMISTIC) == TPROC_PHASE:
        check_transfer_process(phase, name, logs / f"{name}-prefill.log", tp)
    if args.kv_hash and name != "standalone":
        phase["kv_hash"] = kv_hash.compare(Path(args.kv_hash) / name)
        print(f"[{name}] KV bytes: {json.dumps({k: v for k, v in phase['kv_hash'].items() if k != 'mismatches'})}",
              flush=True)
    return phase


def decode_gpu(args) -> int:
    """--decode-gpu, else the GPU after the prefill's (--gpus 2), else the prefill's first (--gpus 1)."""
    if args.decode_gpu is not None:
        return args.decode_gpu
    return args.gpu_base + args.prefill_tp if args.gpus >= 2 else args.gpu_base


def check_transfer_process(phase: Dict, name: str, prefill_log: Path, ranks: int) -> None:
    """A transfer-process phase whose prefill log does not show the child serving fails by name
    (kept beside an earlier failure, which stays the phase's first word)."""
    phase["transfer_process"] = tproc_check.check_log(prefill_log, ranks)
    why = phase["transfer_process"]["failure"]
    print(f"[{name}] transfer process: {why or 'accepted, proven, carried rooms to Success'}", flush=True)
    if why is not None:
        phase["failed"] = f"{phase['failed']}; {why}" if "failed" in phase else why


def kv_hash_env(args, name: str) -> Dict[str, str]:
    """kv_hash.py's switch: one folder per phase, and the prefill TP that decode slices its heads by."""
    folder = Path(args.kv_hash) / name
    folder.mkdir(parents=True, exist_ok=True)
    return {kv_hash.ENV: str(folder), kv_hash.PREFILL_TP_ENV: str(args.prefill_tp)}


def compare_phases(report: Dict, concurrency: List[int], ref_name: str, key_name: str) -> None:
    """Every other phase's outputs against phase `ref_name`'s, per concurrency, as phase[cN][key_name]."""
    ref = report["phases"].get(ref_name)
    for name, phase in report["phases"].items():
        for key in (f"c{c}" for c in concurrency):
            if name != ref_name and ref and key in ref and key in phase:
                phase[key][key_name] = compare(ref[key]["results"], phase[key]["results"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--phases", default="standalone,pd")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--gpus", type=int, default=1)
    ap.add_argument("--mem", type=float, default=0.3)
    ap.add_argument("--mem-decode-shared", type=float, default=0.65)
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--gpu-base", type=int, default=0, help="first GPU this run uses")
    ap.add_argument("--prefill-tp", type=int, default=1, help="prefill TP size (GPUs base..base+tp-1; decode after)")
    ap.add_argument("--decode-gpu", type=int, help="the decode server's GPU; on one of the prefill's it starts "
                    "after the prefill, with --mem-decode-shared (default: after the prefill's, or its first with --gpus 1)")
    ap.add_argument("--standalone-tp", type=int, default=1, help="TP size of the standalone server")
    ap.add_argument("--kv-hash", help="folder: hash each room's KV on both PD sides (kv_hash.py) and compare")
    ap.add_argument("--port-base", type=int, default=11000)
    ap.add_argument("--reference", help="a pd_identity.json whose standalone phase is the reference")
    ap.add_argument("--reference-phase", default="standalone",
                    help="the phase of --reference that serves as the reference (e.g. a stored TP 2 pd: TP 2 and TP 1 "
                    "differ by bf16 arithmetic, so PD at TP 2 compares with PD at TP 2)")
    ap.add_argument("--compare-phase", help="also compare every other phase with this phase of this run (vs_<phase>)")
    ap.add_argument("--dtype", help="--dtype for every server (float32 with TRITON_F32_DEFAULT=ieee: TP 2 matched TP 1, plans.sh tp_proof)")
    ap.add_argument("--tag", default="pd_identity", help="name of the JSON written under --out")
    ap.add_argument("--start-timeout", type=float, default=420)
    args = ap.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    logs = out / "logs"
    items = prompts(args.prompts, args.vocab)
    report: Dict = {"prompts": len(items), "prompt_tokens": [len(p["input_ids"]) for p in items],
                    "chunked_prefill_size": CHUNK, "gpus": args.gpus,
                    "deterministic": args.deterministic, "gpu_base": args.gpu_base,
                    "prefill_tp": args.prefill_tp, "standalone_tp": args.standalone_tp, "dtype": args.dtype,
                    "triton_f32_default": os.environ.get("TRITON_F32_DEFAULT"), "phases": {}}
    ports = [args.port_base, args.port_base + 10, args.port_base + 20]
    for name in args.phases.split(","):
        try:
            phase = run_phase(name, args, items, logs, ports)
        except KeyboardInterrupt:  # a plan step's time limit (timeout -s INT): compare what finished
            report["phases"][name] = {"phase": name, "failed": "interrupted (SIGINT: the step's time limit)"}
            print(f"[{name}] interrupted: the phases before it are still compared", flush=True)
            break
        ports = [p + 100 for p in ports]  # no reuse of a port a stopped server may still hold
        for key in (f"c{c}" for c in args.concurrency):
            if key in phase:
                phase[key]["digest"] = digest(phase[key]["results"])
        report["phases"][name] = phase
        write_json(out / f"{args.tag}.json", report)
        if "failed" in phase and name == "standalone":
            break  # without the reference nothing can be compared
    if args.reference:  # a standalone run beside this one (another GPU) writes it; wait for it
        report["reference"] = args.reference
        ref_path = Path(args.reference)
        deadline = time.monotonic() + args.start_timeout
        while not ref_path.exists() and time.monotonic() < deadline:
            time.sleep(2)
        ref_phase = json.loads(ref_path.read_text())["phases"].get(args.reference_phase) if ref_path.exists() else None
        report["reference_phase"] = args.reference_phase
        report["phases"].setdefault("standalone", ref_phase or {"failed": "no reference"})
    compare_phases(report, args.concurrency, "standalone", "vs_standalone")
    if args.compare_phase:
        compare_phases(report, args.concurrency, args.compare_phase, f"vs_{args.compare_phase}")
    write_json(out / f"{args.tag}.json", report)
    summary = {n: {k: v.get("vs_standalone", v.get("digest")) for k, v in p.items()
                   if k.startswith("c") and isinstance(v, dict)} | ({"failed": p["failed"]} if "failed" in p else {})
               for n, p in report["phases"].items()}
    print(json.dumps(summary, indent=1))
    for line in identity_lines(report, args.concurrency, args.compare_phase):
        print(line, flush=True)


def identity_lines(report: Dict, concurrency: List[int], compare_phase) -> List[str]:
    """One line per phase and concurrency: digest and identity against each reference (plans grep them)."""
    out = []
    for name, phase in report["phases"].items():
        for key in (f"c{c}" for c in concurrency):
            got = phase.get(key)
            if not isinstance(got, dict) or name == "standalone" and "reference" in report:
                continue
            parts = [f"digest {got.get('digest')}"]
            for field, what in (("vs_standalone", "the reference"), (f"vs_{compare_phase}", compare_phase)):
                if field in got:
                    parts.append(f"identical {got[field]['identical']}/{got[field]['total']} vs {what}")
            out.append(f"[{name}] {key}: " + "; ".join(parts))
    return out


if __name__ == "__main__":
    main()
