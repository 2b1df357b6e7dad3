"""softio's device submit up to its kernel launch, on the CPU (issue 28, docs/benchmarks.md
"Session 21"): the Python between `DeviceEngine.submit_shared`'s entry and the gather kernel's
launch is on a lone request's path before its first byte moves. A stand-in CuPy (no GPU: pinned
buffers are bytearrays, the upload and the launch record nothing) and a no-op CUDA runtime let
the path itself run: the calls (Python and C, as the profiler hook sees them) and the time from
the entry to the launch, per batch, medians; each batch waits for its completion before the next
(a lone request's pattern: the previous table is back in the pool).

    .venv/bin/python test/manual/submit_calls_cpu.py [mla61p64|gqa32p16] [BATCHES]

PYTHONPATH=<checkout>/python measures another checkout's softio (its DeviceEngine and copier).
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from types import SimpleNamespace

import numpy as np

from sglang_mori.softio import device_gather, device_path
from sglang_mori.softio.status import started

SHAPES = {"mla61p64": (61, 128, 73728), "gqa32p16": (64, 512, 32768)}  # pairs, ranges (8K tokens), bytes


class NoRuntime:
    def stream(self, device):
        return 7

    def event(self, device):
        return 1

    def use_device(self, device):
        pass

    def record(self, event, stream):
        pass

    def synchronize(self, event):
        pass

    def copy(self, *a):
        raise AssertionError("no range here is long enough for the copy engines")


class _Ctx:
    ptr = 7

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _Mem:
    def copy_from_host_async(self, mem, size, stream=None):
        pass


class _DeviceArray:
    def __init__(self, n, dtype=None):
        self.n, self.data = n, _Mem()

    def set(self, host, stream=None):
        pass


class Launches:
    """The stand-in kernel: its call is the launch, where the count and the clock stop."""

    def __init__(self):
        self.stamps = []

    def __call__(self, grid, block, args):
        sys.setprofile(None)
        self.stamps.append(time.perf_counter())


def fake_copier(launch: Launches):
    pinned: dict = {}  # CuPy's pinned pool hands a freed buffer of the size back: no fresh pages here either
    cupy = SimpleNamespace(uint64=np.uint64, empty=_DeviceArray,
                           cuda=SimpleNamespace(Device=lambda d: _Ctx(), ExternalStream=lambda s: _Ctx(),
                                                alloc_pinned_memory=lambda n: pinned.setdefault(n, bytearray(n))))
    copier = object.__new__(device_gather.GatherCopier)
    copier.__dict__.update(cupy=cupy, device=0, threads=device_gather.THREADS, blocks=16, peer_blocks=132,
                           _streams={}, _free={}, kernel=launch, shared_kernel=launch)
    setting = getattr(device_gather, "gather_setting", None)  # session 22's kernels (absent before)
    if setting is not None:
        s = setting()  # SGLANG_MORI_SOFTIO_GATHER_KERNEL=ranges counts the warp-per-range kernel's way
        copier.__dict__.update(variant=s.kernel, unroll=s.unroll, share=s.share, bytes_kernel=launch,
                               dynamic_kernel=launch)
    return copier


def main(shape_key: str = "mla61p64", batches: int = 400) -> None:
    pairs, per, nbytes = SHAPES[shape_key]
    launch = Launches()
    engine = device_path.DeviceEngine(NoRuntime(), 0, "calls")
    engine.copier = fake_copier(launch)
    if hasattr(engine, "_give_back"):
        engine._give_back = engine.copier.give_back
    rng = np.random.default_rng(0)
    dst_base = np.arange(pairs, dtype=np.int64) << 32
    src_base = dst_base + (1 << 31)
    counted, times = [], []
    n = [0]

    def hook(frame, event, arg):
        if event in ("call", "c_call"):
            n[0] += 1

    for i in range(batches):
        lo = rng.permutation(per * 4)[:per].astype(np.int64) * nbytes
        ro = rng.permutation(per * 4)[:per].astype(np.int64) * nbytes
        sz = np.full(per, nbytes, dtype=np.int64)
        statuses = started(pairs)
        n[0] = 0
        count = i % 2 == 0  # the calls of even batches, the time of odd ones (the hook's own cost left out)
        t0 = time.perf_counter()
        if count:
            sys.setprofile(hook)
        engine.submit_shared(dst_base, src_base, ro, lo, sz, statuses, True, ())
        sys.setprofile(None)
        if i >= batches // 10:  # the first tenth warms up
            (counted.append(n[0]) if count else times.append(launch.stamps[-1] - t0))
        for s in statuses:
            s.Wait()
    engine.close()
    print(f"{shape_key} submit_shared entry -> kernel launch: median {statistics.median(counted):.0f} calls "
          f"(min {min(counted)}, max {max(counted)}), {1e6 * statistics.median(times):.1f} us "
          f"(p10 {1e6 * np.percentile(times, 10):.1f}), {len(times)} batches; {threading.active_count()} threads")


if __name__ == "__main__":
    main(*(f(a) for f, a in zip((str, int), sys.argv[1:])))
