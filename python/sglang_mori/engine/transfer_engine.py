"""A narrow, safe wrapper over one MORI-IO `IOEngine`.

What it guarantees to the backend above it:
- engine keys are unique per process incarnation (uids restart at 0 with every engine, §1.7);
- zero-length buffers are never registered (MORI aborts in ibv_reg_mr on size 0);
- every status object is kept alive until it is terminal (C++ writes into it asynchronously);
- one `batch_write` per submission, all pairs to the same peer, so an early "no route" return cannot
  leave later pairs silently in INIT without the whole submission failing;
- transient "SQ full" failures are resubmitted with backoff inside a deadline; the failed attempts stay
  in the handle so the caller can still wait for them to be terminal before releasing anything;
- waits are always bounded.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

logger = logging.getLogger(__name__)

from sglang_mori.engine.outcomes import (  # noqa: F401  (codes re-exported for engine tests)
    DRAINED_CODES,
    ERR_BAD_STATE,
    ERR_GPU_OP,
    ERR_INVALID_ARGS,
    ERR_NOT_FOUND,
    ERR_RDMA_OP,
    IN_PROGRESS,
    INIT,
    SUCCESS,
    FailureKind,
    PeerFailure,
    WriteState,
    classify_failure,
    is_failure,
    is_retryable,
)


class SubmitError(RuntimeError):
    """A submission raised (first-contact failure). `handle` holds whatever was issued before."""

    def __init__(self, message: str, handle: "TransferHandle"):
        super().__init__(message)
        self.handle = handle


@dataclass(frozen=True)
class WritePair:
    """Byte ranges from one local region into one remote region: lists or int64 numpy arrays
    (the planner's, often one array shared by every layer's pair)."""

    local: object  # MemoryDesc
    remote: object  # MemoryDesc
    local_offsets: Sequence[int]
    remote_offsets: Sequence[int]
    sizes: Sequence[int]


def _total(sizes) -> int:
    return int(sizes.sum()) if isinstance(sizes, np.ndarray) else int(sum(sizes))


def _pairs_bytes(pairs: Sequence["WritePair"]) -> int:
    """Bytes of all pairs, summing each distinct sizes array once: a 61-layer chunk shares one
    array across its pairs, and a numpy sum per pair was most of this call's time."""
    return _column_bytes([p.sizes for p in pairs])


def _column_bytes(sizes_column) -> int:
    by_array: dict = {}
    total = 0
    for sizes in sizes_column:
        n = by_array.get(id(sizes))
        if n is None:
            n = by_array[id(sizes)] = _total(sizes)
        total += n
    return total


class WriteBatch:
    """The writes of one engine call, as the columns `batch_write` takes: entry i of every
    column is one (local region, remote region) pair. Offsets and sizes are int64 arrays (or
    lists), usually one array object shared by every pair of a chunk, so a 61-layer chunk is
    five 61-entry lists and three arrays, with no object per pair.

    `sessions_key`: a stable key for the (local, remote) region pairs of this batch (the
    planner's cached descriptor columns), so a submitter checks that their sessions are open
    once per peer, not once per pair and chunk; None: check pair by pair.
    """

    __slots__ = ("local", "remote", "local_offsets", "remote_offsets", "sizes", "nbytes", "sessions_key")

    def __init__(self, local: list, remote: list, local_offsets: list, remote_offsets: list, sizes: list,
                 nbytes: Optional[int] = None, sessions_key=None):
        self.local, self.remote = local, remote
        self.local_offsets, self.remote_offsets, self.sizes = local_offsets, remote_offsets, sizes
        self.nbytes = _column_bytes(sizes) if nbytes is None else nbytes
        self.sessions_key = sessions_key

    @classmethod
    def of_pairs(cls, pairs: Sequence["WritePair"]) -> "WriteBatch":
        return cls([p.local for p in pairs], [p.remote for p in pairs], [p.local_offsets for p in pairs],
                   [p.remote_offsets for p in pairs], [p.sizes for p in pairs])

    def __len__(self) -> int:
        return len(self.local)

    def pair(self, i: int) -> "WritePair":
        return WritePair(self.local[i], self.remote[i], self.local_offsets[i], self.remote_offsets[i], self.sizes[i])

    def pairs(self) -> list:
        return [self.pair(i) for i in range(len(self.local))]

    def select(self, indices: Sequence[int]) -> "WriteBatch":
        return WriteBatch(*([column[i] for i in indices] for column in (
            self.local, self.remote, self.local_offsets, self.remote_offsets, self.sizes)))


def _as_lists(columns: list) -> list:
    """MORI's bindings take lists: each distinct array becomes a list once (a plan shares one
    array across all layers' pairs, so a 61-layer chunk converts 3 arrays, not 183)."""
    done: dict = {}

    def one(values):
        if not isinstance(values, np.ndarray):
            return values
        key = id(values)
        if key not in done:
            done[key] = (values, values.tolist())  # the array is kept so its id stays unique
        return done[key][1]

    out = []
    for column in columns:
        first = column[0] if column else None
        if first is not None and all(v is first for v in column):
            out.append([one(first)] * len(column))  # one shared array: one list, shared too
        else:
            out.append([one(v) for v in column])
    return out


@dataclass
class TransferHandle:
    """The statuses of one submission.

    `live` has one status per pair (the latest attempt); `issued` has every status ever posted,
    including failed "SQ full" attempts whose earlier post-batches may still be writing.
    """

    peer_key: str
    nbytes: int
    live: list = field(default_factory=list)
    issued: list = field(default_factory=list)
    # True when a submission raised part-way: some writes may be in flight that we hold no status
    # for, so quiescence can never be proven and pages must not be released early.
    unaccounted: bool = False
    started_at: float = 0.0  # the engine's clock when the submission started
    # Set by the owner once this handle's in-flight budget has been returned.
    released: bool = False
    # Resubmissions after "SQ full" (counted by the caller's metrics).
    retries: int = 0
    # Set by the owner after TransferEngine.fence_peer returned for this handle's peer, for a
    # handle it tracked before calling it: nothing of it can land any more (drained), whatever
    # its statuses say.
    fenced: bool = False

    # Caches: the completion thread asks every in-flight handle on every wake-up, and thousands of
    # status reads per pass would take the GIL from the threads moving the bytes. Terminal codes
    # never go back to running, so a prefix of finished statuses is skipped for good.
    _live_done: int = 0  # live[:_live_done] all SUCCESS
    _issued_done: int = 0  # issued[:_issued_done] all terminal
    _final: Optional[int] = None  # result() once it is terminal
    _next_failure_scan: float = 0.0

    FAILURE_SCAN_INTERVAL_S = 0.02

    def result(self) -> int:
        """Non-blocking: SUCCESS, IN_PROGRESS, or the first failure code of `live` (failure wins).

        While a status is running, the statuses behind it are scanned for failures at most every
        FAILURE_SCAN_INTERVAL_S, so a failure is seen within that time even out of order.
        """
        if self._final is not None:
            return self._final
        live = self.live
        n = len(live)
        bulk = True
        while self._live_done < n:
            raw = live[self._live_done].Code()
            code = int(raw)
            if code == SUCCESS:
                self._live_done += 1
                if bulk and self._live_done < n - 1:
                    # One look at the last status per call: where it succeeded too, the batch most
                    # likely finished as one (softio's device path completes a call's statuses
                    # together), and the ones between are read in one C-level pass rather than
                    # one Python iteration each (issue 28: 61 statuses of a chunk, read on the
                    # completion thread between the copy's end and the room's Success).
                    bulk = False
                    if int(live[-1].Code()) == SUCCESS:
                        self._live_done = _succeeded_prefix(live, self._live_done, n - 1, raw)
                continue
            if is_failure(code) or code == INIT:
                self._final = code if is_failure(code) else ERR_BAD_STATE
                return self._final
            now = time.monotonic()
            if now >= self._next_failure_scan:
                self._next_failure_scan = now + self.FAILURE_SCAN_INTERVAL_S
                for status in live[self._live_done + 1 :]:
                    later = int(status.Code())
                    if is_failure(later) or later == INIT:
                        self._final = later if is_failure(later) else ERR_BAD_STATE
                        return self._final
            return IN_PROGRESS
        self._final = SUCCESS
        return SUCCESS

    def first_look(self) -> list:
        """One pass over `live` right after a submission: the indices of failed statuses a
        resubmission may cure ("SQ full"), and, when there are none, the statuses that already
        succeeded are remembered (result() and quiescent() skip them for good, a terminal code
        never going back to running). Each status is read once here: before, the retry check,
        quiescent() and result() each read all 61 statuses of a chunk whose writes finished
        while they were posted (issue 28)."""
        retry = []
        done = self._live_done
        live = self.live
        settled = True  # every status read is SUCCESS or IN_PROGRESS
        for i in range(done, len(live)):
            # int(): MORI's StatusCode is a pybind11 enum whose comparisons with ints are strict.
            code = int(live[i].Code())
            if code == SUCCESS:
                if done == i:
                    done += 1
            elif code != IN_PROGRESS:
                settled = False
                if is_failure(code) and is_retryable(live[i]):
                    retry.append(i)
        if not retry:
            self._live_done = done
            if done == len(live):
                self._final = SUCCESS
            elif settled:
                # This pass was the scan for failures behind a running status that result()
                # would do on its first call (issue 28: 60 more reads on the posting thread,
                # SGLang's scheduler with inline posting): the next one is due an interval on.
                self._next_failure_scan = time.monotonic() + self.FAILURE_SCAN_INTERVAL_S
        return retry

    def state(self) -> WriteState:
        code = self.result()
        if code == SUCCESS and not self.unaccounted:
            return WriteState.SUCCEEDED
        if code == IN_PROGRESS:
            return WriteState.RUNNING
        return WriteState.FAILED

    def failure_kind(self) -> FailureKind:
        """Why this handle failed (call only when state() is FAILED, or to classify a give-up)."""
        code = self.result()
        if self.unaccounted:
            return FailureKind.REFUSED
        if code == IN_PROGRESS:
            return FailureKind.TIMED_OUT
        return classify_failure(code, self.failure_message())

    def wait_running(self, timeout_ms: int) -> bool:
        """Block (GIL released) until the first running status finishes or `timeout_ms` passes;
        False when nothing was running.

        The first one: waiting on the last running status instead (one wake per chunk rather than
        one per finished layer buffer) cut the completion thread's CPU on softio but made
        `bench transfer` slower in five of five same-run rounds (docs/benchmarks.md, issue 28):
        a room that finished while the thread waited on another's last status waited too."""
        if self.result() != IN_PROGRESS:
            return False
        self.live[self._live_done].WaitFor(timeout_ms)
        return True

    def quiescent(self) -> bool:
        """Every status ever issued is terminal (none still running).

        That proves no write can still land only when every status also succeeded: see drained().
        INIT counts as quiescent: a status left in INIT was never posted.
        """
        if self.fenced:
            return True
        if self.unaccounted:
            return False
        issued = self.issued
        if self._final == SUCCESS and len(issued) == len(self.live) and self._issued_done < len(issued):
            # result() saw every status SUCCESS and nothing else was ever posted (no resubmission:
            # `issued` holds the same statuses as `live`), and a terminal code never goes back to
            # running: quiescent without reading the 61 statuses of a chunk once more.
            self._issued_done = len(issued)
        while self._issued_done < len(issued):
            if int(issued[self._issued_done].Code()) == IN_PROGRESS:
                return False
            self._issued_done += 1
        return True

    def drained(self) -> bool:
        """Quiescent, and no status failed after it may have posted writes: nothing can land.

        A failed status is no such proof. MORI fails a transfer at its first error while its
        post-batches on other QPs (or those posted before a failed post) are still on the wire
        and land later; only failures raised before anything is posted count (DRAINED_CODES).
        """
        if self.fenced:
            return True
        return self.quiescent() and all(int(s.Code()) in DRAINED_CODES for s in self.issued)

    def failure_message(self) -> str:
        for status in self.live:
            code = int(status.Code())
            if is_failure(code) or code == INIT:
                return f"code {code}: {status.Message()}"
        return ""


def _succeeded_prefix(live: list, start: int, end: int, success) -> int:
    """The index of the first status of live[start:end] that is not SUCCESS, or `end`.
    `success`: a SUCCESS code as this engine's Code() returns it (MORI's pybind11 enum compares
    strictly with ints, never with its own members). The codes are read by one comprehension
    (cheaper per item than a loop of reads and tests, or map over a methodcaller) and counted
    in C; only a batch that did not all succeed is searched item by item."""
    codes = [status.Code() for status in live[start:end]]
    if codes.count(success) == len(codes):
        return end
    for k, code in enumerate(codes):
        if int(code) != SUCCESS:
            return start + k
    return end  # not reached: count said one differs


def make_engine_key(role: str, host: str) -> str:
    # pid + random suffix: a restarted process must never reuse a key (its uids restart at 0).
    return f"sglang-mori-{role}-{host}-pid{os.getpid()}-{uuid.uuid4().hex[:8]}"


# How many batch sizes TransferEngine keeps a list of spare uids for (`_stock_uids`).
SPARE_UID_SIZES = 8


class TransferEngine:
    def __init__(
        self,
        io,
        *,
        role: str,
        host: str,
        qp_per_transfer: int,
        post_batch_size: int,
        num_workers: int,
        enable_notification: bool = False,
    ):
        self.io = io
        # softio takes the plans' numpy arrays as they are; MORI's bindings get lists (_as_lists)
        self.takes_arrays = bool(getattr(io, "_TAKES_OFFSET_ARRAYS", False))
        self.key = make_engine_key(role, host)
        self.engine = io.IOEngine(self.key, io.IOEngineConfig(host, 0))
        rdma = io.RdmaBackendConfig(
            qp_per_transfer,
            post_batch_size,
            num_workers,
            io.PollCqMode.POLLING,
            enable_notification,
        )
        self.engine.create_backend(io.BackendType.RDMA, rdma)
        # The port is known only after create_backend (§1.1).
        self.desc = self.engine.get_engine_desc()
        self.packed_desc: bytes = self.desc.pack()
        self._local_descs: list = []
        self._peers: dict[str, object] = {}
        self._setup_lock = threading.Lock()  # registration is not thread-safe in MORI (§1.10)
        self.has_peer_failure_events = hasattr(self.engine, "pop_peer_failure")
        self._ignored_failures: set = set()  # engine keys gone on purpose (ignore_failures_of)
        self.clock = time.monotonic
        # A list of fresh transfer uids per batch size, allocated from the engine after a post
        # for the next post of that size (`_take_uids`), so that a call of 61 pairs does not
        # allocate its 61 uids one engine call at a time between send() and batch_write (issue 28).
        # Each list is taken whole (dict.pop: one thread gets it); a list two threads stocked at
        # once loses one of them, whose uids are then never used, which nothing requires.
        self._spare_uids: dict = {}

    def use_clock(self, clock) -> None:
        """The clock handles are stamped with and retries are bounded by: the service's, which
        also sets the deadlines they are compared with."""
        self.clock = clock

    # --- memory -----------------------------------------------------------------------------
    def register(self, ptr: int, size: int, device_id: int, on_gpu: bool):
        """Register one buffer; returns its MemoryDesc, or None for a zero-length buffer."""
        if size <= 0:
            return None
        loc = self.io.MemoryLocationType.GPU if on_gpu else self.io.MemoryLocationType.CPU
        with self._setup_lock:
            desc = self.engine.register_memory(ptr, size, device_id, loc)
            self._local_descs.append(desc)
        return desc

    def deregister_all(self) -> None:
        with self._setup_lock:
            for desc in self._local_descs:
                try:
                    self.engine.deregister_memory(desc)
                except Exception as exc:  # teardown is best effort
                    logger.warning("deregister_memory failed: %s", exc)
            self._local_descs.clear()

    def close(self) -> None:
        """Release everything this engine holds (memory registrations, remote engines, the backend
        and its threads) so the process can build another one: a runtime role switch does."""
        if self.engine is None:
            return
        self.deregister_all()
        for key in list(self._peers):
            self.remove_peer(key)
        try:
            self.engine.remove_backend(self.io.BackendType.RDMA)
        except Exception as exc:  # teardown is best effort
            logger.warning("remove_backend failed: %s", exc)
        self._spare_uids.clear()  # the closed engine's: a next engine allocates its own
        self.engine = None  # MORI's destructor (softio's finalizer) closes what is left

    def unpack_memory(self, blob: bytes):
        return self.io.MemoryDesc.unpack(blob)

    # --- peers ------------------------------------------------------------------------------
    def add_peer(self, packed_engine_desc: bytes) -> str:
        desc = self.io.EngineDesc.unpack(packed_engine_desc)
        with self._setup_lock:
            if desc.key not in self._peers:
                self.engine.register_remote_engine(desc)
                self._peers[desc.key] = desc
        return desc.key

    def remove_peer(self, key: str) -> None:
        with self._setup_lock:
            desc = self._peers.pop(key, None)
            if desc is not None:
                try:
                    self.engine.deregister_remote_engine(desc)
                except Exception as exc:
                    logger.warning("deregister_remote_engine(%s) failed: %s", key, exc)

    def connect(self, local, remote) -> None:
        """First contact now (dial, QPs, remote MR) so it cannot raise in the middle of a batch."""
        self.engine.create_session(local, remote)

    def pop_peer_failures(self) -> list:
        """Queued peer failures (MORI 1.2.4+) as PeerFailure; [] where the engine cannot report them."""
        if not self.has_peer_failure_events:
            return []
        events = []
        for _ in range(1024):
            event = self.engine.pop_peer_failure()
            if event is None:
                break
            failure = PeerFailure.from_event(event)
            if failure.engine_key not in self._ignored_failures:
                events.append(failure)
        return events

    def ignore_failures_of(self, key: str) -> None:
        """`key`'s connections end on purpose (the transfer process's start-up proof closes its
        probe engine): their failure is nobody's news."""
        self._ignored_failures.add(key)

    @property
    def can_fence(self) -> bool:
        """Whether fence_peer exists: softio's; MORI-IO (HEAD and 1.2.4) has no call that stops the
        writes posted to one peer (docs/reliability.md)."""
        return callable(getattr(self.engine, "fence_peer", None))

    def fence_peer(self, key: str, reason: str) -> bool:
        """True: as this returns, no write posted to `key` before the call can still land (they
        fail), and later writes to `key` go over new connections. False: this peer cannot be
        fenced (softio's device path). Only where `can_fence`."""
        return bool(self.engine.fence_peer(key, reason))

    def peer_keys(self) -> list:
        with self._setup_lock:
            return sorted(self._peers)

    # --- transfers --------------------------------------------------------------------------
    def write(
        self,
        peer_key: str,
        writes,
        *,
        deadline: float,
        retry_max: int,
    ) -> TransferHandle:
        """Post `writes` (a WriteBatch, or a sequence of WritePair) to `peer_key` in one
        `batch_write`; "SQ full" pairs are resubmitted with backoff until `deadline`."""
        batch = writes if isinstance(writes, WriteBatch) else WriteBatch.of_pairs(writes)
        handle = TransferHandle(peer_key=peer_key, nbytes=batch.nbytes, started_at=self.clock())
        n = len(batch.local)  # the list's C len: WriteBatch.__len__ is a Python call each time
        if not n:
            return handle
        try:
            handle.live = self._submit(batch, handle)
        finally:
            self._stock_uids(n)  # after the post: off the path to the engine call
        for attempt in range(1, retry_max + 1):
            retry = handle.first_look()
            if not retry:
                break
            backoff = min(0.001 * (2**attempt), 0.2)
            if self.clock() + backoff >= deadline:
                break
            time.sleep(backoff)  # backpressure from the NIC: give the send queue time to drain
            logger.info("resubmitting %d pair(s) after SQ full (attempt %d)", len(retry), attempt)
            handle.retries += len(retry)
            fresh = self._submit(batch.select(retry), handle)
            for i, status in zip(retry, fresh):
                handle.live[i] = status
        return handle

    def _take_uids(self, n: int) -> list:
        """`n` fresh transfer uids: the list stocked for `n` after an earlier post, else allocated
        now. Never one list for two calls: dict.pop hands it to one thread."""
        uids = self._spare_uids.pop(n, None)
        if uids is None:
            allocate = self.engine.allocate_transfer_uid
            uids = [allocate() for _ in range(n)]
        return uids

    def _stock_uids(self, n: int) -> None:
        """Allocate the next post's uids for a batch of `n` pairs, unless a list is stocked; sizes
        are few (a model's pairs per chunk, its last chunk's with state), the table is bounded."""
        spare = self._spare_uids
        if n in spare or len(spare) >= SPARE_UID_SIZES or self.engine is None:
            return
        allocate = self.engine.allocate_transfer_uid
        spare[n] = [allocate() for _ in range(n)]

    def _submit(self, batch: WriteBatch, handle: TransferHandle) -> list:
        uids = self._take_uids(len(batch.local))
        columns = [batch.local_offsets, batch.remote_offsets, batch.sizes]
        if not self.takes_arrays:
            columns = _as_lists(columns)
        try:
            statuses = self.engine.batch_write(batch.local, columns[0], batch.remote, columns[1], columns[2], uids)
        except Exception as exc:
            # Earlier pairs of this call may have been posted, and we hold no status for them.
            handle.unaccounted = True
            raise SubmitError(f"{type(exc).__name__}: {exc}", handle) from exc
        handle.issued.extend(statuses)
        return list(statuses)
