"""softio's device-memory path: writes between GPU registrations of engines on one host.

The stand-in for MORI-IO's XGMI route. A region registered as `MemoryLocationType.GPU` whose
pointer really is device memory is exported with a CUDA IPC handle at registration (carried in
the MemoryDesc's `ipc_handle` / `ipc_offset` fields, as MORI's XGMI backend carries its HIP IPC
handle); the initiator opens the peer's handle once and every `batch_write` becomes device copies
enqueued on the engine's own stream in ONE call (a gather kernel over the range table where CuPy
works, device_gather.py; else cudaMemcpyBatchAsync, range by range where the runtime lacks it),
followed by one event: every device pair of one `batch_write` call
shares that call and event (DeviceBatch), so a call's Python cost does not grow with its pairs. A completion thread waits on the events
(cudaEventSynchronize, without the GIL) and completes the statuses. No Python runs per byte or
per range, and none busy-waits.

Like MORI-IO, the copies are not ordered against the stream that produced the source: a copy
reads the source whenever the engine's stream reaches it. Whoever posts a write must first wait
until the producer's work is done (the layer-wise worker waits on the layer's event) — a missing
wait is a real bug here, as on MORI.

Pacing (SGLANG_MORI_SOFTIO_LINK_GBPS, GB/s; unset or 0: the copy engines' own speed) models one
NIC: a write's status completes no earlier than the link, serving writes in order at that rate,
would have carried its bytes. The copies themselves still run at once.

Not modelled on this path: softio's lane faults (stall, partial post, SQ full), the target's
write log and inbound notifications (MORI's XGMI has none either).

Each session holds the peer's mapping (remote_mapping.py): a batch takes it before its copies are
enqueued and gives it back after its event fired, so the mapping is closed (deregistered peer or
region, engine shutdown) only once no copy through it can still run. MORI's XGMI keeps a peer's
mappings until its backend is destroyed (docs/reliability.md).
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time

import numpy as np

from .device_gather import ce_min_bytes, make_copier, split_long
from .enums import StatusCode
from .memory import Region
from .remote_mapping import end_all
from .status import succeed_all

logger = logging.getLogger("sglang_mori.softio")

LINK_GBPS_ENV = "SGLANG_MORI_SOFTIO_LINK_GBPS"
_SUCCESS = StatusCode.SUCCESS
_ERR_GPU_OP = StatusCode.ERR_GPU_OP
_EVENT_POOL = 64
_umax = np.maximum.reduce  # without ndarray.max's Python wrapper


def link_bytes_per_s() -> float:
    raw = os.environ.get(LINK_GBPS_ENV, "").strip()
    if not raw:
        return 0.0
    value = float(raw)
    if value < 0:
        raise ValueError(f"{LINK_GBPS_ENV} must be >= 0 (GB/s), got {raw!r}")
    return value * 1e9


class DeviceEngine:
    """One engine's copy stream, event pool, paced link and completion thread."""

    def __init__(self, runtime, device: int, engine_key: str):
        self.rt = runtime
        self.device = device
        self.stream = runtime.stream(device)
        self.copier = make_copier(device)  # one kernel per batch where CuPy works (device_gather.py)
        # a finished batch's table goes back to the copier for the next batch (None: not kept)
        self._give_back = getattr(self.copier, "give_back", None)
        self.ce_min = ce_min_bytes()  # ranges this long go to the copy engines even with a kernel
        self.ce_ranges = 0
        self.rate = link_bytes_per_s()
        self._link_free = 0.0
        self._free_events = [runtime.event(device) for _ in range(_EVENT_POOL)]
        self._events_lock = threading.Lock()
        self._submit_lock = threading.Lock()  # copies and their event are enqueued as one step
        self._pending: "queue.Queue" = queue.Queue()
        self.batches = 0
        self.ranges = 0
        self.bytes = 0
        self._thread = threading.Thread(target=self._complete_loop, name=f"softio-gpu-{engine_key}", daemon=True)
        self._thread.start()

    def _event(self) -> int:
        with self._events_lock:
            if self._free_events:
                return self._free_events.pop()
        return self.rt.event(self.device)

    def submit(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, statuses: list,
               to_peer: bool = False, holds: tuple = ()) -> None:
        """Enqueue the copies and one event after them; `statuses` complete when it fires.
        `to_peer`: some destination is another GPU's memory (the copy crosses their link).
        `holds`: the RemoteMappings the copies go through, taken by the caller; each is given
        back once the event fired (never before: closing a mapping under a queued copy is a
        use-after-free)."""

        def copies():
            if self.copier is None:
                self.rt.copy(dsts, srcs, sizes, self.stream, self.device)
                return None
            # same stream: the long ranges' copies and the kernel run in order, before the event
            (ld, ls, ln), (sd, ss, sn) = split_long(dsts, srcs, sizes, self.ce_min)
            if len(ln):
                self.rt.copy(ld, ls, ln, self.stream, self.device)
                self.ce_ranges += len(ln)
            return self.copier.copy(sd, ss, sn, self.stream, to_peer) if len(sn) else None

        self._enqueue(copies, lambda: (int(sizes.sum()), len(sizes)), statuses, holds)

    def submit_shared(self, dst_base: np.ndarray, src_base: np.ndarray, dst_off: np.ndarray, src_off: np.ndarray,
                      sizes: np.ndarray, statuses: list, to_peer: bool = False, holds: tuple = ()) -> None:
        """`submit` of a batch whose pairs all copy the same ranges of their own regions (the
        backend's plans: one offset array per chunk shared by every layer's buffer): pair i's
        range j goes from src_base[i] + src_off[j] to dst_base[i] + dst_off[j], sizes[j] bytes.
        The ranges are split (copy engines or kernel, pieces) once for all pairs, and the
        kernel's table is written where it is uploaded from, never flattened first."""

        def copies():
            db, sb, do, so, sz = (np.asarray(a, dtype=np.int64).view(np.uint64)
                                  for a in (dst_base, src_base, dst_off, src_off, sizes))
            if self.copier is None:
                self.rt.copy(*expand_shared(db, sb, do, so, sz), self.stream, self.device)
                return None
            if len(sz) and (not self.ce_min or int(_umax(sz)) < self.ce_min):  # no long range: as split_long, sooner
                return self.copier.copy_shared(db, sb, do, so, sz, self.stream, to_peer)
            (ld, ls, ln), (sd, ss, sn) = split_long(do, so, sz, self.ce_min)
            if len(ln):
                self.rt.copy(*expand_shared(db, sb, ld, ls, ln), self.stream, self.device)
                self.ce_ranges += len(ln) * len(db)
            return self.copier.copy_shared(db, sb, sd, ss, sn, self.stream, to_peer) if len(sn) else None

        self._enqueue(copies, lambda: (int(np.sum(sizes)) * len(dst_base), len(sizes) * len(dst_base)),
                      statuses, holds)

    def _enqueue(self, copies, counts, statuses: list, holds: tuple) -> None:
        """Run `copies()` (enqueues them on the stream, returns what must outlive them) and record
        the batch's event after them, as one step; the completion thread takes it from there.
        `counts()`: (bytes, ranges) of the batch."""
        event = self._event()
        enqueued = False
        keep = None
        try:
            with self._submit_lock:
                enqueued = True  # from here on some copies may be queued on the stream
                keep = copies()
                self.rt.record(event, self.stream)
                # the batch's counts after its copies are queued (issue 28: nothing on the way to
                # the first byte that can wait); the pacing's clock is read after them, as before
                nbytes, nranges = counts()
                now = time.monotonic()
                paced = 0.0
                if self.rate > 0:
                    self._link_free = max(self._link_free, now) + nbytes / self.rate
                    paced = self._link_free
                self.batches += 1
                self.ranges += nranges
                self.bytes += nbytes
        except Exception as exc:  # noqa: BLE001 - a CUDA error fails this write, not the caller
            self._fail_submit(event, statuses, holds, f"softio device copy failed: {exc}", enqueued, keep)
            return
        self._pending.put((event, statuses, paced, keep, holds, None))

    def _fail_submit(self, event: int, statuses: list, holds: tuple, message: str, enqueued: bool,
                     keep) -> None:
        """A submit that raised: its statuses fail, but copies it queued before the error may
        still run, so the holds are given back only behind an event recorded after them."""
        if enqueued and holds:
            try:
                self.rt.record(event, self.stream)
            except Exception as exc:  # noqa: BLE001
                for status in statuses:
                    status.Update(_ERR_GPU_OP, message)
                # Nothing proves the queued copies finished: the mappings stay open for good
                # (a leak) rather than be closed under a copy (a write into freed memory).
                logger.error("softio: cannot fence a failed device copy (%s); keeping %s mapped", exc,
                             ", ".join(h.what for h in holds))
                return
            self._pending.put((event, statuses, 0.0, keep, holds, message))
            return
        with self._events_lock:
            self._free_events.append(event)
        end_all(holds)
        for status in statuses:
            status.Update(_ERR_GPU_OP, message)

    def _complete_loop(self) -> None:
        self.rt.use_device(self.device)
        while True:
            item = self._pending.get()
            if item is None:
                return
            event, statuses, paced, keep, holds, error = item  # keep: the kernel's range table
            try:
                self.rt.synchronize(event)
            except Exception as exc:  # noqa: BLE001 - the context is broken: no copy runs any more
                error = error or f"softio device copy failed: {exc}"
                keep = None  # nothing proves the kernel is done with its table: never reused
            end_all(holds)  # the copies through them are done: a released mapping may close now
            if error is not None:
                for status in statuses:
                    status.Update(_ERR_GPU_OP, error)
            else:
                delay = paced - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                succeed_all(statuses)
            if keep is not None and self._give_back is not None:
                self._give_back(keep)  # its kernel ran: the next batch may reuse its table (after the statuses)
            with self._events_lock:
                self._free_events.append(event)

    def close(self) -> None:
        self._pending.put(None)


class DeviceSession:
    """A (local device region, remote device region) pair; `transfer` enqueues copies."""

    def __init__(self, backend, engine: DeviceEngine, local: Region, remote_base: int, remote_size: int,
                 to_peer: bool = False, mapping=None):
        self.backend = backend  # IOEngineSession.allocate_transfer_uid reaches the engine through it
        self.engine = engine
        self.local = local
        self.remote_base = remote_base
        self.remote_size = remote_size
        self.to_peer = to_peer  # the remote region lives on another GPU than the local one
        self.mapping = mapping  # RemoteMapping of the remote region (None: nothing to give back)

    def release(self) -> None:
        """The session is dropped: its mapping closes once the copies through it are done."""
        if self.mapping is not None:
            self.mapping.release()

    def transfer(self, local_offsets, remote_offsets, sizes, status, uid: int, is_read: bool) -> None:
        batch = DeviceBatch()
        self.add_to(batch, local_offsets, remote_offsets, sizes, status, is_read)
        batch.submit()

    def add_to(self, batch: "DeviceBatch", local_offsets, remote_offsets, sizes, status, is_read: bool) -> None:
        """Add one pair's ranges to `batch` (status IN_PROGRESS); checked there, with the others."""
        status._start()
        if not (len(local_offsets) == len(remote_offsets) == len(sizes)):
            status.Update(StatusCode.ERR_INVALID_ARGS, "offset and size lists differ in length")
            return
        if len(sizes) == 0:
            status.Update(_SUCCESS, "")
            return
        batch.add(self, local_offsets, remote_offsets, sizes, status, is_read)


class DeviceBatch:
    """Device pairs of one `batch_write` call, posted as one copy call and one event per engine
    stream. The pairs' ranges are checked and turned into addresses with one set of numpy
    operations over all of them, so the Python cost of a call hardly grows with its pairs (a
    chunk of a 61-layer model is 61 pairs)."""

    __slots__ = ("_by_engine",)

    def __init__(self):
        self._by_engine: dict = {}

    def add(self, session: DeviceSession, lo, ro, sz, status, is_read: bool) -> None:
        pairs = self._by_engine.get(session.engine)
        if pairs is None:
            pairs = self._by_engine[session.engine] = []
        pairs.append((session, lo, ro, sz, status, is_read))

    def submit(self) -> None:
        batches, self._by_engine = self._by_engine, {}
        for engine, pairs in batches.items():
            _submit_pairs(engine, pairs)


def expand_shared(dst_base: np.ndarray, src_base: np.ndarray, dst_off: np.ndarray, src_off: np.ndarray,
                  sizes: np.ndarray):
    """(dsts, srcs, sizes) of `DeviceEngine.submit_shared`'s copies, pair by pair (uint64)."""
    dst_base, src_base = (np.asarray(a, dtype=np.uint64) for a in (dst_base, src_base))
    dst_off, src_off, sizes = (np.asarray(a, dtype=np.uint64) for a in (dst_off, src_off, sizes))
    return ((dst_base[:, None] + dst_off).reshape(-1), (src_base[:, None] + src_off).reshape(-1),
            np.tile(sizes, len(dst_base)))


def _flat(values, total: int) -> np.ndarray:
    if len(values) == 1:
        return np.asarray(values[0], dtype=np.int64).reshape(-1)
    if all(isinstance(v, np.ndarray) for v in values):  # the backend's plans: no per-element work
        return np.concatenate(values).astype(np.int64, copy=False)
    return np.fromiter(itertools.chain.from_iterable(values), dtype=np.int64, count=total)


def _hold_mappings(pairs: list) -> tuple[list, tuple]:
    """(the pairs whose remote mapping is still open, the mappings taken for them); a pair whose
    mapping was released fails here, before anything is enqueued."""
    taken: dict = {}
    live = []
    for pair in pairs:
        mapping = pair[0].mapping
        if mapping is not None:
            if mapping not in taken:
                taken[mapping] = mapping.begin()
            if not taken[mapping]:
                pair[4].Update(StatusCode.ERR_BAD_STATE, f"softio: {mapping.what} is no longer mapped (its engine "
                                                         f"is gone or was deregistered, or a region of the pair "
                                                         f"was deregistered)")
                continue
        live.append(pair)
    return live, tuple(m for m, ok in taken.items() if ok)


def _submit_pairs(engine: DeviceEngine, pairs: list) -> None:
    pairs, holds = _hold_mappings(pairs)
    handed = False
    try:
        if pairs:
            handed = _post_pairs(engine, pairs, holds)
    finally:
        if not handed:
            for hold in holds:
                hold.end()  # nothing was enqueued through it


def _shared_ranges(pairs: list):
    """(lo, ro, sz) as int64 arrays when every pair is a write with the same three offset arrays
    (what the backend's plans pass: one array per chunk shared by all layers' buffers); else None."""
    lo, ro, sz = pairs[0][1], pairs[0][2], pairs[0][3]
    if not (isinstance(lo, np.ndarray) and isinstance(ro, np.ndarray) and isinstance(sz, np.ndarray)):
        return None
    for p in pairs:
        if p[1] is not lo or p[2] is not ro or p[3] is not sz or p[5]:
            return None
    return (lo.astype(np.int64, copy=False).reshape(-1), ro.astype(np.int64, copy=False).reshape(-1),
            sz.astype(np.int64, copy=False).reshape(-1))


def _post_shared(engine: DeviceEngine, pairs: list, holds: tuple, lo, ro, sz) -> bool | None:
    """The common case in O(pairs + ranges) numpy with no per-range index arrays: every pair
    writes the same ranges of its own regions, so the bounds are checked once against the
    smallest region and the table is two broadcast sums. None: a range is out of bounds or
    empty, which the general path handles pair by pair."""
    if len(sz) == 0 or sz.min() <= 0 or lo.min() < 0 or ro.min() < 0:
        return None
    local_ptr = np.fromiter((p[0].local.ptr for p in pairs), dtype=np.int64, count=len(pairs))
    local_size = np.fromiter((p[0].local.size for p in pairs), dtype=np.int64, count=len(pairs))
    remote_base = np.fromiter((p[0].remote_base for p in pairs), dtype=np.int64, count=len(pairs))
    remote_size = np.fromiter((p[0].remote_size for p in pairs), dtype=np.int64, count=len(pairs))
    if (lo + sz).max() > local_size.min() or (ro + sz).max() > remote_size.min():
        return None
    to_peer = any(p[0].to_peer for p in pairs)
    engine.submit_shared(remote_base, local_ptr, ro, lo, sz, [p[4] for p in pairs], to_peer, holds)
    return True


def _post_pairs(engine: DeviceEngine, pairs: list, holds: tuple) -> bool:
    """Check the pairs' ranges and submit their copies; True when `holds` went to the engine."""
    shared = _shared_ranges(pairs)
    if shared is not None:
        posted = _post_shared(engine, pairs, holds, *shared)
        if posted is not None:
            return posted
    counts = np.fromiter((len(p[3]) for p in pairs), dtype=np.int64, count=len(pairs))
    total = int(counts.sum())
    lo = _flat([p[1] for p in pairs], total)
    ro = _flat([p[2] for p in pairs], total)
    sz = _flat([p[3] for p in pairs], total)
    which = np.repeat(np.arange(len(pairs)), counts)  # the pair of each range
    local_ptr = np.array([p[0].local.ptr for p in pairs], dtype=np.int64)[which]
    local_size = np.array([p[0].local.size for p in pairs], dtype=np.int64)[which]
    remote_base = np.array([p[0].remote_base for p in pairs], dtype=np.int64)[which]
    remote_size = np.array([p[0].remote_size for p in pairs], dtype=np.int64)[which]
    outside = (sz < 0) | (lo < 0) | (ro < 0) | (lo + sz > local_size) | (ro + sz > remote_size)
    statuses = [p[4] for p in pairs]
    keep = sz > 0
    if outside.any():
        bad = set(np.unique(which[outside]).tolist())  # a pair with one bad range sends nothing
        for i in bad:
            statuses[i].Update(StatusCode.ERR_INVALID_ARGS, "a range lies outside its registered region")
        keep &= ~np.isin(which, list(bad))
        statuses = [s for i, s in enumerate(statuses) if i not in bad]
    if not keep.all():
        lo, ro, sz, which = lo[keep], ro[keep], sz[keep], which[keep]
        local_ptr, remote_base = local_ptr[keep], remote_base[keep]
    if not statuses:
        return False
    if len(sz) == 0:
        for status in statuses:
            status.Update(_SUCCESS, "")
        return False
    local = lo + local_ptr
    remote = ro + remote_base
    reads = np.array([p[5] for p in pairs], dtype=bool)
    if reads.any():
        read = reads[which]
        dsts, srcs = np.where(read, local, remote), np.where(read, remote, local)
    else:
        dsts, srcs = remote, local
    to_peer = any(p[0].to_peer for p in pairs)
    engine.submit(dsts.astype(np.uint64), srcs.astype(np.uint64), sz.astype(np.uint64), statuses, to_peer, holds)
    return True
