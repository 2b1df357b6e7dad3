"""TTFT, ITL and throughput of real SGLang PD (our backend, softio's device path) against a standalone
server, at about 1K and 8K-token prompts, concurrency 1 and 16, layer-wise off and `auto`.

The model is GPU-bound on purpose: Llama-3-8B's widths (hidden 4096, 32 heads, 8 KV heads,
intermediate 14336) with fewer layers, `--load-format dummy` weights (timing only: no token identity
is claimed here). Servers keep SGLang's defaults (overlap scheduler, prefill and decode CUDA graphs,
chunked prefill size) except Triton attention and torch sampling (no sgl_kernel). Prefill on GPU 0,
decode on GPU 1; the standalone server on GPU 0.

Results: OUT/pd_latency.json and a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List

from client_before16 import generate_stream_requests, stream_two_threads
import tproc_check
from servers import PDClient, Server, generate_stream, record_failure, sampling, server_argv

SHAPE = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
         "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
         "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 16384,
         "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
         "vocab_size": 32768, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"}



# Configuration variants: pd_<mode>_threadreads reads destinations and Success on our threads only
# (the path before issue 27's poll reads); pd_<mode>_kernelonly copies every range with softio's
# gather kernel (no copy-engine copies for long ranges: the path before session 14).
# pd_<mode>_cand runs both servers on the candidate tree's sglang_mori (CAND_ROOT, default the
# device copy's cand/, as plans.sh's hotpath_ab) instead of this tree's: the same call's baseline.
VARIANT_ENV = {
    "_threadreads": {"SGLANG_MORI_POLL_READS": "0"},
    "_kernelonly": {"SGLANG_MORI_SOFTIO_CE_MIN_BYTES": "0"},
    "_cand": None,  # cand_env(), made when the config runs
}


def cand_env() -> Dict[str, str]:
    """PYTHONPATH with the candidate's python/ first (SGLang finds our plugin through the entry
    point `sglang_mori.plugin:register`, resolved on PYTHONPATH). A missing candidate fails the
    config by name rather than running this tree's code under the baseline's name."""
    cand = Path(os.environ.get("CAND_ROOT") or Path(__file__).resolve().parents[2] / "cand") / "python"
    if not (cand / "sglang_mori" / "__init__.py").is_file():
        raise FileNotFoundError(f"config *_cand: no candidate tree at {cand} (CAND_ROOT)")
    return {"PYTHONPATH": ":".join(p for p in (str(cand), os.environ.get("PYTHONPATH", "")) if p)}
# Variants that add server flags to the PREFILL server only: pd_<mode>_optimistic lets SGLang run a
# request's forward before decode's destinations arrive (optimistic prefill; layer-wise streams it
# from the hook that sees them, docs/tuning.md).
VARIANT_PREFILL_FLAGS = {
    "_optimistic": ["--optimistic-prefill-attempts", "1"],
}
# Variants that set the PREFILL server's environment only: pd_off_tproc runs the prefill's transfers
# in a transfer process (SGLANG_MORI_TRANSFER_PROCESS=on; chunk-wise only, the prototype refuses
# layer-wise). The config fails by name unless the prefill log shows the child serving (tproc_check.py).
VARIANT_PREFILL_ENV = {
    "_tproc": tproc_check.ENV,
}


def split_variants(mode: str):
    """'auto_optimistic' -> ('auto', {env}, [prefill flags], {prefill env}); suffixes combine in any order."""
    env: Dict[str, str] = {}
    flags: List[str] = []
    prefill_env: Dict[str, str] = {}
    stripped = True
    while stripped:
        stripped = False
        for suffix, extra in VARIANT_ENV.items():
            if mode.endswith(suffix):
                mode, stripped = mode.removesuffix(suffix), True
                env.update(cand_env() if extra is None else extra)
        for suffix, extra in VARIANT_PREFILL_FLAGS.items():
            if mode.endswith(suffix):
                mode, stripped = mode.removesuffix(suffix), True
                flags += extra
        for suffix, extra in VARIANT_PREFILL_ENV.items():
            if mode.endswith(suffix):
                mode, stripped = mode.removesuffix(suffix), True
                prefill_env.update(extra)
    return mode, env, flags, prefill_env


def write_model(path: Path, layers: int) -> str:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(dict(SHAPE, num_hidden_layers=layers)))
    return str(path)


def workload(prompt_tokens: int, count: int, seed: int, vocab: int = SHAPE["vocab_size"]) -> List[Dict]:
    rng = random.Random(seed)  # distinct random prompts: no prefix-cache hits
    return [{"input_ids": [rng.randrange(10, vocab) for _ in range(prompt_tokens)],
             "sampling_params": sampling(64)} for _ in range(count)]


def compiled_files() -> int:
    """Files in the JIT caches (Triton's and SGLang's nvcc kernels): a count that grows during a
    measurement means a kernel was compiled inside it."""
    total = 0
    for root in (Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton")), Path.home() / ".cache"):
        total += sum(len(files) for _, _, files in os.walk(root)) if root.exists() else 0
    return total


def measure(send, items: List[Dict], concurrency: int) -> Dict:
    files_before = compiled_files()
    start = time.monotonic()
    pool = ThreadPoolExecutor(max_workers=concurrency)
    try:
        replies = list(pool.map(send, items))
    except KeyboardInterrupt:  # the time limit: leave the queued requests unsent (the servers stop next)
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()
    wall = time.monotonic() - start
    ok = [r for r in replies if "error" not in r and r.get("ttft_s") is not None]
    ttft = sorted(r["ttft_s"] for r in ok)
    itl = sorted(x for r in ok for x in r["itl_s"])

    def pct(xs, q):
        return round(xs[min(len(xs) - 1, int(q * len(xs)))] * 1000, 2) if xs else None

    return {"requests": len(items), "ok": len(ok), "errors": [r["error"] for r in replies if "error" in r][:3],
            "ttft_ms_p50": pct(ttft, 0.5), "ttft_ms_p90": pct(ttft, 0.9),
            "ttft_ms_mean": round(statistics.mean(ttft) * 1000, 2) if ttft else None,
            "itl_ms_p50": pct(itl, 0.5), "itl_ms_p90": pct(itl, 0.9),
            "output_tok_s": round(sum(r["tokens"] for r in ok) / wall, 1), "wall_s": round(wall, 2),
            "jit_files_added": compiled_files() - files_before,
            "per_request": [{k: r.get(k) for k in ("room", "sent_at", "first_at", "ttft_s", "e2e_s")}
                            for r in replies]}


def run_config(name: str, args, logs: Path, ports: List[int]) -> Dict:
    env = dict(os.environ)
    dummy = ["--load-format", "dummy"]
    if getattr(args, "max_total_tokens", None):  # smaller pools: shorter start-ups (decode's host cache)
        dummy += ["--max-total-tokens", str(args.max_total_tokens)]
    if args.trace:  # room_trace.py's hooks and SGLang's per-request timestamps
        trace_dir = logs / f"trace-{name}"
        trace_dir.mkdir(parents=True, exist_ok=True)
        env["SGLANG_MORI_ROOM_TRACE"] = str(trace_dir)
        dummy += ["--enable-request-time-stats-logging"]
    meter_dir = None
    if getattr(args, "call_meter", False) and name != "standalone":  # our Python per request in both servers (call_meter.py)
        meter_dir = logs / f"meter-{name}"
        env["SGLANG_MORI_CALL_METER"] = str(meter_dir)
    g = args.gpu_base
    result: Dict = {"config": name}
    servers: List[Server] = []
    try:
        if name == "standalone":
            srv = Server(name, server_argv(args.model, ports[0], g, args.mem, dummy), env, logs, ports[0]).start()
            servers.append(srv)
            srv.wait_ready(args.start_timeout)
            sends = {"new": lambda body: generate_stream(srv.url, body),
                     "old": lambda body: generate_stream_requests(srv.url, body)}
        else:
            # pd_<layerwise mode>[_<variant>...]: VARIANT_ENV's variables on both servers,
            # VARIANT_PREFILL_FLAGS' flags on the prefill server
            mode, variant_env, prefill_flags, prefill_env = split_variants(name.split("_", 1)[1])
            denv = dict(env, SGLANG_MORI_ENGINE="soft", **variant_env)
            denv["SGLANG_MORI_LAYERWISE"] = mode
            penv = dict(denv, **prefill_env)
            result["variant"] = {"env": variant_env, "prefill_flags": prefill_flags, "prefill_env": prefill_env}
            boot = ports[2]
            two = args.gpus >= 2
            pre = Server(f"{name}-prefill", server_argv(args.model, ports[0], g, args.mem, [
                "--disaggregation-mode", "prefill", "--disaggregation-transfer-backend", "mori",
                "--disaggregation-bootstrap-port", str(boot)] + prefill_flags + dummy), penv, logs, ports[0])
            # --gpus 1: decode on the prefill's GPU, started once the prefill is up (it sizes its
            # pool from what the prefill left), as pd_identity.py --gpus 1
            dec = Server(f"{name}-decode", server_argv(args.model, ports[1], g + 1 if two else g,
                                                       args.mem if two else args.mem_decode_shared, [
                "--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "mori"] + dummy),
                denv, logs, ports[1])
            servers.append(pre.start())
            if not two:
                pre.wait_ready(args.start_timeout)
            servers.append(dec.start())
            if two:  # waited above: a second wait would overwrite its ready_s with ~1 s
                pre.wait_ready(args.start_timeout)
            dec.wait_ready(args.start_timeout)
            client = PDClient(pre, dec, boot)
            sends = {"new": client.stream, "old": lambda body: stream_two_threads(client, body)}
        result["ready_s"] = {s.name: round(s.ready_s, 1) for s in servers}
        vocab = getattr(args, "vocab", SHAPE["vocab_size"])  # --model-dir's, else the Llama widths'
        for tokens in args.lengths:
            for conc in args.concurrency:
                count = args.requests_c1 if conc == 1 else args.requests_per_conc * conc
                # warm-up (this shape): 2 requests, or --full-warmup a full batch at its concurrency (the
                # kernels of batch `conc` compile here, not in the measurement: session 21)
                warm = conc if getattr(args, "full_warmup", False) else min(conc, 2)
                measure(sends["new"], workload(tokens, max(2, warm), seed=1, vocab=vocab), warm)
                for rep in range(args.repeats):
                    for client_name in args.clients:  # interleaved: each repeat measures every client
                        # the old client's measurements: <shape>_oldclient[_repeatN]
                        key = f"{tokens}tok_c{conc}" + ("" if client_name == "new" else f"_{client_name}client")
                        rkey = key if rep == 0 else f"{key}_repeat{rep}"
                        # each client its own prompts (no prefix-cache hit on the other's); the new
                        # client's seeds are the ones every earlier run used
                        seed = tokens * 100 + conc + rep + (0 if client_name == "new" else 50_000)
                        before = meter_snapshots(meter_dir)
                        result[rkey] = measure(sends[client_name], workload(tokens, count, seed=seed, vocab=vocab), conc)
                        brief = {k: v for k, v in result[rkey].items() if k != "per_request"}
                        print(f"[{name}] {rkey}: {brief}", flush=True)
                        if meter_dir is not None:
                            result[rkey]["call_meter"] = metered(before, meter_snapshots(meter_dir))
                            print(f"[{name}] {rkey} call meter: {describe_meter(result[rkey]['call_meter'])}",
                                  flush=True)
        result["metrics"] = {s.name: s.metrics() for s in servers}
    except Exception as exc:
        record_failure(result, name, servers, exc, 30)
    except KeyboardInterrupt:  # a plan's time limit (timeout -s INT): keep what was measured, stop here
        result["failed"] = "interrupted (time limit); the measurements before it are kept"
        result["interrupted"] = True
    finally:
        for s in servers:
            s.stop()
    if result.get("variant", {}).get("prefill_env", {}).get("SGLANG_MORI_TRANSFER_PROCESS") == "on":
        check_transfer_process(result, name, logs / f"{name}-prefill.log")
    return result


def meter_snapshots(folder):
    """Every server process's meter snapshot written after now (None: the meter is off)."""
    if folder is None:
        return None
    from sglang_mori import call_meter

    return call_meter.wait_fresh(folder, time.time())


def metered(before, after) -> Dict:
    from sglang_mori import call_meter

    return call_meter.per_request(before, after)


def describe_meter(figures: Dict) -> str:
    from sglang_mori import call_meter

    return call_meter.describe(figures)


def check_transfer_process(result: Dict, name: str, prefill_log: Path) -> None:
    """A *_tproc config whose prefill log does not show the transfer process serving fails by name:
    its figures would be the in-process path's under the transfer process's name."""
    result["transfer_process"] = tproc_check.check_log(prefill_log)
    why = result["transfer_process"]["failure"]
    print(f"[{name}] transfer process: {why or 'accepted, proven, carried rooms to Success'}", flush=True)
    if why is not None:
        result["failed"] = f"{result['failed']}; {why}" if "failed" in result else why


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--configs", default="standalone,pd_off,pd_auto")
    ap.add_argument("--lengths", default="1024,8192")
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--requests-c1", type=int, default=8)
    ap.add_argument("--requests-per-conc", type=int, default=2)
    ap.add_argument("--mem", type=float, default=0.5)
    ap.add_argument("--start-timeout", type=float, default=300)
    ap.add_argument("--gpu-base", type=int, default=0, help="standalone and prefill on it, decode on the next")
    ap.add_argument("--max-total-tokens", type=int, help="every server's KV pool size in tokens (default: SGLang's)")
    ap.add_argument("--gpus", type=int, default=2, help="1: decode on the prefill's GPU, started after it")
    ap.add_argument("--mem-decode-shared", type=float, default=0.65,
                    help="--gpus 1: decode's --mem-fraction-static (SGLang sizes it from what the prefill left)")
    ap.add_argument("--port-base", type=int, default=12000)
    ap.add_argument("--repeats", type=int, default=1, help="measure each shape this many times in a row")
    ap.add_argument("--trace", action="store_true", help="per-room timestamps (room_trace.py)")
    ap.add_argument("--model-dir", help="this model folder (its config.json; weights dummy) instead of the "
                    "Llama-3-8B-widths one, e.g. build_model.py --arch mla's")
    ap.add_argument("--full-warmup", action="store_true",
                    help="warm each shape up with a full batch at its concurrency (default: 2 requests)")
    ap.add_argument("--call-meter", action="store_true",
                    help="our Python per request in both PD servers (SGLANG_MORI_CALL_METER, "
                         "python/sglang_mori/call_meter.py): each measurement's `call_meter` entry")
    ap.add_argument("--clients", default="new", help="new (servers.py) and/or old (client_before16.py), "
                    "measured in turn on the same servers: the PD front's A/B")
    ap.add_argument("--tag", default="pd_latency", help="name of the JSON written under --out")
    args = ap.parse_args()
    args.lengths = [int(x) for x in args.lengths.split(",")]
    args.concurrency = [int(x) for x in args.concurrency.split(",")]
    args.clients = args.clients.split(",")
    if not set(args.clients) <= {"new", "old"}:
        ap.error(f"--clients: new and/or old, not {args.clients}")
    out = Path(args.out)
    if args.model_dir:  # another architecture (e.g. build_model.py's MLA), still dummy weights
        args.model = args.model_dir
        shape = json.loads((Path(args.model_dir) / "config.json").read_text())
    else:
        args.model = write_model(Path(f"/tmp/llama8b-widths-{args.tag}"), args.layers)
        shape = dict(SHAPE, num_hidden_layers=args.layers)
    args.vocab = shape["vocab_size"]
    report: Dict = {"model": shape, "load_format": "dummy", "output_tokens": 64, "configs": {}}
    out.mkdir(parents=True, exist_ok=True)
    # This run's own Triton cache: a run beside it (other GPUs) compiles into its own.
    os.environ.setdefault("TRITON_CACHE_DIR", f"/tmp/triton-{args.tag}")
    ports = [args.port_base, args.port_base + 10, args.port_base + 20]
    for name in args.configs.split(","):
        report["configs"][name] = run_config(name, args, out / "logs", ports)
        ports = [p + 100 for p in ports]
        (out / f"{args.tag}.json").write_text(json.dumps(report, indent=1))
        if report["configs"][name].get("interrupted"):
            print(f"[{name}] interrupted: later configs not run", flush=True)
            break
    print("config      shape         TTFT p50  TTFT p90  ITL p50  out tok/s")
    for name, res in report["configs"].items():
        for key, m in res.items():
            if isinstance(m, dict) and "ttft_ms_p50" in m:
                print(f"{name:11s} {key:13s} {m['ttft_ms_p50']!s:>8} {m['ttft_ms_p90']!s:>9} "
                      f"{m['itl_ms_p50']!s:>8} {m['output_tok_s']!s:>10}")


if __name__ == "__main__":
    main()
