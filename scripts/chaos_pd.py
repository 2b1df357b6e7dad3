#!/usr/bin/env python3
"""Chaos run: faults under real load, prefill / decode / router on separate network hosts.

    .venv/bin/python scripts/chaos_pd.py                      # every fault, ours and Mooncake (TCP)
    .venv/bin/python scripts/chaos_pd.py --backends mori --faults link_1s,prefill_restart
    .venv/bin/python scripts/chaos_pd.py --seeds 31,7,20 --router-settings launch_pd,defaults

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

--seeds runs the same faults at several load seeds (one reference per seed, from one standalone
server; one deployment per backend and router settings for all seeds): the table then has a row
per seed, and a second table puts each fault's seeds side by side. --router-settings picks the
router's failure-handling flags (harness/router_settings.py): `launch_pd`, those of
scripts/launch_pd.sh (the default), or `defaults`, the router's own; the report states every value.
--markdown / --json are rewritten after every fault run, so a run stopped early keeps its rows.

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


def reference(model: Path, specs, work: Path, args):
    """The standalone server's answers to each seed's prompts (seed -> references) and to the
    recovery probe: one pass of the load per concurrency in --reference-concurrency, so that a prompt
    whose greedy answer depends on its batch company shows up with each answer the standalone server
    itself gives it."""
    import dataclasses

    from harness import client
    from harness.chaos import runner
    from harness.chaos.load import start_client, wait_client
    from harness.chaos.verdict import merge_references, read_records, references
    from harness.deployment import Standalone

    std = Standalone(server_options(model, args.deadline), work / "logs-standalone")
    try:
        std.start().wait_ready(args.startup_timeout)
        by_seed = {}
        for spec in specs:
            passes = []
            for conc in args.reference_concurrency:
                name = f"reference-seed{spec.seed}-c{conc}"
                records = work / f"{name}.jsonl"
                proc = start_client(dataclasses.replace(spec, max_concurrency=conc), std.url, model, records,
                                    args.client_cap, work / f"{name}.client.log", pd=False)
                if wait_client(proc, args.client_cap) != 0:
                    raise RuntimeError(f"reference client (seed {spec.seed}, concurrency {conc}) failed:\n"
                                       f"{proc.tail(20)}")
                passes.append(references(read_records(records)))
                if len(passes[-1]) < spec.num_prompts:
                    raise RuntimeError(f"reference incomplete at seed {spec.seed}, concurrency {conc}: "
                                       f"{len(passes[-1])}/{spec.num_prompts}")
            by_seed[spec.seed] = merge_references(passes)
        probe = client.generate(std.url, runner.PROBE_PROMPT, runner.PROBE_TOKENS)
        if not probe.ok:
            raise RuntimeError(f"reference probe failed: {probe.status}")
        return by_seed, probe.output_ids
    finally:
        std.stop()


def run_backend(backend: str, router: str, faults, topo, model: Path, refs_by_seed, probe_ids, work: Path, args,
                on_result) -> List:
    """One deployment of `backend` behind a router with settings `router`; every fault at every seed."""
    import dataclasses

    from harness import router_settings
    from harness.chaos import runner, table
    from harness.chaos.deployment import NetnsPD
    from harness.chaos.verdict import read_records
    from harness.chaos.load import start_client, wait_client

    name = f"{backend}-{router}"
    dep = NetnsPD(server_options(model, args.deadline), backend, work / f"logs-{name}", topo,
                  router_args=router_settings.router_flags(router))
    results = []
    try:
        t0 = time.monotonic()
        dep.start().wait_ready(args.startup_timeout)
        print(f"[{name}] up in {time.monotonic() - t0:.0f} s; warm-up load", flush=True)
        hang_bound_s = args.deadline + args.margin
        warm = work / f"{name}-warmup.jsonl"
        warm_spec = dataclasses.replace(args.specs[0], num_prompts=min(16, args.specs[0].num_prompts))
        proc = start_client(warm_spec, dep.router_url, model, warm, hang_bound_s + 5,
                            work / f"{name}-warmup.client.log", pd=True, prefix=topo.hosts["router"].prefix())
        wait_client(proc, args.client_cap)
        reqs = read_records(warm)
        slowest = max((r.elapsed(time.monotonic()) for r in reqs), default=0.0)
        print(f"[{name}] warm-up: {sum(r.success for r in reqs)}/{len(reqs)} answered, slowest {slowest:.1f} s",
              flush=True)
        baseline = runner.drain(dep, topo, args.drain)
        for spec in args.specs:
            settings = runner.RunSettings(model_dir=model, load=spec, deadline_s=args.deadline, margin_s=args.margin,
                                          client_cap_s=args.client_cap, drain_s=args.drain)
            run_work = work / f"{name}-seed{spec.seed}"
            run_work.mkdir(exist_ok=True)
            for fault in faults:
                for role in ("prefill", "decode", "router"):
                    if not dep.serving(role):  # a former fault left it down: the table says so
                        raise RuntimeError(f"{role} not serving before {fault.name} (seed {spec.seed})")
                t1 = time.monotonic()
                r = runner.run_fault(dep, topo, fault, settings, refs_by_seed[spec.seed], probe_ids, baseline,
                                     run_work)
                r.router = router
                if fault.restarts in baseline:  # a new process: its own state is the baseline from now on
                    baseline[fault.restarts] = r.snapshots[fault.restarts]
                results.append(r)
                on_result(r)
                print(f"[{name}] seed {spec.seed} {fault.name} ({time.monotonic() - t1:.0f} s): "
                      f"{r.counts.completed}/{r.counts.requests} ok, {r.counts.mismatch} mismatched, "
                      f"{r.counts.failed} failed, {r.counts.hung} hung, serving again {table.recovered(r)}; "
                      f"{table.verdict(r)}", flush=True)
    except Exception as exc:
        print(f"[{name}] stopped: {exc}\n{dep.tails(20)}", flush=True)
        results.append(None)
    finally:
        dep.stop()
    return results


def report(args, started: str, done: List, stopped: int = 0) -> str:
    """The markdown report of the fault runs so far: settings, every row, the seeds side by side,
    the failure causes."""
    from harness import router_settings
    from harness.chaos import table

    routers = "\n".join(f"- {router_settings.describe(r)}" for r in args.router_settings)
    seeds = ", ".join(str(s.seed) for s in args.specs)
    note = f"\n\n**{stopped} deployment(s) stopped early** (see the run's output)." if stopped else ""
    return (f"Run {started}, {len(done)} fault runs; load: {args.specs[0]}, at seeds {seeds}; deadline "
            f"{args.deadline:.0f} s, hang bound {args.deadline + args.margin:.0f} s.\n\n{routers}{note}\n\n"
            f"{table.render(done)}\n\nEvery seed side by side:\n\n{table.render_seeds(done)}\n\n"
            f"Failure causes (the client's error text, ids and times masked):\n\n{table.render_causes(done)}\n")


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
    p.add_argument("--seed", type=int, default=20, help="the load's seed (--seeds: several)")
    p.add_argument("--seeds", default="", help="comma-separated load seeds, each run in turn (default: --seed)")
    p.add_argument("--router-settings", default="launch_pd",
                   help="comma-separated, from ('launch_pd', 'defaults'): the router's failure-handling "
                        "flags of scripts/launch_pd.sh, or the router's own defaults")
    p.add_argument("--reference-concurrency", default="",
                   help="comma-separated client concurrencies of the standalone reference passes "
                        "(default: the load's, then 1)")
    p.add_argument("--deadline", type=float, default=12.0, help="transfer deadline, seconds (all backends)")
    p.add_argument("--margin", type=float, default=40.0, help="hung: no answer within deadline + margin")
    p.add_argument("--client-cap", type=float, default=420.0, help="seconds per client run")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--drain", type=float, default=60.0, help="seconds the servers get to go idle after a load")
    p.add_argument("--markdown", type=Path)
    p.add_argument("--json", type=Path)
    p.add_argument("--keep-work", action="store_true")
    args = p.parse_args(argv)
    from harness.router_settings import SETTINGS

    args.backends = [b for b in args.backends.split(",") if b]
    args.router_settings = [r for r in args.router_settings.split(",") if r]
    names = {f.name: f for f in FAULTS}
    unknown = ([b for b in args.backends if b not in BACKENDS] + [f for f in args.faults.split(",") if f not in names]
               + [r for r in args.router_settings if r not in SETTINGS])
    if unknown:
        p.error(f"unknown backends, faults or router settings: {unknown}")
    if not args.router_settings:
        p.error("--router-settings names none")
    args.fault_list = [names[f] for f in args.faults.split(",")]
    args.reference_concurrency = ([int(c) for c in args.reference_concurrency.split(",") if c]
                                  or [args.max_concurrency, 1])
    try:
        seeds = [int(x) for x in args.seeds.split(",") if x.strip()] or [args.seed]
    except ValueError:
        p.error(f"--seeds takes comma-separated integers, not {args.seeds!r}")
    if len(set(seeds)) != len(seeds):
        p.error(f"--seeds names a seed twice: {seeds}")
    args.specs = [LoadSpec(args.num_prompts, args.input_len, args.output_len, args.range_ratio,
                           args.max_concurrency, args.request_rate, seed) for seed in seeds]
    args.spec = args.specs[0]
    return args


def _sigterm(signum, frame):
    raise SystemExit(143)  # unwinds through the finally blocks: every process stopped


def main() -> int:
    if os.environ.get("SGLANG_MORI_IN_NETNS") != "1":
        os.execv("/bin/bash", ["bash", str(REPO / "scripts" / "in_private_netns.sh"), sys.executable, *sys.argv])
    args = parse_args()
    signal.signal(signal.SIGTERM, _sigterm)
    from harness import router_settings
    from harness.chaos import table
    from harness.chaos.hosts import Topology
    from harness.chaos.verdict import batch_dependent
    from harness.real_model import ensure_real_model

    model = ensure_real_model()
    work = Path(tempfile.mkdtemp(prefix="sglang-mori-chaos-"))
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"chaos_pd: backends {args.backends}, router settings {args.router_settings}, faults "
          f"{[f.name for f in args.fault_list]}, load {args.spec}, seeds {[s.seed for s in args.specs]}, "
          f"deadline {args.deadline:.0f} s + margin {args.margin:.0f} s; work dir {work}", flush=True)
    for r in args.router_settings:
        print(router_settings.describe(r), flush=True)
    done: List = []  # every fault run so far, in order
    stopped: List[str] = []  # deployments that stopped before their last fault run

    def write() -> None:
        if args.markdown:
            args.markdown.write_text(report(args, started, done, len(stopped)))
        if args.json:
            args.json.write_text(table.to_json(done))

    def add(r) -> None:
        done.append(r)
        write()

    with Topology() as topo:
        t0 = time.monotonic()
        refs_by_seed, probe_ids = reference(model, args.specs, work, args)
        print(f"reference: seeds {list(refs_by_seed)} from a standalone server in {len(args.reference_concurrency)} "
              f"passes each (concurrency {args.reference_concurrency}) in {time.monotonic() - t0:.0f} s", flush=True)
        for seed, refs in refs_by_seed.items():
            for key, texts in batch_dependent(refs).items():
                print(f"reference: seed {seed}: batch-dependent prompt ({len(key[0])} tokens from id {key[0][0]}, "
                      f"{key[1]} output tokens): standalone gives {len(texts)} answers: {[t[:40] for t in texts]}",
                      flush=True)
        for backend in args.backends:
            for router in args.router_settings:
                if None in run_backend(backend, router, args.fault_list, topo, model, refs_by_seed, probe_ids,
                                       work, args, add):
                    stopped.append(f"{backend}-{router}")
                write()
    print("\n" + report(args, started, done, len(stopped)))
    ok = not stopped and all(table.passed(r) for r in done)
    if ok and not args.keep_work:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"logs and records kept in {work}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
