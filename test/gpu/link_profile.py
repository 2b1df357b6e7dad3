"""Where the link path's time goes (a diagnostic, not a test; issue 28). For MLA page 64 and GQA
page 16, decode on GPU 1 where there are two:

1. the engine call as the backend makes it (one `batch_write` for every buffer, offsets as numpy
   arrays shared by the pairs): host time until it returns, and until every status completed, at
   128, 1024 and 8192 tokens; then a cProfile of those calls (softio's Python: on MORI-IO, C++);
2. gather-kernel variants (test/gpu/gather_variants.py) on the 8192-token request's range table,
   resident on the GPU, each first checked byte for byte on random ranges, against a plain copy.

`python3 test/gpu/link_profile.py [profile|kernels|all]`."""

from __future__ import annotations

import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "inprocess"), str(HERE.parents[1] / "python")]

import numpy as np  # noqa: E402
import torch  # noqa: E402

import sglang_mori.softio as io  # noqa: E402
from link_bench import EngineCalls, captured_batch, contiguous_runs, device_engine  # noqa: E402
from pd_rig import GpuPD, Requests, child_env  # noqa: E402


class ArrayCalls:
    """One request's KV as one batch_write with numpy offset arrays shared by every pair."""

    def __init__(self, rig: GpuPD, reqs: Requests, row: int):
        side = rig.prefill
        self.engine = side.pool.engine.engine
        self.local = list(side.pool.buffers.kv)
        self.remote = [io.MemoryDesc.unpack(blob) for blob in rig.registration.kv_descs]
        item = side.pool.item_len
        s, d, n = contiguous_runs(reqs.src[row], reqs.dst[row])
        self.lo, self.ro, self.sz = s * item, d * item, n * item
        self.nbytes = int(self.sz.sum()) * len(self.local)

    def post(self) -> list:
        e, k = self.engine, len(self.local)
        return e.batch_write(self.local, [self.lo] * k, self.remote, [self.ro] * k, [self.sz] * k,
                             [e.allocate_transfer_uid() for _ in range(k)])


wait = EngineCalls.wait  # every status waited for; a failed write raises


def profile_calls(rig: GpuPD, label: str) -> None:
    for tokens in (128, 1024, 8192):
        reqs = Requests(rig.page_size, tokens, 1, 0, np.random.default_rng(tokens))
        calls = ArrayCalls(rig, reqs, 0)
        reps = 10 if tokens >= 8192 else 40
        wait(calls.post())  # warm-up
        posted, done = [], []
        for _ in range(reps):
            t0 = time.perf_counter()
            statuses = calls.post()
            t1 = time.perf_counter()
            wait(statuses)
            posted.append(t1 - t0)
            done.append(time.perf_counter() - t0)
        print(f"calls {label} {tokens:>5} tok: batch_write returns in {1e6 * statistics.median(posted):7.1f} us, "
              f"statuses done in {1e6 * statistics.median(done):8.1f} us "
              f"({calls.nbytes / statistics.median(done) / 1e9:6.1f} GB/s)", flush=True)
        if tokens in (128, 8192):
            prof = cProfile.Profile()
            for _ in range(reps):
                prof.enable()
                statuses = calls.post()
                prof.disable()
                wait(statuses)
            print(f"--- cProfile of {reps} batch_write calls, {label} {tokens} tok (tottime):")
            pstats.Stats(prof).sort_stats("tottime").print_stats(14)


def check_variant(cupy, kernel, blocks: int, threads: int, dst_device: int) -> None:
    """Byte-exact on random ranges (some unaligned), destination poisoned first."""
    rng = np.random.default_rng(int(time.time()))
    slot, count = 1 << 17, 300
    src = torch.randint(0, 256, (slot * count,), dtype=torch.uint8, device="cuda:0")
    dst = torch.full((slot * count,), 0xAB, dtype=torch.uint8, device=f"cuda:{dst_device}")
    sizes = rng.integers(1, slot // 16, count) * 16
    sizes[::7] = rng.integers(1, slot, len(sizes[::7]))  # unaligned sizes
    soff = rng.permutation(count) * slot + (rng.integers(0, 16, count) * (np.arange(count) % 5 == 0))
    sizes = np.minimum(sizes, slot - (soff % slot))
    doff = rng.permutation(count) * slot
    table = np.concatenate([dst.data_ptr() + doff, src.data_ptr() + soff, sizes]).astype(np.uint64)
    with cupy.cuda.Device(0):
        dev_table = cupy.asarray(table)
        kernel((blocks,), (threads,), (dev_table, np.int64(count)))
        cupy.cuda.Device(0).synchronize()
    expect = np.full(slot * count, 0xAB, dtype=np.uint8)
    host_src = src.cpu().numpy()
    for d, s, z in zip(doff, soff, sizes):
        expect[d:d + z] = host_src[s:s + z]
    if not np.array_equal(dst.cpu().numpy(), expect):
        raise AssertionError("gather variant wrote wrong bytes")


def time_kernels(rig: GpuPD, label: str) -> None:
    import cupy

    from gather_variants import VARIANTS, compile_variant

    dev = device_engine(rig)
    reqs = Requests(rig.page_size, 8192, 1, 0, np.random.default_rng(8192))
    calls = ArrayCalls(rig, reqs, 0)
    dsts, srcs, sizes, _ = captured_batch(dev, lambda: wait(calls.post()))
    n, nbytes = len(sizes), int(sizes.sum())
    table = np.concatenate([dsts, srcs, sizes]).astype(np.uint64)
    decode = rig.decode_device
    with cupy.cuda.Device(0):
        sms = cupy.cuda.Device(0).attributes["MultiProcessorCount"]
        resident = cupy.asarray(table)
        if decode != 0:
            try:
                cupy.cuda.runtime.deviceEnablePeerAccess(decode)
            except cupy.cuda.runtime.CUDARuntimeError:
                pass  # already enabled

    def sync():
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(decode)

    def timed(fn, reps=9):
        out = []
        for i in range(reps + 1):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            if i:
                out.append(time.perf_counter() - t0)
        return statistics.median(out)

    x = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    y = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{decode}")
    plain = timed(lambda: y.copy_(x, non_blocking=True))
    del x, y
    print(f"kernels {label} 8192 tok, {n} ranges, {nbytes / 1e6:.0f} MB: plain copy {nbytes / plain / 1e9:6.1f} GB/s",
          flush=True)
    prod = dev.copier
    keep = []
    t = timed(lambda: keep.append(prod.copy(dsts, srcs, sizes, dev.stream, True)))
    print(f"  softio copier.copy (table from pinned): {nbytes / t / 1e9:6.1f} GB/s ({plain / t:.2f}x)", flush=True)
    keep.clear()
    host_t = []
    for _ in range(10):
        sync()
        t0 = time.perf_counter()
        keep.append(prod.copy(dsts, srcs, sizes, dev.stream, True))
        host_t.append(time.perf_counter() - t0)
    sync()
    keep.clear()
    print(f"  copier.copy host time {1e6 * statistics.median(host_t):.1f} us", flush=True)
    for name, fn, unroll, per_sm, threads in VARIANTS:
        kernel = compile_variant(cupy, fn, unroll)
        blocks = sms * per_sm
        check_variant(cupy, kernel, blocks, threads, decode)
        with cupy.cuda.Device(0):
            t = timed(lambda: kernel((blocks,), (threads,), (resident, np.int64(n))))
        print(f"  {name:<22} resident table: {nbytes / t / 1e9:6.1f} GB/s ({plain / t:.2f}x)", flush=True)


def main() -> None:
    child_env()
    what = sys.argv[1] if len(sys.argv) > 1 else "all"
    decode = 1 if torch.cuda.device_count() > 1 else 0
    for shape, page in (("mla", 64), ("gqa", 16)):
        with GpuPD(shape, page, 8192 // page + 8, decode_device=decode) as rig:
            label = f"{shape} p{page}"
            if what in ("profile", "all"):
                profile_calls(rig, label)
            if what in ("kernels", "all"):
                time_kernels(rig, label)


if __name__ == "__main__":
    main()
