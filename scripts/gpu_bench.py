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
                transfers run in the background at fixed request rates, beside the same copies
                with none of our Python (--copies), windows interleaved over --rounds; CPU per
                thread role (test/gpu/interference_part.py)
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
                    help="interference: rounds of one window of each kind (alone, ours, copies...), in rotated order (each --seconds long)")
    ap.add_argument("--decode-steps", type=int, default=300, help="interference: decode steps of one window")
    ap.add_argument("--decode-rounds", type=int, default=0,
                    help="interference: rounds of decode windows (0: --rounds); each round runs every kind once, "
                         "and the paired figure is the median of the rounds' own ratios")
    ap.add_argument("--copies", default="process",
                    help="interference: copies-only loads beside 'ours' (test/gpu/copy_load.py), comma-separated: "
                         "process (a spawned process: its own CUDA context), thread (a thread of the forward's "
                         "process), off")
    ap.add_argument("--device-copy", choices=("kernel", "memcpy"), default="",
                    help="softio's device copy route for every engine of the run (sets "
                         "SGLANG_MORI_SOFTIO_DEVICE_COPY): the gather kernel or the copy engines")
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
    if args.device_copy:  # before any engine exists; spawned children inherit it
        os.environ["SGLANG_MORI_SOFTIO_DEVICE_COPY"] = args.device_copy
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
            "link_gbps": os.environ.get("SGLANG_MORI_SOFTIO_LINK_GBPS", ""),
            "device_copy": os.environ.get("SGLANG_MORI_SOFTIO_DEVICE_COPY", "kernel"), "args": dict(vars(args)),
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
            from interference_part import run_interference

            run_interference(args, meta["results"])
        if "link" in parts:
            run_link(args, meta["results"])
    finally:
        save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
