#!/usr/bin/env python3
"""The GPU rig benchmark: what the backend costs a forward pass, on one CUDA GPU.

Prefill and decode run as separate processes on the GPU with this project's real services,
layer-wise session, worker and hooks (test/gpu: stand-ins only for SGLang's scheduler objects),
KV pools in device memory with real shapes, and KV moved by softio's device path (CUDA IPC,
copies on the engine's stream; the stand-in for MORI-IO's XGMI route), paced like one NIC.

Parts (--parts, comma-separated):
  cost          forward time with layer-wise off and on, at each token count and batch size;
                also the transfer tail (forward end -> last byte landed) of both modes
  interference  the forward's slowdown (prefill) and the decode step's (decode) while chunk-wise
                transfers run in the background at fixed request rates; CPU per thread role
  link          two GPUs (decode on --decode-device): GB/s of one request and of a burst at
                --link-tokens, ours against a plain copy and the built-in's engine calls
                (test/gpu/link_bench.py), for each gather grid in --blocks
Every figure is a median over --iters runs, measured in this run: ratios, not absolutes, are the
result. The command docs/benchmarks.md reports:

    SGLANG_MORI_SOFTIO_LINK_GBPS=48 python3 scripts/gpu_bench.py --json $OUT/gpu_bench.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "test" / "gpu"), str(ROOT / "test" / "inprocess"), str(ROOT / "python")]


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def cost_point(rig, tokens: int, count: int, iters: int, side: bool, seed: int) -> dict:
    import numpy as np
    from pd_rig import Requests
    from thread_roles import ThreadCpu

    reqs = Requests(rig.page_size, tokens, count, 0, np.random.default_rng(seed))
    out = {}
    for mode in ("off", "on"):
        for i in range(2):  # warm-up: plans, sessions, allocator, kernels
            rig.prefill_batch(reqs, layerwise=mode == "on", side_stream=side, seed=seed + i)
            rig.release(rig.last_rooms)
    fwd = {"off": [], "on": []}
    tail = {"off": [], "on": []}
    cpu = {"off": {}, "on": {}}
    failures = []
    for i in range(iters):
        for mode in ("off", "on") if i % 2 == 0 else ("on", "off"):
            meter = ThreadCpu()
            r = rig.prefill_batch(reqs, layerwise=mode == "on", side_stream=side, seed=seed + 10 + i)
            for role, s in meter.since().items():
                cpu[mode][role] = cpu[mode].get(role, 0.0) + s
            rig.release(rig.last_rooms)
            fwd[mode].append(r.forward_ms)
            tail[mode].append(r.tail_ms)
            failures += r.failures
    out = {
        "tokens": tokens, "requests": count, "side_stream": side,
        "forward_ms": {m: median(v) for m, v in fwd.items()},
        "tail_ms": {m: median(v) for m, v in tail.items()},
        "forward_spread_ms": {m: [min(v), max(v)] for m, v in fwd.items()},
        "cpu_ms_per_step": {m: {k: round(v * 1e3 / iters, 2) for k, v in sorted(c.items(), key=lambda kv: -kv[1])[:8]}
                            for m, c in cpu.items()},
        "failures": failures,
    }
    out["overhead_pct"] = 100.0 * (out["forward_ms"]["on"] / out["forward_ms"]["off"] - 1.0)
    tail_off = out["tail_ms"]["off"]
    out["tail_removed_pct"] = 100.0 * (1.0 - out["tail_ms"]["on"] / tail_off) if tail_off > 0 else float("nan")
    return out


def run_cost(args, results: list) -> None:
    from pd_rig import GpuPD
    from shapes import pages_for

    for spec in args.shapes.split(","):
        shape_key, page = spec.split(":")
        page = int(page)
        tokens = [int(t) for t in args.tokens.split(",")]
        counts = [int(c) for c in args.requests.split(",")]
        pages = max(pages_for(t, page) * c for t in tokens for c in counts)
        with GpuPD(shape_key, page, pages, group_size=args.group, decode_device=args.decode_device) as rig:
            for t in tokens:
                for c in counts:
                    for side in ([False, True] if args.side_stream and t in (512, 4096) and c == 1 else [False]):
                        t0 = time.time()
                        point = cost_point(rig, t, c, args.iters, side, seed=t + c)
                        point.update(shape=rig.shape.name, page_size=page, group=args.group,
                                     decode_device=args.decode_device,
                                     fallbacks=rig.prefill.metrics_snapshot()["fallbacks"])
                        results.append(point)
                        args.save()
                        print(f"cost {rig.shape.name} p{page} {t:>6} tok x{c} {'side' if side else 'dflt'}: "
                              f"fwd off {point['forward_ms']['off']:8.2f} on {point['forward_ms']['on']:8.2f} ms "
                              f"({point['overhead_pct']:+6.1f}%)  tail off {point['tail_ms']['off']:7.2f} "
                              f"on {point['tail_ms']['on']:7.2f} ms  [{time.time() - t0:.0f}s]", flush=True)


def run_link(args, results: list) -> None:
    from link_bench import device_engine, link_point
    from pd_rig import GpuPD
    from shapes import pages_for

    tokens = [int(t) for t in args.link_tokens.split(",")]
    for spec in args.shapes.split(","):
        shape_key, page = spec.split(":")
        page = int(page)
        pages = max(pages_for(t, page) for t in tokens) * args.link_requests
        with GpuPD(shape_key, page, pages, decode_device=args.decode_device) as rig:
            # through a transfer process the copies are the child's: its default grid only
            dev = None if args.transfer_process else device_engine(rig)
            copier = dev.copier if dev else None
            grids = [(0, 0) if g == "default" else tuple(int(x) for x in g.split("x")) for g in args.blocks.split(",")]
            defaults = (copier.blocks, copier.peer_blocks, copier.threads) if copier is not None else None
            for t in tokens:
                for blocks, threads in grids:
                    if copier is not None and blocks:
                        copier.blocks = copier.peer_blocks = blocks
                        copier.threads = threads
                    elif copier is not None:  # the defaults: what a deployment gets
                        copier.blocks, copier.peer_blocks, copier.threads = defaults
                        blocks, threads = copier.peer_blocks, copier.threads
                    t0 = time.time()
                    point = link_point(rig, t, args.link_requests, args.iters, seed=t)
                    point.update(shape=rig.shape.name, page_size=page, blocks=blocks, threads=threads,
                                 devices=[rig.prefill.device, rig.decode_device])
                    results.append(point)
                    args.save()
                    ours = point["ours"]
                    print(f"link {rig.shape.name} p{page} {t:>6} tok {'tp' if args.transfer_process else 'in'} "
                          f"grid {blocks:>3}x{threads}: plain {point['plain_copy']['gbps']:6.1f} GB/s; ours "
                          f"{ours['gbps']:6.1f} ({ours['vs_plain_copy']:.2f}x), burst {ours['gbps_per_s']:6.1f} "
                          f"({ours['per_s_vs_plain_copy']:.2f}x), kernel {point.get('kernel', {}).get('gbps', 0.0):6.1f}; "
                          f"ours_calls {point.get('ours_calls', {}).get('gbps', 0.0):6.1f}; builtin_calls "
                          f"{point.get('builtin_calls', {}).get('gbps', 0.0):6.1f} GB/s; ops {ours['ops']}; "
                          f"phases ms {ours.get('phases_ms', {})}, burst {ours.get('burst_phases_ms', {})} [{time.time() - t0:.0f}s]",
                          flush=True)


def send_due(rig, bg, rate: float, start: float, sent: int, live: list) -> int:
    """Open and send the background requests due by now at `rate`; release the concluded ones.
    Returns the new count sent."""
    poll = getattr(rig.prefill, "poll", None)  # a transfer process's statuses come by polls
    if poll is not None:
        poll()
    due = int((time.perf_counter() - start) * rate) - sent
    if due > 0:
        rooms = rig.next_rooms(due)
        rig.open_rooms(bg, rooms, [k % bg.count for k in range(len(rooms))])
        for k, room in enumerate(rooms):
            rig.prefill.send_all(room, bg.src[k % bg.count])
        live += rooms
        sent += due
    done = [r for r in live if r in rig.prefill.sglang.concluded_at]
    if done:
        for r in done:
            rig.prefill.release(r)
        rig.ask("clear", done)
        gone = set(done)
        live[:] = [r for r in live if r not in gone]
    return sent


def drain(rig, live: list) -> None:
    if live:
        rig.prefill.sglang.wait_concluded(live, 60)
        for r in live:
            rig.prefill.release(r)
        rig.ask("clear", live)
        live.clear()


def forwards_free_load(rig, bg, rate: float, seconds: float):
    """The background load alone for `seconds` (the prefill runs no forward)."""
    live, sent = [], 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        sent = send_due(rig, bg, rate, start, sent, live)
        time.sleep(0.002)
    drain(rig, live)
    return None, sent


def run_interference(args, results: list) -> None:
    import numpy as np
    from pd_rig import GpuPD, Requests
    from engine_meter import metered_engine
    from thread_roles import ThreadCpu

    fwd_tokens = args.fwd_tokens
    for spec in args.loads.split(","):
        rate, bg_tokens = (int(x) for x in spec.split("x"))
        page = 64
        fwd = Requests(page, fwd_tokens, 1, 0, np.random.default_rng(1))
        bg = Requests(page, bg_tokens, 16, fwd.pages, np.random.default_rng(2))
        pages = fwd.pages + bg.pages
        with GpuPD("mla", page, pages) as rig:
            import rig_device
            import torch

            model, pool = rig.model, rig.prefill.pool
            slots = torch.as_tensor(fwd.row(0), device=rig_device.DEVICE)
            x = model.inputs(fwd_tokens, 0)

            def forwards(seconds: float, load, builtin=None):
                """Forwards back to back; with `load`, background requests sent between them
                (ours through the service, or `builtin`'s pattern from its own thread)."""
                times, sent, live = [], 0, []
                start = time.perf_counter()
                while time.perf_counter() - start < seconds:
                    if builtin is not None:
                        sent = builtin.due(rate, start, sent)
                    elif load:
                        sent = send_due(rig, bg, rate, start, sent, live)
                    t0 = time.perf_counter()
                    model.forward(x, pool, slots, hooked=False)
                    rig_device.synchronize()
                    times.append((time.perf_counter() - t0) * 1e3)
                if builtin is not None:
                    builtin.drain()
                drain(rig, live)
                return times, sent

            forwards(1.0, False)  # warm-up
            # Alone and loaded windows alternate (--rounds): this rig's launch-bound forward drifts
            # by tens of percent between minutes, so a ratio needs its two sides interleaved.
            base, loaded, sent, prefill_cpu = [], [], 0, {}
            rig.ask("cpu_reset")
            with metered_engine() as engine_meter:
                for _ in range(args.rounds):
                    base += forwards(args.seconds, False)[0]
                    meter = ThreadCpu()
                    times, n = forwards(args.seconds, True)
                    for key, value in meter.since().items():
                        prefill_cpu[key] = prefill_cpu.get(key, 0.0) + value
                    loaded += times
                    sent += n
                engine_cpu = engine_meter.since_reset()
            decode_cpu = rig.ask("cpu")
            child_cpu_s = getattr(rig.prefill, "child_cpu_s", None)
            builtin_point = None
            if args.builtin:
                from builtin_load import BuiltinPatternLoad

                load = BuiltinPatternLoad(rig, bg)
                try:
                    forwards(1.0, True, load)  # warm-up of its pattern
                    meter_b = ThreadCpu()
                    loaded_b, sent_b = forwards(args.seconds, True, load)
                    cpu_b = meter_b.since()
                finally:
                    load.close()
                builtin_point = {
                    "forward_ms": median(loaded_b), "requests_sent": sent_b, "failures": load.failures,
                    "slowdown_pct": 100.0 * (median(loaded_b) / median(base) - 1.0),
                    "prefill_cpu_ms_per_request": {k: round(v * 1e3 / max(sent_b, 1), 3) for k, v in
                                                   sorted(cpu_b.items(), key=lambda kv: -kv[1])[:6]},
                }
            # decode: its step loop alone, then while the prefill sends at the same rate (no prefill
            # forward meanwhile); the decode process receives the KV and its status thread works
            steps_alone = rig.ask("steps", args.decode_steps, timeout=120)
            rig.ask("steps_start", args.decode_steps)
            window = median(steps_alone) * args.decode_steps / 1e3
            _, sent_d = forwards_free_load(rig, bg, rate, window)
            steps_loaded = rig.ask("steps_result", 120, timeout=150)
            point = {
                "shape": rig.shape.name, "rate_per_s": rate, "bg_tokens": bg_tokens, "fwd_tokens": fwd_tokens,
                "forward_ms": {"alone": median(base), "loaded": median(loaded)},
                "requests_sent": sent, "seconds": args.seconds,
                "prefill_cpu_ms_per_request": {k: round(v * 1e3 / max(sent, 1), 3) for k, v in
                                               sorted(prefill_cpu.items(), key=lambda kv: -kv[1])[:10]},
                # Of each role's CPU above, the part spent inside softio's IOEngine calls (on
                # MORI-IO those are C++ that release the GIL); the rest is ours.
                "prefill_engine_call_cpu_ms_per_request": {k: round(v * 1e3 / max(sent, 1), 3)
                                                           for k, v in sorted(engine_cpu.items())},
                "prefill_ours_cpu_ms_per_request": {
                    k: round((v - engine_cpu.get(k, 0.0)) * 1e3 / max(sent, 1), 3)
                    for k, v in prefill_cpu.items() if k.startswith("mori-")},
                "rounds": args.rounds,
                "decode_cpu_ms_per_request": {k: round(v * 1e3 / max(sent, 1), 3) for k, v in
                                              sorted(decode_cpu.items(), key=lambda kv: -kv[1])[:8]},
                "decode_step_ms": {"alone": median(steps_alone), "loaded": median(steps_loaded)},
                "decode_requests_sent": sent_d,
            }
            if child_cpu_s is not None:  # the transfer process's CPU since it started, warm-ups included
                point["transfer_process_cpu_ms_per_request"] = round(child_cpu_s() * 1e3 / max(sent + sent_d, 1), 3)
            point["decode_slowdown_pct"] = 100.0 * (point["decode_step_ms"]["loaded"] /
                                                    point["decode_step_ms"]["alone"] - 1.0)
            point["slowdown_pct"] = 100.0 * (point["forward_ms"]["loaded"] / point["forward_ms"]["alone"] - 1.0)
            if builtin_point is not None:
                point["builtin_pattern"] = builtin_point
            results.append(point)
            args.save()
            print(f"interference {rate}/s x {bg_tokens} tok (fwd {fwd_tokens} tok): fwd alone "
                  f"{point['forward_ms']['alone']:.2f} loaded {point['forward_ms']['loaded']:.2f} ms "
                  f"({point['slowdown_pct']:+.1f}%), {sent} requests; decode step {point['decode_step_ms']['alone']:.2f} -> "
                  f"{point['decode_step_ms']['loaded']:.2f} ms ({point['decode_slowdown_pct']:+.1f}%); prefill CPU/request "
                  f"{point['prefill_cpu_ms_per_request']}; inside engine calls {point['prefill_engine_call_cpu_ms_per_request']}; "
                  f"ours {point['prefill_ours_cpu_ms_per_request']}", flush=True)
            if builtin_point is not None:
                print(f"  built-in pattern, same load: fwd loaded {builtin_point['forward_ms']:.2f} ms "
                      f"({builtin_point['slowdown_pct']:+.1f}%), {builtin_point['requests_sent']} requests, "
                      f"{builtin_point['failures']} failed; CPU/request {builtin_point['prefill_cpu_ms_per_request']}",
                      flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="cost,interference")
    ap.add_argument("--shapes", default="mla:64,mla:1,gqa:16", help="shape:page_size,...")
    ap.add_argument("--tokens", default="64,512,4096,16384")
    ap.add_argument("--requests", default="1,8")
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--group", type=int, default=0, help="layers per layer-wise group (0: halving groups)")
    ap.add_argument("--side-stream", action="store_true", help="also run 512/4096 x1 on a side stream")
    ap.add_argument("--loads", default="50x1024,200x128", help="background chunk-wise loads: rate x tokens")
    ap.add_argument("--fwd-tokens", type=int, default=512)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=3,
                    help="interference: alone/loaded window pairs, interleaved (each --seconds long)")
    ap.add_argument("--decode-steps", type=int, default=300)
    ap.add_argument("--builtin", action="store_true",
                    help="interference: also the same load in SGLang's built-in mori's pattern (test/gpu/builtin_load.py)")
    ap.add_argument("--decode-device", type=int, default=0, help="decode's GPU (1: across two GPUs)")
    ap.add_argument("--link-tokens", default="1024,8192,32768")
    ap.add_argument("--link-requests", type=int, default=4, help="requests of a burst (GB/s per second)")
    ap.add_argument("--blocks", default="default", help="gather kernel grids to measure (link part): blocks x threads,... or 'default'")
    ap.add_argument("--transfer-process", action="store_true",
                    help="the prefill side hands its transfers to a transfer process "
                         "(SGLANG_MORI_TRANSFER_PROCESS=on, test/gpu/prefill_process_side.py; chunk-wise only)")
    ap.add_argument("--backend-root", default="",
                    help="import sglang_mori from this python/ folder instead (another checkout's backend under "
                         "this rig: a same-call baseline); the decode and transfer processes inherit it")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    if args.backend_root:
        sys.path.insert(0, str(Path(args.backend_root).resolve()))
    if args.transfer_process:
        os.environ["SGLANG_MORI_TRANSFER_PROCESS"] = "on"
    import faulthandler

    faulthandler.enable()

    import torch
    from pd_rig import child_env
    from sglang_mori.softio import cuda_runtime

    child_env()
    rt = cuda_runtime.load()
    import rig_device

    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if rig_device.ON_GPU else []
    meta = {"device": gpus[0] if gpus else "cpu (rig check only)", "gpus": gpus, "torch": torch.__version__,
            "cuda_runtime": rt.version if rt else None,
            "link_gbps": os.environ.get("SGLANG_MORI_SOFTIO_LINK_GBPS", ""), "args": dict(vars(args)),
            "backend": str(Path(sys.modules["sglang_mori"].__file__).parent), "results": []}
    print(f"device: {meta['device']} torch {meta['torch']} runtime {meta['cuda_runtime']} "
          f"link {meta['link_gbps'] or 'unpaced'} GB/s; backend {meta['backend']}", flush=True)
    def save():
        meta["memcpy_batch_api"] = bool(rt and rt.batch_calls)
        if args.json:
            Path(args.json).write_text(json.dumps(meta, indent=1))

    args.save = save  # after every point: a run cut short keeps what it measured
    parts = args.parts.split(",")
    try:
        if "cost" in parts:
            run_cost(args, meta["results"])
        if "interference" in parts:
            run_interference(args, meta["results"])
        if "link" in parts:
            run_link(args, meta["results"])
    finally:
        save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
