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
`phases` splits a lone request's `ours` (in-process) where our code and the engine's meet
(`lone_phases`): on a GPU, send() to the engine call (ours) / softio's Python before its device
submit / the submit (range table, launch) / the copy and the wait for it / softio's completion
handing the statuses back / that to the room's Success (ours); on the CPU check, ours before the
call / the call / the rest. `engine_python_zero` is a projection for a C++ engine (MORI-IO): the
whole path with softio's Python before the submit and in its completion taken out, as a fraction
of the plain copy beside the measured one, which it never replaces.
`burst_phases` of a burst: send() to the first submit, the time the stream may have waited for a
next request's submit (a submit ending after the previous batch was seen done; a lower bound), and
the last batch seen done to the last Success.

Through a transfer process (gpu_bench.py --transfer-process) the engine lives in the child: only
the plain copy and `ours` are measured, `ours` from send() to the Success read by the scheduler's
poll, every LINK_POLL_S here (SGLang's scheduler polls once per loop, back to back when idle).
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

import sglang_mori.softio as io
from sglang_mori.backend import room_status as S
from sglang_mori.softio import device_path

from pd_rig import GpuPD, Requests
from rig_device import ON_GPU, torch_device


LINK_POLL_S = 0.0001
SUBMITS = ("submit", "submit_shared")  # the device engine's entries (submit_shared: since issue 28's link work)


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
        """`ours_arrays`: ours_calls with one numpy array per column shared by every pair, as the
        backend's plans pass them (softio's fast device route)."""
        e, buffers = self.engine, range(len(self.local))
        if pattern == "ours_arrays":
            lo, ro, sz = (np.asarray(c, dtype=np.int64) for c in (self.lo, self.ro, self.sz))
            n = len(self.local)
            return e.batch_write(self.local, [lo] * n, self.remote, [ro] * n, [sz] * n,
                                 [e.allocate_transfer_uid() for _ in buffers])
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


def in_transfer_process(rig: GpuPD) -> bool:
    return getattr(rig.prefill, "poll", None) is not None


def wait_sendable(rig: GpuPD, rooms: list, timeout_s: float = 30.0) -> None:
    """SGLang sends a room only once it is WaitingForInput: through a transfer process decode's
    metadata reaches the child first, and the scheduler learns it from its polls."""
    poll = getattr(rig.prefill, "poll", None)
    if poll is None:
        return
    end = time.monotonic() + timeout_s
    while any(rig.prefill.sglang.status(r) == S.BOOTSTRAPPING for r in rooms):
        if time.monotonic() > end:
            raise TimeoutError(f"rooms {rooms[:3]} still bootstrapping after {timeout_s} s")
        poll()
        time.sleep(0.0002)


class PhaseClock:
    """Stamps while `ours` runs, for `phases`: where our code enters the engine (softio's
    `IOEngine.batch_write`, on the thread that posts) and leaves it, the device engine's submits
    (one thread: the poster's) and its completions (`succeed_all` on the engine's completion
    thread: entered once the copy is seen done, left once the statuses are handed back to us).
    `dev` None (the rig on the CPU: softio's host path): the engine calls only."""

    def __init__(self, dev, io_engine=None):
        self.dev = dev
        self.io_engine = io_engine
        self.calls: list = []  # (start, end) of batch_write
        self.submits: list = []  # (start, end)
        self.done: list = []  # (start, end) of succeed_all
        self._original = None

    def __enter__(self):
        if self.io_engine is not None:
            calls, call = self.calls, self.io_engine.batch_write

            def batch_write(*args, **kwargs):
                start = time.perf_counter()
                try:
                    return call(*args, **kwargs)
                finally:
                    calls.append((start, time.perf_counter()))
            self.io_engine.batch_write = batch_write
        if self.dev is None:
            return self
        stamps = self.submits
        for name in SUBMITS:
            original = getattr(self.dev, name, None)
            if original is None:  # an engine from before submit_shared (a baseline's backend)
                continue

            def submit(*args, _original=original, **kwargs):
                start = time.perf_counter()
                try:
                    return _original(*args, **kwargs)
                finally:
                    stamps.append((start, time.perf_counter()))
            setattr(self.dev, name, submit)
        self._original = device_path.succeed_all
        done, succeed = self.done, self._original

        def succeed_all(statuses):
            start = time.perf_counter()
            try:
                succeed(statuses)
            finally:
                done.append((start, time.perf_counter()))
        device_path.succeed_all = succeed_all
        return self

    def __exit__(self, *exc):
        if self.io_engine is not None:
            self.io_engine.__dict__.pop("batch_write", None)  # the class's method again
        if self.dev is None:
            return
        for name in SUBMITS:
            self.dev.__dict__.pop(name, None)  # the class's methods again
        device_path.succeed_all = self._original

    def clear(self) -> None:
        self.calls.clear()
        self.submits.clear()
        self.done.clear()

    def lone(self, t0: float, end: float) -> dict | None:
        """`lone_phases` of the one request sent at `t0` and concluded at `end`; None when the
        stamps are not those of one engine call (and one device batch, on a GPU)."""
        if len(self.calls) != 1:
            return None
        if self.dev is None:
            return lone_phases(t0, end, self.calls[0])
        if len(self.submits) != 1 or len(self.done) != 1:
            return None
        return lone_phases(t0, end, self.calls[0], self.submits[0], self.done[0])


def lone_phases(t0: float, end: float, call: tuple, submit: tuple | None = None, done: tuple | None = None) -> dict:
    """A lone request's phases (s) from send() at `t0` to its room's Success at `end`, split where
    our code and the engine's meet: `call` the engine call's (start, end), `submit` the device
    submit's, `done` the completion's (copy seen done, statuses handed back).

    On a GPU, in path order (they add up to the whole): `ours_to_engine` (send() to the engine
    call: planner, tracking, the shard's hand-off unless inline), `engine_to_submit` (softio's
    Python in `batch_write` before the device submit), `submit` (range table, launch),
    `copy_wait` (the submit's end to the copy seen done), `engine_completion` (softio's
    completion handing the statuses back), `ours_to_success` (our completion thread's wake-up,
    the Success and its aux). `engine_after_submit` (the call's rest, the statuses returned to
    us) runs while the copy does: off the path, given apart. The session-17 keys stay with their
    meaning: `to_submit` (= ours_to_engine + engine_to_submit), `to_success` (the copy seen done
    to Success: engine_completion + ours_to_success).

    On the CPU (softio's host path; no submit or completion stamps): `ours_to_engine`,
    `engine_call` and `call_to_success`."""
    c0, c1 = call
    out = {"ours_to_engine": c0 - t0}
    if submit is None or done is None:
        out.update(engine_call=c1 - c0, call_to_success=end - c1)
        return out
    (s0, s1), (d0, d1) = submit, done
    out.update(engine_to_submit=s0 - c0, submit=s1 - s0, copy_wait=d0 - s1, engine_completion=d1 - d0,
               ours_to_success=end - d1, engine_after_submit=c1 - s1, to_submit=s0 - t0, to_success=end - d0)
    return out


def engine_python_s(phases: dict) -> float:
    """The engine's own Python on a lone request's path (`lone_phases`, a GPU's): before its
    device submit and in its completion. MORI-IO does both in C++ with the GIL released; the
    submit itself (launch included) is kept."""
    return phases.get("engine_to_submit", 0.0) + phases.get("engine_completion", 0.0)


def engine_python_zero(whole_s: list, phases: list, plain_gbps: float, gb: float) -> dict | None:
    """A projection, never a measurement: the whole path per request with the engine's own
    Python (`engine_python_s`) at zero, as a C++ engine would leave it, over the requests whose
    phases were stamped; its GB/s as a fraction of the plain copy next to the measured one."""
    pairs = [(w, p) for w, p in zip(whole_s, phases) if p is not None and "engine_to_submit" in p]
    if not pairs:
        return None
    projected = median([w - engine_python_s(p) for w, p in pairs])
    measured = median([w for w, _ in pairs])
    return {"projection": "engine's Python before its submit and in its completion at zero (a C++ engine)",
            "s": projected, "measured_s": measured, "engine_python_ms": round(1e3 * (measured - projected), 3),
            "vs_plain_copy": gb / projected / plain_gbps, "measured_vs_plain_copy": gb / measured / plain_gbps}


def ours_s(rig: GpuPD, reqs: Requests, rows: list, phases: list | None = None, clock: PhaseClock | None = None) -> float:
    """Send the requests of `rows` back to back; seconds until the last room's Success. With
    `clock`, phases are appended to `phases` (s): a lone request's (`PhaseClock.lone`, None when
    its stamps do not fit), a burst's on a GPU."""
    rooms = rig.next_rooms(len(rows))
    rig.open_rooms(reqs, rooms, rows)
    wait_sendable(rig, rooms)
    if clock is not None:
        clock.clear()
    t0 = time.perf_counter()
    for room, row in zip(rooms, rows):
        rig.prefill.send_all(room, reqs.src[row])
    done = rig.prefill.sglang.wait_concluded(rooms, 120)
    t = max(done.values()) - t0
    if clock is not None and phases is not None:
        end = max(done.values())
        if len(rows) == 1:
            phases.append(clock.lone(t0, end))
        elif clock.dev is not None and len(clock.submits) == len(clock.done) == len(rows):
            # a burst: is the stream ever left waiting for the next request's submit?
            submits, seen = sorted(clock.submits), sorted(d for d, _ in clock.done)
            idle = sum(max(0.0, submits[k][1] - seen[k - 1]) for k in range(1, len(rows)))
            phases.append({"to_first_submit": submits[0][0] - t0, "stream_idle": idle, "to_last_success": end - seen[-1]})
    failed = [room for room in rooms if rig.prefill.failure(room)]
    rig.release(rooms)
    if failed:
        raise RuntimeError(f"rooms {failed} failed: {rig.prefill.failure(failed[0])}")
    return t


def bytes_check(rig: GpuPD, reqs: Requests, row: int, sample: int = 16) -> dict:
    """One more lone request of `row` after its source pages got fresh random bytes, then the
    digest of `sample` of its pages (the first, the last and some between, every buffer) on both
    sides: the whole path moved this request's bytes to this request's pages (issue 28, session 21:
    softio reuses a finished batch's range table, so a stale table would write the previous
    request's ranges). Never raises: a failure is reported in the result."""
    try:
        side = rig.prefill
        pages = reqs.src[row]
        index = torch.as_tensor(np.asarray(pages, dtype=np.int64), device=side.pool.kv[0].device)
        for t in side.pool.kv:
            rows = t.view(side.pool.pages, side.pool.item_len)
            rows.index_copy_(0, index, torch.randint(0, 256, (len(pages), side.pool.item_len), dtype=torch.uint8,
                                                         device=t.device))
        sync_all(rig)
        ours_s(rig, reqs, [row])
        picks = sorted(set(np.linspace(0, len(pages) - 1, min(sample, len(pages))).astype(int).tolist()))
        want = rig.expected_digests([int(pages[i]) for i in picks])
        got = rig.ask("digests", [int(reqs.dst[row][i]) for i in picks], timeout=120)
        return {"pages": len(picks), "mismatched": sum(a != b for a, b in zip(want, got))}
    except Exception as exc:  # noqa: BLE001 - reported, the measurements stand
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}


def captured_batch(dev, post, shared: list | None = None):
    """(dsts, srcs, sizes, to_peer) of the device batch that `post()` submits to `dev` (a table of
    shared ranges flattened); with `shared`, a list that receives submit_shared's arguments."""
    seen = []
    shared = [] if shared is None else shared
    original = dev.submit
    original_shared = getattr(dev, "submit_shared", None)

    def capture(dsts, srcs, sizes, statuses, to_peer=False, holds=()):
        seen.append((dsts, srcs, sizes, to_peer))
        return original(dsts, srcs, sizes, statuses, to_peer, holds)

    def capture_shared(dst_base, src_base, dst_off, src_off, sizes, statuses, to_peer=False, holds=()):
        seen.append((*device_path.expand_shared(dst_base, src_base, dst_off, src_off, sizes), to_peer))
        shared.append((dst_base, src_base, dst_off, src_off, sizes, to_peer))
        return original_shared(dst_base, src_base, dst_off, src_off, sizes, statuses, to_peer, holds)

    dev.submit = capture
    if original_shared is not None:
        dev.submit_shared = capture_shared
    try:
        post()
    finally:
        for name in SUBMITS:
            dev.__dict__.pop(name, None)  # the class's methods again
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


def kernel_shared_s(dev, batch, iters: int) -> list:
    """`kernel_s` of the shared kernel on its compact table (what `ours` launches since issue 28's
    link work), from the arguments submit_shared was given."""
    times = []
    db, sb, do, so, sz, to_peer = batch
    db, sb, do, so, sz = (np.asarray(a, dtype=np.int64).view(np.uint64) for a in (db, sb, do, so, sz))
    for i in range(iters + 1):
        dev.rt.use_device(dev.device)
        torch.cuda.synchronize(dev.device)
        t0 = time.perf_counter()
        keep = dev.copier.copy_shared(db, sb, do, so, sz, dev.stream, to_peer)
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

    process = in_transfer_process(rig)
    out["transfer_process"] = process
    if process:
        side.sglang.poll_s = LINK_POLL_S
        out["poll_s"] = LINK_POLL_S
    dev = None if process else device_engine(rig)
    ours_s(rig, reqs, [0])  # warm-up: plans, peer, kernel
    before = (dev.batches, dev.ranges) if dev else (0, 0)
    phases: list = []
    if not process:  # in-process: the engine calls are stamped, on the CPU too
        with PhaseClock(dev, side.pool.engine.engine) as clock:
            single = [ours_s(rig, reqs, [i % count], phases, clock) for i in range(iters)]
    else:
        single = [ours_s(rig, reqs, [i % count]) for i in range(iters)]
    batches, ranges = (dev.batches - before[0], dev.ranges - before[1]) if dev else (0, 0)
    burst_phases: list = []
    if dev is not None:
        with PhaseClock(dev) as clock:
            burst = [ours_s(rig, reqs, list(range(count)), burst_phases, clock) for _ in range(max(2, iters // 2))]
    else:
        burst = [ours_s(rig, reqs, list(range(count))) for _ in range(max(2, iters // 2))]
    out["ours"] = {"s": median(single), "gbps": gb / median(single),
                   "burst_s": median(burst), "gbps_per_s": gb * count / median(burst),
                   "ops": {"device_calls": batches / iters, "ranges": ranges / iters}}
    if not process:  # on the CPU check too (softio's host path): the check checked
        out["ours"]["bytes_check"] = bytes_check(rig, reqs, 0)
    # each lone request's whole path (ms), for the spread behind the median (session 22: 6 medians
    # of the phases summed 0.1 ms short of the whole's median at MLA 8K)
    out["ours"]["single_ms"] = [round(1e3 * x, 3) for x in single]
    for key, found in (("phases_ms", phases), ("burst_phases_ms", burst_phases)):
        found = [p for p in found if p is not None]
        if found:
            out["ours"][key] = {k: round(1e3 * median([p[k] for p in found]), 3) for k in found[0]}
    projection = engine_python_zero(single, phases, out["plain_copy"]["gbps"], gb) if phases else None
    if projection is not None:
        out["ours"]["engine_python_zero"] = projection
    base = out["plain_copy"]["gbps"]
    if process:  # the engine is the child's: no engine calls or kernel from here
        out["ours"]["vs_plain_copy"] = out["ours"]["gbps"] / base
        out["ours"]["per_s_vs_plain_copy"] = out["ours"]["gbps_per_s"] / base
        return out

    calls = [EngineCalls(rig, reqs, i) for i in range(count)]
    if dev is not None and dev.copier is not None:
        shared: list = []
        table = captured_batch(dev, lambda: EngineCalls.wait(calls[0].post("ours_arrays")), shared)
        k = kernel_s(dev, table, iters)
        out["kernel"] = {"s": median(k), "gbps": gb / median(k), "ranges": len(table[2])}
        if shared and hasattr(dev.copier, "copy_shared"):
            k = kernel_shared_s(dev, shared[-1], iters)
            out["kernel_shared"] = {"s": median(k), "gbps": gb / median(k), "vs_plain_copy": gb / median(k) / base}
    for pattern in ("ours_calls", "builtin_calls"):
        calls_s(calls[:1], pattern)  # warm-up
        single = [calls_s([calls[i % count]], pattern) for i in range(iters)]
        burst = [calls_s(calls, pattern) for _ in range(max(2, iters // 2))]
        out[pattern] = {"s": median(single), "gbps": gb / median(single),
                        "burst_s": median(burst), "gbps_per_s": gb * count / median(burst),
                        "ops": {"engine_calls": calls[0].calls(pattern), "pairs": len(calls[0].local),
                                "ranges": len(calls[0].sz) * len(calls[0].local)}}
    if "kernel" in out:
        out["kernel"]["vs_plain_copy"] = out["kernel"]["gbps"] / base
    for key in ("ours", "ours_calls", "builtin_calls"):
        out[key]["vs_plain_copy"] = out[key]["gbps"] / base
        out[key]["per_s_vs_plain_copy"] = out[key]["gbps_per_s"] / base
    return out
