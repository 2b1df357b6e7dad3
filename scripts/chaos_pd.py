#!/usr/bin/env python3
"""Chaos run: faults under real load, prefill / decode / router on separate network hosts.

    .venv/bin/python scripts/chaos_pd.py                      # every fault, ours and Mooncake (TCP)
    .venv/bin/python scripts/chaos_pd.py --backends mori --faults link_1s,prefill_restart

On this machine: three private network namespaces joined by veth pairs and bridges
(test/harness/chaos/hosts.py) - a prefill host, a decode host and a router-and-client host - inside
a private namespace of their own (the script re-runs itself through scripts/in_private_netns.sh).
The real model (SmolLM2-135M-Instruct, harness.real_model; nothing is downloaded) is served by an
SGLang prefill and decode server through the chosen backend, with sglang_router in front, and
SGLang's own client (bench_serving, random token-id prompts of mixed lengths) drives the load.

For each backend: start the deployment, a warm-up load (its leftovers are the baseline), then one
run per fault (test/harness/chaos/faults.py), each injected while transfers are in flight. Every
completed request is compared with a standalone server's answers to the same prompt ids (greedy),
computed up front by the same client with the same seed, once at the load's concurrency and once at
concurrency 1: a prompt the standalone server itself answers in more than one way (a near-tie that
the batch company breaks) accepts each of its answers and is counted apart as batch-dependent. Prints and writes the fault x backend
table (completed / mismatched / failed with cause / hung / serving again / leftovers) and the
failure causes; exits 1 if any goal of issue 20 is missed.

Bounded: every request by the hang bound (deadline + margin), every client run by --client-cap,
every start-up by --startup-timeout; all processes are stopped by process group on exit.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "python"))
sys.path.insert(0, str(REPO / "test"))  # the harness (test tooling, not in the wheel)

BACKENDS = ("mori", "mooncake_tcp", "mori_builtin")


def chaos_env(deadline_s: float) -> dict:
    """One deadline for every backend: ours per transfer, SGLang's for bootstrap and KV waiting."""
    from harness.failure_env import FAILURE_ENV

    secs = str(int(deadline_s))
    return {**FAILURE_ENV,
            "SGLANG_MORI_TRANSFER_TIMEOUT_MS": str(int(deadline_s * 1000)),
            "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": secs,
            "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": secs}


def server_options(model: Path, deadline_s: float):
    from harness import launch

    # --enable-metrics: our backend's gauges (in-flight writes, queued chunks, open rooms) on /metrics.
    # --disable-radix-cache: every fault run sends the same prompts; without a prefix cache each
    # is computed and its whole KV transferred again, as a new prompt would be.
    return launch.ServerOptions(model_dir=model, extra_env=chaos_env(deadline_s),
                                extra_args=["--enable-metrics", "--disable-radix-cache"])


def reference(model: Path, spec, work: Path, args):
    """The standalone server's answers to the run's prompts (and to the recovery probe): one pass of
    the load per concurrency in --reference-concurrency, so that a prompt whose greedy answer
    depends on its batch company shows up with each answer the standalone server itself gives it."""
    import dataclasses

    from harness import client
    from harness.chaos import runner
    from harness.chaos.load import start_client, wait_client
    from harness.chaos.verdict import merge_references, read_records, references
    from harness.deployment import Standalone

    std = Standalone(server_options(model, args.deadline), work / "logs-standalone")
    try:
        std.start().wait_ready(args.startup_timeout)
        passes = []
        for conc in args.reference_concurrency:
            records = work / f"reference-c{conc}.jsonl"
            proc = start_client(dataclasses.replace(spec, max_concurrency=conc), std.url, model, records,
                                args.client_cap, work / f"reference-c{conc}.client.log", pd=False)
            if wait_client(proc, args.client_cap) != 0:
                raise RuntimeError(f"reference client (concurrency {conc}) failed:\n{proc.tail(20)}")
            passes.append(references(read_records(records)))
            if len(passes[-1]) < spec.num_prompts:
                raise RuntimeError(f"reference incomplete at concurrency {conc}: "
                                   f"{len(passes[-1])}/{spec.num_prompts}")
        probe = client.generate(std.url, runner.PROBE_PROMPT, runner.PROBE_TOKENS)
        if not probe.ok:
            raise RuntimeError(f"reference probe failed: {probe.status}")
        return merge_references(passes), probe.output_ids
    finally:
        std.stop()


def run_backend(backend: str, faults, topo, model: Path, refs, probe_ids, work: Path, args) -> List:
    import dataclasses

    from harness.chaos import runner
    from harness.chaos.deployment import NetnsPD
    from harness.chaos.verdict import read_records
    from harness.chaos.load import start_client, wait_client

    settings = runner.RunSettings(model_dir=model, load=args.spec, deadline_s=args.deadline, margin_s=args.margin,
                                  client_cap_s=args.client_cap)
    dep = NetnsPD(server_options(model, args.deadline), backend, work / f"logs-{backend}", topo)
    results = []
    try:
        t0 = time.monotonic()
        dep.start().wait_ready(args.startup_timeout)
        print(f"[{backend}] up in {time.monotonic() - t0:.0f} s; warm-up load", flush=True)
        warm = work / f"{backend}-warmup.jsonl"
        warm_spec = dataclasses.replace(args.spec, num_prompts=min(16, args.spec.num_prompts))
        proc = start_client(warm_spec, dep.router_url, model, warm, settings.hang_bound_s + 5,
                            work / f"{backend}-warmup.client.log", pd=True, prefix=topo.hosts["router"].prefix())
        wait_client(proc, args.client_cap)
        reqs = read_records(warm)
        slowest = max((r.elapsed(time.monotonic()) for r in reqs), default=0.0)
        print(f"[{backend}] warm-up: {sum(r.success for r in reqs)}/{len(reqs)} answered, slowest {slowest:.1f} s",
              flush=True)
        baseline = runner.drain(dep, topo, settings.drain_s)
        for fault in faults:
            for role in ("prefill", "decode", "router"):
                if not dep.serving(role):  # a former fault left it down: the table says so
                    raise RuntimeError(f"{role} not serving before {fault.name}")
            t1 = time.monotonic()
            r = runner.run_fault(dep, topo, fault, settings, refs, probe_ids, baseline, work)
            if fault.restarts in baseline:  # a new process: its own state is the baseline from now on
                baseline[fault.restarts] = r.snapshots[fault.restarts]
            results.append(r)
            from harness.chaos import table
            print(f"[{backend}] {fault.name} ({time.monotonic() - t1:.0f} s): {r.counts.completed}/"
                  f"{r.counts.requests} ok, {r.counts.mismatch} mismatched, {r.counts.failed} failed, "
                  f"{r.counts.hung} hung, serving again {table.recovered(r)}; {table.verdict(r)}", flush=True)
    except Exception as exc:
        print(f"[{backend}] stopped: {exc}\n{dep.tails(20)}", flush=True)
        results.append(None)
    finally:
        dep.stop()
    return results


def parse_args(argv: Optional[Sequence[str]] = None):
    from harness.chaos.faults import FAULTS
    from harness.chaos.load import LoadSpec

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", default="mori,mooncake_tcp", help=f"comma-separated, from {BACKENDS}")
    p.add_argument("--faults", default=",".join(f.name for f in FAULTS),
                   help=f"comma-separated, from {[f.name for f in FAULTS]}")
    # The load this 2-core host carries within the hang bound (docs/reliability.md): 64 requests
    # of up to 512 tokens overloaded it (the no-fault warm-up alone took 49 s of the 52 s bound).
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--range-ratio", type=float, default=0.125)
    p.add_argument("--max-concurrency", type=int, default=8)
    p.add_argument("--request-rate", type=float, default=8.0)
    p.add_argument("--seed", type=int, default=20)
    p.add_argument("--reference-concurrency", default="",
                   help="comma-separated client concurrencies of the standalone reference passes "
                        "(default: the load's, then 1)")
    p.add_argument("--deadline", type=float, default=12.0, help="transfer deadline, seconds (all backends)")
    p.add_argument("--margin", type=float, default=40.0, help="hung: no answer within deadline + margin")
    p.add_argument("--client-cap", type=float, default=420.0, help="seconds per client run")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--markdown", type=Path)
    p.add_argument("--json", type=Path)
    p.add_argument("--keep-work", action="store_true")
    args = p.parse_args(argv)
    args.backends = [b for b in args.backends.split(",") if b]
    names = {f.name: f for f in FAULTS}
    unknown = [b for b in args.backends if b not in BACKENDS] + [f for f in args.faults.split(",") if f not in names]
    if unknown:
        p.error(f"unknown backends or faults: {unknown}")
    args.fault_list = [names[f] for f in args.faults.split(",")]
    args.reference_concurrency = ([int(c) for c in args.reference_concurrency.split(",") if c]
                                  or [args.max_concurrency, 1])
    args.spec = LoadSpec(args.num_prompts, args.input_len, args.output_len, args.range_ratio,
                         args.max_concurrency, args.request_rate, args.seed)
    return args


def _sigterm(signum, frame):
    raise SystemExit(143)  # unwinds through the finally blocks: every process stopped


def main() -> int:
    if os.environ.get("SGLANG_MORI_IN_NETNS") != "1":
        os.execv("/bin/bash", ["bash", str(REPO / "scripts" / "in_private_netns.sh"), sys.executable, *sys.argv])
    args = parse_args()
    signal.signal(signal.SIGTERM, _sigterm)
    from harness.chaos import table
    from harness.chaos.hosts import Topology
    from harness.chaos.verdict import batch_dependent
    from harness.real_model import ensure_real_model

    model = ensure_real_model()
    work = Path(tempfile.mkdtemp(prefix="sglang-mori-chaos-"))
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"chaos_pd: backends {args.backends}, faults {[f.name for f in args.fault_list]}, load {args.spec}, "
          f"deadline {args.deadline:.0f} s + margin {args.margin:.0f} s; work dir {work}", flush=True)
    results: List = []
    with Topology() as topo:
        t0 = time.monotonic()
        refs, probe_ids = reference(model, args.spec, work, args)
        print(f"reference: {len(refs)} prompts from a standalone server in {len(args.reference_concurrency)} passes "
              f"(concurrency {args.reference_concurrency}) in {time.monotonic() - t0:.0f} s", flush=True)
        for key, texts in batch_dependent(refs).items():
            print(f"reference: batch-dependent prompt ({len(key[0])} tokens from id {key[0][0]}, {key[1]} output "
                  f"tokens): standalone gives {len(texts)} answers: {[t[:40] for t in texts]}", flush=True)
        for backend in args.backends:
            results += run_backend(backend, args.fault_list, topo, model, refs, probe_ids, work, args)
    done = [r for r in results if r is not None]
    text = (f"Run {started}, {len(done)} fault runs; load: {args.spec}; deadline {args.deadline:.0f} s, "
            f"hang bound {args.deadline + args.margin:.0f} s.\n\n{table.render(done)}\n\nFailure causes "
            f"(the client's error text, ids and times masked):\n\n{table.render_causes(done)}\n")
    print("\n" + text)
    if args.markdown:
        args.markdown.write_text(text)
    if args.json:
        args.json.write_text(table.to_json(done))
    ok = len(done) == len(results) and all(table.passed(r) for r in done)
    if ok and not args.keep_work:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"logs and records kept in {work}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
