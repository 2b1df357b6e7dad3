#!/usr/bin/env python3
"""Serving benchmark with SGLang's own client: `python -m sglang.benchmark.serving --pd-separated`.

For each PD deployment in --backends, one at a time (prefill + decode + sglang_router, all on
127.0.0.1, started by test/harness/deployment.py exactly as scripts/bench_pd_latency.py does):

- `mori`: ours, through the plugin, on softio;
- `mori_builtin`: SGLang's built-in mori backend on softio, through the `mori` shim;
- `mooncake_tcp`: SGLang's Mooncake backend over TCP (a different transport).

SGLang's client then sends the `random-ids` workload (random token ids, sent as `input_ids` with
--tokenize-prompt so that every request has exactly the asked-for length; nothing is downloaded)
through the router's /generate, streamed, ignore_eos, greedy, and writes its result JSON, which
this script reads back. The model is the local SmolLM2-135M-Instruct checkpoint
(harness.real_model), passed as --model and --tokenizer, with HF_HUB_OFFLINE=1: no model hub.

Prints a markdown table (completed requests, mean / p99 TTFT, mean ITL, output tokens/s, each
also as a ratio to ours). Needs the bench requirements (`make bench-serving-deps`):

    .venv/bin/python -m pip install -r requirements/bench.txt
    .venv/bin/python scripts/bench_serving_pd.py --num-prompts 64 --max-concurrency 8 \
        --input-len 256 --output-len 64

Bounded: --num-prompts requests per backend, every server start-up and every client run has a
deadline, and every process started (servers, router, client) is stopped by its process group id
when its backend is done, also on an error, Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "python"))
sys.path.insert(0, str(REPO / "test"))  # the harness (test tooling, not in the wheel)

BACKENDS = ["mori", "mori_builtin", "mooncake_tcp"]
LABELS = {
    "mori": "ours (mori plugin, softio)",
    "mori_builtin": "SGLang built-in mori (softio via shim)",
    "mooncake_tcp": "Mooncake (TCP)",
}
OURS = "mori"


# ---- pure parts (unit-tested) -------------------------------------------------------------------

@dataclass
class Row:
    backend: str
    num_prompts: int
    completed: Optional[int] = None
    mean_ttft_ms: Optional[float] = None
    p99_ttft_ms: Optional[float] = None
    mean_itl_ms: Optional[float] = None
    output_tok_s: Optional[float] = None
    duration_s: Optional[float] = None
    load_1m: Optional[float] = None
    error: str = ""


def client_argv(python: str, base_url: str, model_dir: Path, out_file: Path, *, num_prompts: int,
                input_len: int, output_len: int, max_concurrency: int, request_rate: float,
                seed: int, warmup_requests: int) -> List[str]:
    """The sglang.benchmark.serving command line for one deployment behind `base_url`."""
    return [
        python, "-m", "sglang.benchmark.serving",
        "--backend", "sglang",  # native /generate through the router
        "--base-url", base_url,
        "--pd-separated",
        "--dataset-name", "random-ids",
        "--tokenize-prompt",  # token ids, not decoded text: exact prompt lengths
        "--random-input-len", str(input_len),
        "--random-output-len", str(output_len),
        "--random-range-ratio", "1.0",  # every request exactly input_len / output_len
        "--num-prompts", str(num_prompts),
        "--max-concurrency", str(max_concurrency),
        "--request-rate", str(request_rate),
        "--model", str(model_dir),
        "--tokenizer", str(model_dir),  # a local directory: no hub look-up
        "--seed", str(seed),
        "--warmup-requests", str(warmup_requests),
        "--ready-check-timeout-sec", "60",
        "--disable-tqdm",
        "--output-file", str(out_file),
    ]


def read_result(out_file: Path) -> Dict:
    """The last JSON object of the client's JSONL output (it appends one line per run)."""
    lines = [ln for ln in Path(out_file).read_text().splitlines() if ln.strip()]
    if not lines:
        raise ValueError(f"{out_file}: no result line")
    return json.loads(lines[-1])


def row_from_result(backend: str, num_prompts: int, result: Dict) -> Row:
    """The figures we report, from the client's result JSON (its key names, in ms and tok/s)."""
    missing = [k for k in ("completed", "mean_ttft_ms", "p99_ttft_ms", "mean_itl_ms",
                           "output_throughput") if result.get(k) is None]
    if missing:
        return Row(backend, num_prompts, completed=result.get("completed"),
                   error=f"result lacks {', '.join(missing)}")
    return Row(backend, num_prompts, completed=int(result["completed"]),
               mean_ttft_ms=float(result["mean_ttft_ms"]), p99_ttft_ms=float(result["p99_ttft_ms"]),
               mean_itl_ms=float(result["mean_itl_ms"]),
               output_tok_s=float(result["output_throughput"]),
               duration_s=(float(result["duration"]) if result.get("duration") is not None else None))


def ratio(value: Optional[float], base: Optional[float]) -> str:
    """value / base as '1.23x'; '-' when either is missing, not finite, or base is 0."""
    if value is None or base is None or not math.isfinite(value) or not math.isfinite(base) or base == 0:
        return "-"
    return f"{value / base:.2f}x"


def _num(value: Optional[float], fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def render_table(rows: Sequence[Row], ours: str = OURS) -> str:
    """Markdown table; the ratio columns are this backend's figure divided by ours (for TTFT and
    ITL above 1 means slower than ours, for tok/s above 1 means more throughput than ours)."""
    base = next((r for r in rows if r.backend == ours and not r.error), None)
    lines = [
        "| backend | completed | mean TTFT ms | p99 TTFT ms | mean ITL ms | output tok/s "
        "| mean TTFT / ours | p99 TTFT / ours | mean ITL / ours | output tok/s / ours | load 1m |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        label = LABELS.get(r.backend, r.backend)
        done = "-" if r.completed is None else f"{r.completed}/{r.num_prompts}"
        if r.error:
            lines.append(f"| {label} | {done} | {r.error} |||||||||")
            continue
        b = base or Row(ours, 0)
        lines.append(
            f"| {label} | {done} | {_num(r.mean_ttft_ms, '.1f')} | {_num(r.p99_ttft_ms, '.1f')} "
            f"| {_num(r.mean_itl_ms, '.2f')} | {_num(r.output_tok_s, '.1f')} "
            f"| {ratio(r.mean_ttft_ms, b.mean_ttft_ms)} | {ratio(r.p99_ttft_ms, b.p99_ttft_ms)} "
            f"| {ratio(r.mean_itl_ms, b.mean_itl_ms)} | {ratio(r.output_tok_s, b.output_tok_s)} "
            f"| {_num(r.load_1m, '.1f')} |")
    return "\n".join(lines)


# ---- running ------------------------------------------------------------------------------------

def unavailable_reason(name: str) -> str:
    from harness import launch
    from harness.plugin_check import plugin_serves_mori

    if name == "mori":
        ok, detail = plugin_serves_mori()
        return "" if ok else f"plugin does not serve mori: {detail.splitlines()[-1] if detail else '?'}"
    if name == "mori_builtin" and not (launch.MORI_SHIM / "mori").is_dir():
        return f"mori shim missing at {launch.MORI_SHIM}"
    return ""


def client_env() -> Dict[str, str]:
    from harness import launch

    env = launch.base_env(None)  # HF_HUB_OFFLINE=1, TRANSFORMERS_OFFLINE=1, the CPU stubs
    # bench_serving flushes the server cache when it believes it runs in SGLang's CI; not here.
    env.pop("SGLANG_IS_IN_CI", None)
    return env


def run_backend(name: str, model: Path, work: Path, args) -> Row:
    from harness import launch
    from harness.deployment import PDDeployment
    from harness.procs import ManagedProcess

    row = Row(name, args.num_prompts)
    row.error = unavailable_reason(name)
    if row.error:
        return row
    opts = launch.ServerOptions(model_dir=model, chunked_prefill_size=args.chunked_prefill_size,
                                max_total_tokens=args.max_total_tokens)
    log_dir = work / f"logs-{name}"
    out_file = work / f"result-{name}.jsonl"
    dep = PDDeployment(opts, name, log_dir)
    client: Optional[ManagedProcess] = None
    t0 = time.monotonic()
    try:
        dep.start()
        dep.wait_ready(args.startup_timeout)
        print(f"  {name}: up in {time.monotonic() - t0:.0f} s; running sglang.benchmark.serving ...", flush=True)
        argv = client_argv(sys.executable, dep.router_url, model, out_file, num_prompts=args.num_prompts,
                           input_len=args.input_len, output_len=args.output_len,
                           max_concurrency=args.max_concurrency, request_rate=args.request_rate,
                           seed=args.seed, warmup_requests=args.warmup_requests)
        client = ManagedProcess("bench_serving", argv, client_env(), log_dir / "bench_serving.log").start()
        try:
            code = client.proc.wait(timeout=args.client_timeout)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"sglang.benchmark.serving did not finish in {args.client_timeout:.0f} s") from None
        if code != 0 or not out_file.exists():
            raise RuntimeError(f"sglang.benchmark.serving exited with {code}:\n{client.tail(30)}")
        result = read_result(out_file)
        errors = [e for e in result.get("errors", []) if e]
        row = row_from_result(name, args.num_prompts, result)
        row.load_1m = os.getloadavg()[0]
        print(f"  {name}: {row.completed}/{args.num_prompts} completed in {row.duration_s or 0:.1f} s "
              f"(load average {row.load_1m:.1f}){'; first error: ' + errors[0][:200] if errors else ''}",
              flush=True)
    except Exception as exc:  # one broken backend must not hide the others' numbers
        row.error = f"failed: {str(exc).splitlines()[0][:200]} (logs: {log_dir})"
        print(f"  {name}: {row.error}", flush=True)
    finally:
        if client is not None:
            client.stop()
        dep.stop()
    return row


def parse_args(argv: Optional[Sequence[str]] = None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", default=",".join(BACKENDS), help=f"comma-separated, from {BACKENDS}")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=64, help="generated tokens per request (ignore_eos)")
    p.add_argument("--max-concurrency", type=int, default=8)
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="Poisson arrivals per second (inf: all at once, bounded by --max-concurrency)")
    p.add_argument("--warmup-requests", type=int, default=2)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--chunked-prefill-size", type=int, default=64)
    p.add_argument("--max-total-tokens", type=int, default=8192)
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--client-timeout", type=float, default=1200.0, help="seconds per client run")
    p.add_argument("--markdown", type=Path, help="also write the table to this file")
    p.add_argument("--keep-work", action="store_true", help="keep the logs and result files on success too")
    p.add_argument("--no-netns", action="store_true")
    args = p.parse_args(argv)
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = sorted(set(args.backends) - set(BACKENDS))
    if unknown:
        p.error(f"unknown backends {unknown}; choose from {BACKENDS}")
    if args.num_prompts < 1 or args.max_concurrency < 1:
        p.error("--num-prompts and --max-concurrency must be >= 1")
    return args


def _sigterm(signum, frame):
    raise SystemExit(143)  # unwinds through run_backend's finally: servers and client stopped


def main() -> int:
    args = parse_args()
    if not args.no_netns and os.environ.get("SGLANG_MORI_IN_NETNS") != "1":
        os.execv("/bin/bash", ["bash", str(REPO / "scripts" / "in_private_netns.sh"), sys.executable, *sys.argv])
    signal.signal(signal.SIGTERM, _sigterm)
    try:
        import datasets  # noqa: F401  (sglang.benchmark.serving imports it at start-up)
    except ImportError:
        sys.exit("sglang.benchmark.serving needs `datasets`: .venv/bin/python -m pip install -r requirements/bench.txt")
    from harness.real_model import ensure_real_model

    model = ensure_real_model()
    work = Path(tempfile.mkdtemp(prefix="sglang-mori-bench-serving-"))
    print(f"bench_serving_pd: {args.backends}; {args.num_prompts} requests x {args.input_len} in / "
          f"{args.output_len} out tokens, max concurrency {args.max_concurrency}, request rate "
          f"{args.request_rate}; model {model}; work dir {work}", flush=True)
    rows: List[Row] = []
    try:
        for name in args.backends:
            rows.append(run_backend(name, model, work, args))
    except KeyboardInterrupt:
        print("interrupted")
    header = (f"sglang.benchmark.serving --pd-separated, random-ids, {args.num_prompts} requests x "
              f"{args.input_len} prompt tokens / {args.output_len} output tokens (ignore_eos, greedy, "
              f"streamed), max concurrency {args.max_concurrency}, request rate {args.request_rate}; "
              f"SmolLM2-135M-Instruct (float32, CPU), chunked prefill {args.chunked_prefill_size}. "
              f"Ratios: backend / ours.\n\n")
    text = header + render_table(rows)
    print("\n" + text)
    if args.markdown:
        args.markdown.write_text(text + "\n")
    failed = [r for r in rows if r.error] or len(rows) < len(args.backends)
    if not failed and not args.keep_work:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
