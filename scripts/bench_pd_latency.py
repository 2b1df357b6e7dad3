#!/usr/bin/env python3
"""TTFT and inter-token latency over the SGLang router, PD backends against a standalone server.

One run measures, one configuration at a time (only one deployment alive, so they do not compete
for the 2 cores):
  mori          our backend through the plugin, softio engine (SGLANG_MORI_ENGINE=soft)
  mori_layerwise  the same with layer-wise streaming forced (SGLANG_MORI_LAYERWISE=on, MIN_TOKENS=1,
                MIN_BATCH_TOKENS=0: every batch streams, however short)
  mori_layerwise_default  SGLANG_MORI_LAYERWISE=on with the default thresholds (batches under 8192
                tokens go chunk-wise: the `short_batch` fallback)
  mori_tproc    ours with SGLANG_MORI_TRANSFER_PROCESS=on (refused with a warning where the pools
                cannot be shared with the child: then in-process)
  mori_builtin  SGLang 0.5.23's own mori backend, on softio through the mori shim (PYTHONPATH)
  mooncake_tcp  SGLang's Mooncake backend over TCP (needs libibverbs.so.1 installed)
  standalone    one ordinary server, no disaggregation: the baseline of the ratios

Each PD configuration is prefill + decode + router with the tiny local model (or, with
--model real, SmolLM2-135M-Instruct: 30 layers, 46 KiB of float32 KV per token, converted by
harness.real_model; --prompt-tokens N then gives long prompts of about N tokens); every request is
greedy, streamed, with ignore_eos so that all configurations generate the same number of tokens.
Two phases on the same prompts: `seq` (one request at a time: pure latency) and `batch` (all at
once up to --concurrency). Prints a markdown table with ratios to standalone, and checks that every
configuration produced the standalone server's tokens.

    .venv/bin/python scripts/bench_pd_latency.py [--configs mori,mooncake_tcp,...] [--prompts 32]
    # the layer-wise workload (docs/benchmarks.md): one prefill chunk per request, so chunk-wise
    # moves all of a request's KV after its forward; a capped link makes that transfer visible
    .venv/bin/python scripts/bench_pd_latency.py --model real --prompt-tokens 1000 --prompts 6 \
        --chunked-prefill-size 2048 --max-new-tokens 8 --concurrency 2 --max-total-tokens 16384 \
        --link-mbps 25 --configs mori_layerwise,mori,standalone
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "python"))
sys.path.insert(0, str(REPO / "test"))  # the harness (test tooling, not in the wheel)

from harness import client, launch  # noqa: E402
from harness.deployment import PDDeployment, Standalone  # noqa: E402
from harness.plugin_check import plugin_serves_mori  # noqa: E402
from harness.prompts import varied_prompts  # noqa: E402
from harness.tiny_model import build_tiny_model  # noqa: E402
from harness.transfer_stats import TransferProbe  # noqa: E402

CONFIGS = ["mori", "mori_layerwise", "mori_layerwise_default", "mori_tproc", "mori_builtin", "mooncake_tcp",
           "standalone"]
LAYERWISE_ENV = {"SGLANG_MORI_LAYERWISE": "on", "SGLANG_MORI_LAYERWISE_MIN_TOKENS": "1",
                 "SGLANG_MORI_LAYERWISE_MIN_BATCH_TOKENS": "0"}
# Ours with layer-wise on as a user turns it on: the default thresholds decide per batch.
BACKEND_ENV = {"mori_layerwise": LAYERWISE_ENV, "mori_layerwise_default": {"SGLANG_MORI_LAYERWISE": "on"},
               # the prefill's transfers in a transfer process (issue 28's prototype; refused with a
               # warning where the pools cannot be shared, then in-process)
               "mori_tproc": {"SGLANG_MORI_TRANSFER_PROCESS": "on"}}
LONG_WORDS = ("river mountain city forest engine memory cache prefill decode token batch server router request "
              "transfer page layer kernel tensor signal packet network queue thread worker lane buffer offset "
              "morning evening winter summer stone glass paper music light").split()


SOFTIO_CONFIGS = ("mori", "mori_layerwise", "mori_layerwise_default", "mori_tproc", "mori_builtin")  # the configurations whose bytes move over softio


def link_cap_env(mbps: float) -> Dict[str, str]:
    """softio's bandwidth cap (fault injection's set_bandwidth, on every engine of the deployment;
    only prefill's engine sends): a link slower than this host's memory, as a NIC is slower than
    a GPU's prefill, so that the transfer becomes a visible part of TTFT. Mooncake/TCP is a
    different transport and is not capped."""
    return {"SGLANG_MORI_SOFTIO_FAULTS": json.dumps([{"kind": "set_bandwidth", "bytes_per_s": mbps * 1e6}])}


def long_prompts(count: int, tokens: int, seed: int = 17) -> List[str]:
    """About `tokens` tokens each (one word is about one token for these tokenizers)."""
    rng = random.Random(seed)
    return [f"Story {i}: " + " ".join(rng.choice(LONG_WORDS) for _ in range(tokens)) for i in range(count)]


def bench_prompts(args, count: int, seed: int) -> List[str]:
    return long_prompts(count, args.prompt_tokens, seed) if args.prompt_tokens else varied_prompts(count, seed=seed)


@dataclass
class PhaseResult:
    ttft: List[float] = field(default_factory=list)
    itl: List[float] = field(default_factory=list)  # every token gap of every request
    outputs: List[List[int]] = field(default_factory=list)
    wall_s: float = 0.0
    errors: int = 0


@dataclass
class ConfigResult:
    name: str
    phases: Dict[str, PhaseResult] = field(default_factory=dict)
    kv_bytes_per_req: Optional[float] = None
    kv_ms_per_req: Optional[float] = None
    startup_s: float = 0.0
    # 1-minute load average when the measurement ended: a shared 2-core host skews latencies, and
    # the table should say so rather than hide it.
    load_1m: float = 0.0
    unavailable: str = ""
    # --call-meter: our Python per request in each server, per phase (python/sglang_mori/call_meter.py)
    meter: Dict[str, Dict] = field(default_factory=dict)


def pct(values: List[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def mean(values: List[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def run_phase(url: str, prompts: List[str], max_new_tokens: int, concurrency: int) -> PhaseResult:
    start = time.monotonic()
    gens = client.generate_many(url, prompts, max_new_tokens, concurrency=concurrency, stream=True,
                                ignore_eos=True)
    result = PhaseResult(wall_s=time.monotonic() - start)
    for g in gens:
        if not g.ok or g.ttft_s is None:
            result.errors += 1
            result.outputs.append([])
            continue
        result.ttft.append(g.ttft_s)
        result.itl.extend(g.itl_s)
        result.outputs.append(g.output_ids)
    return result


def meter_snapshots(folder: Optional[Path]) -> Optional[Dict]:
    if folder is None:
        return None
    from sglang_mori import call_meter

    return call_meter.wait_fresh(folder, time.time())


def meter_phase(result: ConfigResult, phase: str, folder: Optional[Path], before: Optional[Dict]) -> Optional[Dict]:
    """The phase's figures per request from the snapshots before it and now; returns now's."""
    if folder is None:
        return None
    from sglang_mori import call_meter

    after = meter_snapshots(folder)
    result.meter[phase] = call_meter.per_request(before, after)
    print(f"  {result.name} {phase} call meter: {call_meter.describe(result.meter[phase])}", flush=True)
    return after


def unavailable_reason(name: str) -> str:
    if name in ("mori", "mori_layerwise", "mori_layerwise_default", "mori_tproc"):
        ok, detail = plugin_serves_mori()
        return "" if ok else f"plugin does not serve mori: {detail.splitlines()[-1] if detail else '?'}"
    if name == "mori_builtin" and not (launch.MORI_SHIM / "mori").is_dir():
        return f"mori shim missing at {launch.MORI_SHIM}"
    return ""


def bench_config(name: str, model: Path, work: Path, args) -> ConfigResult:
    result = ConfigResult(name)
    result.unavailable = unavailable_reason(name)
    if result.unavailable:
        return result
    # --enable-metrics everywhere (same overhead for all); the prefill's counters give KV bytes.
    opts = launch.ServerOptions(model_dir=model, chunked_prefill_size=args.chunked_prefill_size,
                                max_total_tokens=args.max_total_tokens, extra_args=["--enable-metrics"])
    log_dir = work / f"logs-{name}"
    backend, env = ("mori", dict(BACKEND_ENV[name])) if name in BACKEND_ENV else (name, {})
    if args.link_mbps and name in SOFTIO_CONFIGS:
        env.update(link_cap_env(args.link_mbps))
    meter_dir = work / f"meter-{name}" if args.call_meter and name.startswith("mori") else None
    if meter_dir is not None:
        env["SGLANG_MORI_CALL_METER"] = str(meter_dir)
    dep = Standalone(opts, log_dir) if name == "standalone" else PDDeployment(opts, backend, log_dir, env=env)
    url = dep.url if name == "standalone" else dep.router_url
    prompts = bench_prompts(args, args.prompts, seed=11)
    t0 = time.monotonic()
    try:
        dep.start()
        dep.wait_ready(300)
        result.startup_s = time.monotonic() - t0
        print(f"  {name}: up in {result.startup_s:.0f} s; warm-up ...", flush=True)
        run_phase(url, varied_prompts(4, seed=3), 8, concurrency=1)
        if args.prompt_tokens:
            run_phase(url, long_prompts(1, args.prompt_tokens, seed=3), 4, concurrency=1)
        probe = TransferProbe(dep.prefill_url) if name != "standalone" else None
        if probe:
            probe.before()
        before = meter_snapshots(meter_dir)
        result.phases["seq"] = run_phase(url, prompts, args.max_new_tokens, concurrency=1)
        before = meter_phase(result, "seq", meter_dir, before)
        kv = probe.after() if probe else None
        if kv:
            result.kv_bytes_per_req = kv.nbytes / len(prompts)
            result.kv_ms_per_req = kv.seconds * 1000 / len(prompts)
        result.phases["batch"] = run_phase(url, prompts, args.max_new_tokens, concurrency=args.concurrency)
        meter_phase(result, "batch", meter_dir, before)
        result.load_1m = os.getloadavg()[0]
        print(f"  {name}: done (load average {result.load_1m:.1f})", flush=True)
    except Exception as exc:  # one broken configuration must not hide the others' numbers
        result.unavailable = f"failed: {str(exc).splitlines()[0][:200]} (logs: {log_dir})"
    finally:
        dep.stop()
    return result


def table(results: List[ConfigResult], args) -> str:
    base = {r.name: r for r in results}.get("standalone")
    prompts = (f"{args.prompts} prompts of ~{args.prompt_tokens} tokens" if args.prompt_tokens
               else f"{args.prompts} prompts of 10-600 tokens")
    link = (f"softio link capped at {args.link_mbps:g} MB/s for {', '.join(SOFTIO_CONFIGS)}; "
            if args.link_mbps else "")
    lines = [
        f"{link}{prompts} ({args.model} model), {args.max_new_tokens} new tokens each (greedy, "
        f"ignore_eos, streamed), chunked prefill {args.chunked_prefill_size}; `seq`: one at a time, "
        f"`batch`: {args.concurrency} concurrent. Times in ms; x = ratio to standalone.",
        "",
        "| config | phase | TTFT p50 | TTFT p90 | ITL mean | ITL p90 | wall s | TTFT p50 x | ITL mean x "
        "| KV KiB/req | transfer ms/req | errors | tokens = standalone | load 1m |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if r.unavailable:
            lines.append(f"| {r.name} | - | {r.unavailable} ||||||||||||")
            continue
        for phase, p in r.phases.items():
            ref = base.phases.get(phase) if base and not base.unavailable else None
            ratio_ttft = f"{pct(p.ttft, .5) / pct(ref.ttft, .5):.2f}" if ref else "-"
            ratio_itl = f"{mean(p.itl) / mean(ref.itl):.2f}" if ref else "-"
            same = "-" if not ref else ("yes" if p.outputs == ref.outputs else "NO")
            kv = f"{r.kv_bytes_per_req / 1024:.1f}" if r.kv_bytes_per_req is not None and phase == "seq" else "-"
            kv_ms = f"{r.kv_ms_per_req:.2f}" if r.kv_ms_per_req is not None and phase == "seq" else "-"
            lines.append(
                f"| {r.name} | {phase} | {pct(p.ttft, .5) * 1000:.1f} | {pct(p.ttft, .9) * 1000:.1f} "
                f"| {mean(p.itl) * 1000:.2f} | {pct(p.itl, .9) * 1000:.2f} | {p.wall_s:.1f} "
                f"| {ratio_ttft} | {ratio_itl} | {kv} | {kv_ms} | {p.errors} | {same} | {r.load_1m:.1f} |")
    summary = excess_summary(results)
    return "\n".join(lines + ([f"\n{summary}"] if summary else []))


def excess_summary(results: List[ConfigResult]) -> str:
    """Issue 12's goal: layer-wise removes at least half of chunk-wise's TTFT excess over standalone."""
    by = {r.name: r for r in results if not r.unavailable and "seq" in r.phases}
    if not {"standalone", "mori", "mori_layerwise"} <= set(by):
        return ""
    ref = pct(by["standalone"].phases["seq"].ttft, .5)
    chunk = pct(by["mori"].phases["seq"].ttft, .5) - ref
    layer = pct(by["mori_layerwise"].phases["seq"].ttft, .5) - ref
    removed = f"{(1 - layer / chunk) * 100:.0f}%" if chunk > 0 else "n/a"
    return (f"TTFT p50 excess over standalone (seq): chunk-wise {chunk * 1000:.1f} ms, layer-wise "
            f"{layer * 1000:.1f} ms; layer-wise removes {removed} of chunk-wise's excess (goal: >= 50%).")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, from {CONFIGS}")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--chunked-prefill-size", type=int, default=64)
    p.add_argument("--model", choices=["tiny", "real"], default="tiny",
                   help="real: SmolLM2-135M-Instruct via harness.real_model (30 layers)")
    p.add_argument("--prompt-tokens", type=int, default=0, help="long prompts of about N tokens (0: varied)")
    p.add_argument("--max-total-tokens", type=int, default=8192)
    p.add_argument("--markdown", type=Path, help="also write the table to this file")
    p.add_argument("--link-mbps", type=float, default=0.0,
                   help="cap softio's send rate to this many MB/s for the softio configurations "
                        f"({', '.join(SOFTIO_CONFIGS)}): a slow link that makes the transfer visible in TTFT")
    p.add_argument("--no-netns", action="store_true")
    p.add_argument("--call-meter", action="store_true",
                   help="our Python per request in the PD servers of mori* configs, per phase "
                        "(SGLANG_MORI_CALL_METER; python/sglang_mori/call_meter.py)")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    if not args.no_netns and os.environ.get("SGLANG_MORI_IN_NETNS") != "1":
        os.execv("/bin/bash", ["bash", str(REPO / "scripts" / "in_private_netns.sh"), sys.executable, *sys.argv])
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = set(configs) - set(CONFIGS)
    if unknown:
        sys.exit(f"unknown configs {sorted(unknown)}; choose from {CONFIGS}")
    work = Path(tempfile.mkdtemp(prefix="sglang-mori-bench-"))
    if args.model == "real":
        from harness.real_model import ensure_real_model

        model = ensure_real_model()
    else:
        model = build_tiny_model(work / "tiny-llama")
    print(f"bench_pd_latency: {configs}; work dir {work}", flush=True)
    results = []
    try:
        for name in configs:
            results.append(bench_config(name, model, work, args))
    except KeyboardInterrupt:
        print("interrupted")
    text = table(results, args)
    print("\n" + text)
    for r in results:  # --call-meter: every figure (calls and threads by name, calls per request)
        if r.meter:
            print(f"call meter {r.name}: {json.dumps(r.meter)}")
    if args.markdown:
        args.markdown.write_text(text + "\n")
    failed = [r for r in results if r.unavailable]
    if not failed:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
