"""`scripts/bench_backend.py hotpath`: our Python per request, by thread role, both sides, on softio.

One prefill service and one decode service in this process (test/harness/hotpath/rig.py), driven
as SGLang's schedulers drive them: decode's receiver opens the room and sends its metadata, the
prefill's sender claims it and sends every page with the aux slot in one chunk, both wait for
Success, both clear. Counted with each thread's CPU clock (not wall time): the scheduler thread's
own calls into us one by one, our threads (shard, completion, control; decode's status thread)
whole, minus the CPU spent inside softio's IOEngine calls (C++ that releases the GIL on MORI-IO),
which is reported apart. Needs no SGLang, torch or GPU.
"""

from __future__ import annotations

import json
import sys

DEFAULT_CASES = "mla61p64:1024,mla61p64:8192,gqa32p16:1024,gqa32p16:8192"


def add_arguments(p) -> None:
    p.add_argument("--cases", default=DEFAULT_CASES, help="comma-separated SHAPE:TOKENS (shapes: mla61p64, gqa32p16)")
    p.add_argument("--requests", type=int, default=96, help="measured requests per case")
    p.add_argument("--window", type=int, default=8, help="requests in flight at once")
    p.add_argument("--token-bytes", type=int, default=16,
                   help="bytes per token and buffer (the real 1152 / 2048 move the same Python, more bytes)")
    p.add_argument("--engine", choices=("softio", "instant"), default="softio",
                   help="instant: softio's batch_write returns finished statuses and moves no bytes "
                        "(our Python alone; the polling threads' idle cost no longer follows softio's speed)")
    p.add_argument("--steps", action="store_true",
                   help="also count named steps inside the threads (harness/hotpath/steps.py; about 1 us "
                        "per wrapped call added, so compare totals from runs without it)")
    p.add_argument("--decode-polls", action="store_true",
                   help="decode's scheduler polls its rooms every 1 ms while they wait for prefill, as SGLang "
                        "does (MoriKVManager.check_status: our poll_inbox reads the socket on its thread); "
                        "counted as decode's scheduler.poll; then 2 s of polls with no message: the status "
                        "thread's CPU per second meanwhile (its fixed cost while SGLang polls)")
    p.add_argument("--ipc", action="store_true",
                   help="instead: the scheduler's cost of handing one chunk message to another process "
                        "(harness/hotpath/ipc.py: ZMQ ipc://, AF_UNIX SOCK_SEQPACKET, a shared-memory ring)")
    p.add_argument("--transfer-process", action="store_true",
                   help="also: each case again with the prefill transfer process (SGLANG_MORI_TRANSFER_PROCESS=on; "
                        "harness/hotpath/process_pair.py), the scheduler process's Python per request against "
                        "the in-process total of the same run")
    p.add_argument("--json", action="store_true", help="print one JSON object per case")
    p.add_argument("--backend-root", default="",
                   help="count another checkout's backend (its python/ folder) with this harness: a "
                        "same-run baseline, e.g. a `git worktree` of the commit before a change")


def Path_of(module) -> str:
    from pathlib import Path

    return str(Path(module.__file__).resolve().parents[1])


def _row(result: dict, side: str) -> str:
    rows = result[side]
    parts = [f"{name} {v['ours_us']}" + (f" (+{v['engine_us']} engine)" if v.get("engine_us") else "")
             for name, v in rows.items() if name != "total"]
    total = rows["total"]
    return f"  {side}: ours {total['ours_us']} us/request (engine {total['engine_us']}) = " + ", ".join(parts)


def _print_process_case(args, shape: str, tokens: int, off: dict) -> None:
    """The same case through a transfer process; ratios against the in-process prefill total."""
    from harness.hotpath.process_pair import run_process_case

    on = run_process_case(shape, tokens, args.requests, args.window, args.token_bytes, engine_mode=args.engine)
    off_total = off["prefill"]["total"]["ours_us"]
    on["off_prefill_total_us"] = off_total
    on["ratio_on_off"] = round(on["scheduler_total_us"] / off_total, 3) if off_total else None
    if args.json:
        print(json.dumps({"transfer_process": on}), flush=True)
        return
    parts = ", ".join(f"{k} {v}" for k, v in on["scheduler_us"].items() if k != "scheduler.poll")
    print(f"  transfer process on: scheduler process {on['scheduler_total_us']} us/request = calls "
          f"{on['calls_us']} ({parts}) + {on['polls_per_request']} polls x {on['sync_us_per_poll']} us "
          f"(sync, bulk-timed; {on['metered_polls_us']} us with the per-call meter); off: {off_total} us/request; "
          f"on/off {on['ratio_on_off']}; the child's CPU {on['child_cpu_us']} us/request (moved out), "
          f"{on['wall_s']} s", flush=True)


def run(args) -> int:
    if args.backend_root:
        from pathlib import Path

        if "sglang_mori" in sys.modules:
            raise SystemExit("--backend-root: sglang_mori was imported before the path could change")
        sys.path.insert(0, str(Path(args.backend_root).resolve() / "python"))
    if args.ipc:
        from harness.hotpath.ipc import run_all

        for row in run_all(count=max(200, args.requests * 20)):
            print(json.dumps(row) if args.json else
                  f"[ipc] {row['ipc']:<15} {row['pages']:>4} pages: sender CPU {row['sender_cpu_us_median']} us "
                  f"median, {row['sender_cpu_us_mean']} mean; wall {row['sender_wall_us_median']} us median; "
                  f"receiver ok {row['receiver_ok']}", flush=True)
        return 0
    from harness.hotpath.run import run_case
    import sglang_mori

    print(f"# backend: {Path_of(sglang_mori)}", file=sys.stderr, flush=True)

    for case in args.cases.split(","):
        shape, tokens = case.split(":")
        result = run_case(shape, int(tokens), args.requests, args.window, args.token_bytes,
                          engine_mode=args.engine, steps=args.steps, decode_polls=args.decode_polls)
        if args.json:
            print(json.dumps(result), flush=True)
        else:
            _print_case(args, shape, tokens, result)
        if args.transfer_process:
            _print_process_case(args, shape, int(tokens), result)
    return 0


def _print_case(args, shape: str, tokens: str, result: dict) -> None:
    print(f"[{args.engine}] {shape} {tokens} tokens ({result['pages']} pages), {result['requests']} requests, "
          f"window {result['window']}, {result['wall_s']} s", flush=True)
    print(_row(result, "prefill"))
    print(_row(result, "decode"))
    if result.get("decode_polls"):
        print(f"  decode polls: {result['decode_polls_per_request']} per request; messages read by the poll "
              f"{result['decode_read_by']['poll']}, by the status thread {result['decode_read_by']['thread']}; "
              f"the status thread while polled with no messages: {result['decode_status_polled_idle_us_per_s']} us "
              "CPU per second")
    print(f"  softio's own threads: {result['softio_threads_us']} us/request", flush=True)
    for row in result.get("steps", ()):
        print(f"    {row['thread']:<20} {row['step']:<40} {row['us']:>8} us/request  ({row['calls']} calls)")
