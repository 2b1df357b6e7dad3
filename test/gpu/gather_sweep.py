"""Session 22's gather-kernel sweep (a diagnostic, not a test): each candidate kernel and grid of
softio's GatherCopier against a plain copy (cudaMemcpyPeerAsync of the same bytes) at the link
rig's paged shapes, prefill GPU 0 -> decode GPU 1: MLA p64 (61 layers x 72 KiB pages) and GQA p16
(64 buffers x 32 KiB pages) at 8192 and 32768 tokens. Every candidate is byte-checked first (odd
tables through both table forms, then each shape's pages); a candidate that fails is reported and
never chosen. Times: CUDA events on the copier's stream around `copy_shared` (its table upload
included, as in the rig), median of REPS after a warm-up, the plain copy timed before and after.

    python3 test/gpu/gather_sweep.py [--reps 15] [--env-out FILE] [--json FILE] [--quick]

--env-out writes the best candidate (highest mean ratio over the shapes, byte checks passed) as
SGLANG_MORI_SOFTIO_GATHER_* settings for the link rig's `new` runs (plans.sh s19_link)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1] / "python")]

import cupy  # noqa: E402
import numpy as np  # noqa: E402

from gather_check import PagedShape, check_odd, enable_peer  # noqa: E402
from sglang_mori.softio.device_gather import GatherCopier  # noqa: E402

# (label, kernel, unroll, threads, blocks per SM, share bytes; 0: even shares). Grids whose blocks
# fit an SM's 64K registers together (nvcc -Xptxas -v, sm_90: gather_bytes 56 / 76 / 96 registers a
# thread at UNROLL 4 / 8 / 16; gather_bytes_dynamic 60 / 68 / 96), else a second block per SM would run as a second wave.
CANDIDATES = [
    ("ranges u8 t512 1/SM (session 21)", "ranges", 8, 512, 1, 0),
    ("bytes u8 t512 1/SM", "bytes", 8, 512, 1, 0),
    ("bytes u16 t512 1/SM", "bytes", 16, 512, 1, 0),
    ("bytes u4 t512 1/SM", "bytes", 4, 512, 1, 0),
    ("bytes u4 t512 2/SM", "bytes", 4, 512, 2, 0),
    ("bytes u8 t256 2/SM", "bytes", 8, 256, 2, 0),
    ("bytes u16 t256 2/SM", "bytes", 16, 256, 2, 0),
    ("bytes u4 t1024 1/SM", "bytes", 4, 1024, 1, 0),
    ("bytes u8 t128 4/SM", "bytes", 8, 128, 4, 0),
    ("bytes u8 t512 1/SM share 16K", "bytes", 8, 512, 1, 16 << 10),
    ("bytes u8 t512 1/SM share 64K", "bytes", 8, 512, 1, 64 << 10),
    ("bytes u16 t256 2/SM share 32K", "bytes", 16, 256, 2, 32 << 10),
    ("dynamic u8 t512 1/SM share 16K", "dynamic", 8, 512, 1, 16 << 10),
    ("dynamic u8 t512 1/SM share 32K", "dynamic", 8, 512, 1, 32 << 10),
    ("dynamic u8 t512 1/SM share 64K", "dynamic", 8, 512, 1, 64 << 10),
    ("dynamic u16 t256 2/SM share 32K", "dynamic", 16, 256, 2, 32 << 10),
]
SHAPES = [("mla p64 8192", 61, 128, 73728), ("gqa p16 8192", 64, 512, 32768),
          ("mla p64 32768", 61, 512, 73728), ("gqa p16 32768", 64, 2048, 32768)]


_SPIN = r"""
extern "C" __global__ void spin(long long cycles) {
    const long long t0 = clock64();
    while (clock64() - t0 < cycles) {}
}
"""
_spin = {}


def events_ms(stream, fn, reps: int) -> float:
    """Median ms between events recorded around fn() on `stream`, after one warm-up. A spin kernel
    (~0.5 ms) runs first, so the host's work in fn() (table fill, upload and launch calls) is done
    before the first event fires: the time is the GPU's, from the upload to the copy's end."""
    dev = cupy.cuda.Device().id
    if dev not in _spin:
        _spin[dev] = cupy.RawKernel(_SPIN, "spin")
    out = []
    for i in range(reps + 1):
        a, b = cupy.cuda.Event(), cupy.cuda.Event()
        with stream:
            _spin[dev]((1,), (1,), (np.int64(1_000_000),))
        a.record(stream)
        keep = fn()
        b.record(stream)
        b.synchronize()
        del keep
        if i:
            out.append(cupy.cuda.get_elapsed_time(a, b))
    return statistics.median(out)


def plain_ms(shape: PagedShape, reps: int) -> float:
    with cupy.cuda.Device(shape.src_dev):
        return events_ms(shape.stream, lambda: cupy.cuda.runtime.memcpyPeerAsync(
            shape.dst.data.ptr, shape.dst_dev, shape.src.data.ptr, shape.src_dev, shape.nbytes, shape.stream.ptr),
            reps)


def make(kind, unroll, threads, per_sm, share, sms):
    c = GatherCopier(0, variant=kind, unroll=unroll, threads=threads, share=share)
    c.peer_blocks = per_sm * sms
    return c


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--env-out", default="")
    ap.add_argument("--json", default="")
    ap.add_argument("--quick", action="store_true", help="MLA 8K only, first 4 candidates")
    args = ap.parse_args()
    src_dev, dst_dev = 0, (1 if cupy.cuda.runtime.getDeviceCount() > 1 else 0)
    enable_peer(cupy, src_dev, dst_dev)
    sms = int(cupy.cuda.Device(0).attributes["MultiProcessorCount"])
    cands = CANDIDATES[:4] if args.quick else CANDIDATES
    shapes = SHAPES[:1] if args.quick else SHAPES
    t0 = time.time()
    copiers, failed = {}, {}
    for label, kind, unroll, threads, per_sm, share in cands:
        try:
            c = copiers[label] = make(kind, unroll, threads, per_sm, share, sms)
            for seed in range(4):
                check_odd(cupy, c, src_dev, dst_dev, seed, shared=bool(seed % 2))
            small = make(kind, unroll, threads, 1, share, 1)  # one block: every warp takes many shares
            small.peer_blocks = small.blocks = 1
            check_odd(cupy, small, src_dev, dst_dev, 7, shared=True)
            check_odd(cupy, small, src_dev, dst_dev, 8, shared=False)
        except Exception as exc:  # noqa: BLE001 - reported, never chosen
            failed[label] = f"odd tables: {exc}"
    print(f"sweep: {len(cands)} candidates compiled and odd-checked in {time.time() - t0:.1f} s, "
          f"{sms} SMs, GPU {src_dev} -> {dst_dev}; failed: {failed or 'none'}", flush=True)
    results = {}
    for name, pairs, pages, item in shapes:
        shape = PagedShape(cupy, name, pairs, pages, item, src_dev, dst_dev)
        before = plain_ms(shape, args.reps)
        row = {}
        for label, *_ in cands:
            if label in failed:
                continue
            c = copiers[label]
            try:
                shape.check(c)
            except AssertionError as exc:
                failed[label] = str(exc)
                continue
            with cupy.cuda.Device(src_dev):
                row[label] = events_ms(shape.stream, lambda: shape.post(c), args.reps)
        after = plain_ms(shape, args.reps)
        plain = min(before, after)
        print(f"{name}: {shape.nbytes / 1e6:.0f} MB, plain copy {before:.3f} / {after:.3f} ms "
              f"({shape.nbytes / plain / 1e6:.0f} GB/s)", flush=True)
        for label, ms in row.items():
            print(f"  {label:<34} {ms:7.3f} ms  {plain / ms:.3f}x", flush=True)
        results[name] = {"plain_ms": [before, after], "bytes": shape.nbytes, "kernels_ms": row}
        shape.free()
        cupy.get_default_memory_pool().free_all_blocks()
    score = {}
    for label, *_ in cands:
        ratios = [min(r["plain_ms"]) / r["kernels_ms"][label] for r in results.values() if label in r["kernels_ms"]]
        if label not in failed and len(ratios) == len(results):
            score[label] = sum(ratios) / len(ratios)
    best = max(score, key=score.get) if score else None
    # one line a candidate (what the device call's tail keeps): its ratio at every shape
    print("ratios: " + " | ".join(results), flush=True)
    for label, *_ in cands:
        ratios = [f"{min(r['plain_ms']) / r['kernels_ms'][label]:.3f}" if label in r["kernels_ms"] else "  -  "
                  for r in results.values()]
        print(f"  {label:<34} {' | '.join(ratios)}  mean {score.get(label, 0):.3f}", flush=True)
    print(f"best (mean ratio over shapes): {best} {score.get(best, 0):.3f}; failed: {failed or 'none'}; "
          f"{time.time() - t0:.0f} s", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "score": score, "best": best,
                                               "failed": failed}, indent=1))
    if args.env_out and best:
        _, kind, unroll, threads, per_sm, share = next(c for c in cands if c[0] == best)
        Path(args.env_out).write_text(
            f"SGLANG_MORI_SOFTIO_GATHER_KERNEL={kind} SGLANG_MORI_SOFTIO_GATHER_UNROLL={unroll} "
            f"SGLANG_MORI_SOFTIO_GATHER_THREADS={threads} SGLANG_MORI_SOFTIO_GATHER_BLOCKS={per_sm * sms} "
            f"SGLANG_MORI_SOFTIO_GATHER_SHARE={share}\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
