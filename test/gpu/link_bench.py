"""The transfer path between two GPUs, unpaced (scripts/gpu_bench.py --parts link).

For one request of a shape at a token count, prefill on one GPU and decode on the other (GpuPD
with decode_device=1), pages scattered on both sides, it measures:

- `plain_copy`: one device-to-device copy of the same number of bytes, contiguous (torch's copy
  between the GPUs: the link and copy engines at their best). The yardstick.
- `ours`: this project's whole path: SGLang's send() of every page with the aux slot, through the
  PrefillService (planner, chunk submitter, softio batch_write), to the room's Success, which comes
  after the KV and aux landed and decode was told. One request alone (GB/s per request) and
  `count` requests sent back to back (GB/s per second).
- `kernel`: softio's gather kernel alone on the request's range table (captured from the
  engine), enqueued and waited for with no Python around it: what the copy itself achieves.
- engine calls with the same ranges through the same engine, without the services around them:
  `ours_calls` (one batch_write for all the request's buffers, as our chunk submitter posts) and
  `builtin_calls`: SGLang's built-in mori backend's pattern as read from its `send_kvcache`
  (sglang/srt/disaggregation/mori/conn.py): one batch_write per layer buffer, each with the
  request's contiguous page runs. The built-in's own threads and messages are not included
  (SGLang does not install on the GPU host), which only flatters it.

`ops` counts, per request, the engine calls, the (local, remote) pairs and the copy ranges.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

import sglang_mori.softio as io

from pd_rig import GpuPD, Requests
from rig_device import ON_GPU, torch_device


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def sync_all(rig: GpuPD) -> None:
    if ON_GPU:
        for d in {*rig.prefill_devices, rig.decode_device}:
            torch.cuda.synchronize(d)


def contiguous_runs(src: np.ndarray, dst: np.ndarray):
    """(src start, dst start, pages) of the runs where both sides' pages are consecutive."""
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [len(src)]))
    return src[starts], dst[starts], ends - starts


class EngineCalls:
    """batch_write calls of one request's KV on the prefill's engine, in either pattern."""

    def __init__(self, rig: GpuPD, reqs: Requests, row: int):
        side = rig.prefill
        self.engine = side.pool.engine.engine  # the io.IOEngine
        self.local = list(side.pool.buffers.kv)
        self.remote = [io.MemoryDesc.unpack(blob) for blob in rig.registration.kv_descs]
        item = side.pool.item_len
        s, d, n = contiguous_runs(reqs.src[row], reqs.dst[row])
        self.lo, self.ro, self.sz = (s * item).tolist(), (d * item).tolist(), (n * item).tolist()

    def post(self, pattern: str) -> list:
        e, buffers = self.engine, range(len(self.local))
        if pattern == "builtin_calls":
            statuses = []
            for b in buffers:
                statuses += e.batch_write([self.local[b]], [self.lo], [self.remote[b]], [self.ro], [self.sz],
                                          [e.allocate_transfer_uid()])
            return statuses
        return e.batch_write(self.local, [self.lo] * len(self.local), self.remote, [self.ro] * len(self.local),
                             [self.sz] * len(self.local), [e.allocate_transfer_uid() for _ in buffers])

    def calls(self, pattern: str) -> int:
        return len(self.local) if pattern == "builtin_calls" else 1

    @staticmethod
    def wait(statuses) -> None:
        for s in statuses:
            s.Wait()
        bad = [s.Message() for s in statuses if not s.Succeeded()]
        if bad:
            raise RuntimeError(f"{len(bad)} writes failed: {bad[:2]}")


def device_engine(rig: GpuPD):
    """softio's DeviceEngine of the prefill's engine on its GPU (its copy counters)."""
    if not ON_GPU:  # the CPU check of the rig: host path, no copy counters
        return None
    core = rig.prefill.pool.engine.engine._core
    return core.device_engine(rig.prefill.device)


def plain_copy_s(rig: GpuPD, nbytes: int, iters: int) -> list:
    src = torch.empty(nbytes, dtype=torch.uint8, device=torch_device(rig.prefill.device))
    dst = torch.empty(nbytes, dtype=torch.uint8, device=torch_device(rig.decode_device))
    times = []
    for i in range(iters + 1):
        sync_all(rig)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        sync_all(rig)
        if i:  # the first is the warm-up
            times.append(time.perf_counter() - t0)
    del src, dst
    if ON_GPU:
        torch.cuda.empty_cache()
    return times


def ours_s(rig: GpuPD, reqs: Requests, rows: list) -> float:
    """Send the requests of `rows` back to back; seconds until the last room's Success."""
    rooms = rig.next_rooms(len(rows))
    rig.open_rooms(reqs, rooms, rows)
    t0 = time.perf_counter()
    for room, row in zip(rooms, rows):
        rig.prefill.send_all(room, reqs.src[row])
    done = rig.prefill.sglang.wait_concluded(rooms, 120)
    t = max(done.values()) - t0
    failed = [room for room in rooms if rig.prefill.failure(room)]
    rig.release(rooms)
    if failed:
        raise RuntimeError(f"rooms {failed} failed: {rig.prefill.failure(failed[0])}")
    return t


def captured_batch(dev, post):
    """(dsts, srcs, sizes) of the device batch that `post()` submits to `dev`."""
    seen = []
    original = dev.submit

    def capture(dsts, srcs, sizes, statuses, to_peer=False, holds=()):
        seen.append((dsts, srcs, sizes, to_peer))
        return original(dsts, srcs, sizes, statuses, to_peer, holds)

    dev.submit = capture
    try:
        post()
    finally:
        del dev.submit  # the class's method again
    return seen[-1]


def kernel_s(dev, table, iters: int) -> list:
    """The gather kernel alone on one batch's ranges (no Python between the copies)."""
    times = []
    dsts, srcs, sizes, to_peer = table
    for i in range(iters + 1):
        dev.rt.use_device(dev.device)
        torch.cuda.synchronize(dev.device)
        t0 = time.perf_counter()
        keep = dev.copier.copy(dsts, srcs, sizes, dev.stream, to_peer)
        torch.cuda.synchronize(dev.device)
        if i:
            times.append(time.perf_counter() - t0)
        del keep
    return times


def calls_s(calls: list, pattern: str) -> float:
    t0 = time.perf_counter()
    statuses = []
    for c in calls:
        statuses += c.post(pattern)
    EngineCalls.wait(statuses)
    return time.perf_counter() - t0


def link_point(rig: GpuPD, tokens: int, count: int, iters: int, seed: int) -> dict:
    reqs = Requests(rig.page_size, tokens, count, 0, np.random.default_rng(seed))
    side = rig.prefill
    req_bytes = reqs.src.shape[1] * side.pool.item_len * rig.shape.buffers
    gb = req_bytes / 1e9
    out = {"tokens": tokens, "requests": count, "request_bytes": req_bytes}
    copy = plain_copy_s(rig, req_bytes, iters)
    out["plain_copy"] = {"s": median(copy), "gbps": gb / median(copy)}

    dev = device_engine(rig)
    ours_s(rig, reqs, [0])  # warm-up: plans, peer, kernel
    before = (dev.batches, dev.ranges) if dev else (0, 0)
    single = [ours_s(rig, reqs, [i % count]) for i in range(iters)]
    batches, ranges = (dev.batches - before[0], dev.ranges - before[1]) if dev else (0, 0)
    burst = [ours_s(rig, reqs, list(range(count))) for _ in range(max(2, iters // 2))]
    out["ours"] = {"s": median(single), "gbps": gb / median(single),
                   "burst_s": median(burst), "gbps_per_s": gb * count / median(burst),
                   "ops": {"device_calls": batches / iters, "ranges": ranges / iters}}

    calls = [EngineCalls(rig, reqs, i) for i in range(count)]
    if dev is not None and dev.copier is not None:
        table = captured_batch(dev, lambda: EngineCalls.wait(calls[0].post("ours_calls")))
        k = kernel_s(dev, table, iters)
        out["kernel"] = {"s": median(k), "gbps": gb / median(k), "ranges": len(table[2])}
    for pattern in ("ours_calls", "builtin_calls"):
        calls_s(calls[:1], pattern)  # warm-up
        single = [calls_s([calls[i % count]], pattern) for i in range(iters)]
        burst = [calls_s(calls, pattern) for _ in range(max(2, iters // 2))]
        out[pattern] = {"s": median(single), "gbps": gb / median(single),
                        "burst_s": median(burst), "gbps_per_s": gb * count / median(burst),
                        "ops": {"engine_calls": calls[0].calls(pattern), "pairs": len(calls[0].local),
                                "ranges": len(calls[0].sz) * len(calls[0].local)}}
    base = out["plain_copy"]["gbps"]
    if "kernel" in out:
        out["kernel"]["vs_plain_copy"] = out["kernel"]["gbps"] / base
    for key in ("ours", "ours_calls", "builtin_calls"):
        out[key]["vs_plain_copy"] = out[key]["gbps"] / base
        out[key]["per_s_vs_plain_copy"] = out[key]["gbps_per_s"] / base
    return out
