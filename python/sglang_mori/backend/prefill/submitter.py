"""Chunk-wise submission: plan each chunk the scheduler hands over and post its writes.

One queue and thread per shard (SGLANG_MORI_TRANSFER_SHARDS); a room always maps to the same
shard, so its chunks are submitted in order. A room whose decode stalled moves on, from its shard,
to one more shard thread for stalled decodes (in order too), so that a write held for a stalled
decode's byte budget waits there and not in front of other decodes' chunks. A chunk is submitted
between `begin_submit` and `end_submit` on its room (both under the registry lock): while a
submitter works, the room counts as having writes outstanding, so an abort can never be ACKed
between "room is live" and "its writes are tracked".
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from typing import List, Optional

import numpy as np

from sglang_mori import protocol
from sglang_mori.config import transfer_shard_count
from sglang_mori.backend import room_status
from sglang_mori.backend.prefill.announce import LazyAnnouncer
from sglang_mori.backend.prefill.effects import RoomEffects
from sglang_mori.backend.peers import Admission
from sglang_mori.backend.prefill.failures import (
    ABORTED,
    BACKPRESSURE,
    BAD_INDEX,
    LAYOUT,
    NO_METADATA,
    OTHER,
    PEER_DEAD,
    PROTOCOL,
    SUBMIT_ERROR,
    TIMEOUT,
    PrefillFailures,
)
from sglang_mori.backend.prefill.parts import PrefillParts
from sglang_mori.backend.prefill.rooms import Phase, TrackedWrite
from sglang_mori.backend.prefill.success import SuccessDecider
from sglang_mori.engine import SubmitError, WriteState
from sglang_mori.planning import PlanningError

logger = logging.getLogger(__name__)

# `post`'s answer for a chunk sent on to the stalled-decodes shard instead of held on its own.
DEFERRED = object()
# `post`'s answer on the handing-over thread (an inline post) when something would wait: nothing
# was posted, and the chunk goes to its shard's queue instead.
HAND_OFF = object()
# `post`'s outcome while `_post_targets` has not returned (it raised).
_RAISED = object()


@dataclass
class Chunk:
    room: int
    kv_indices: np.ndarray
    index_slice: slice
    is_last: bool
    aux_index: Optional[int]
    state_indices: Optional[list]
    wait_event: object = None
    num_kv_tokens: Optional[int] = None  # real tokens of the chunk (SGLang's send(num_kv_tokens))
    # Send TransferStarted (restarts decode's deadline). A layer-wise stream announces its
    # first group only: one message per room and forward instead of one per layer group.
    announce: bool = True
    # The room life the scheduler handed the chunk over for (set by `enqueue`): a chunk still
    # queued when that life ends is never written for a next life of the room id.
    life: object = None
    queued: bool = False  # counted in `life.queued` until a shard takes it


class ChunkSubmitter:
    def __init__(self, parts: PrefillParts, effects: RoomEffects, failures: PrefillFailures, success: SuccessDecider):
        self.p = parts
        self.effects = effects
        self.failures = failures
        self.success = success
        self.announcer = LazyAnnouncer(parts)
        cfg = parts.config
        # SimpleQueue: its put and get are C, a few microseconds less per chunk on each side than
        # queue.Queue's Python condition (the put runs in SGLang's scheduler thread). Unbounded,
        # so the bound is checked before the put: more than one producer (the layer-wise worker)
        # can only overshoot it by a chunk or two, and the shards' stop sentinel always fits.
        self.max_queued = cfg.max_queued_chunks
        self.queues = [queue.SimpleQueue() for _ in range(transfer_shard_count(cfg))]
        # One more shard, for rooms whose decode stalled (`_to_stalled_shard`): a write the peer's
        # byte budget holds waits on this thread, not on the shard of other decodes' rooms.
        self.stalled_queue = queue.SimpleQueue()
        # Inline posts (SGLANG_MORI_INLINE_POST): a shard thread marks itself busy while it works
        # on a chunk (written by that thread only), so the handing-over thread posts only where
        # it overtakes nothing of its shard. Ordering does not rest on it: a room's chunks stay
        # in order through the room's own counts (`_inline_targets`).
        mode = getattr(cfg, "inline_post", "off")
        self.inline_post = mode == "on" or (mode == "auto" and not getattr(parts, "scheduler_hands_over", True))
        self.shard_busy = [False] * len(self.queues)
        self.inline_posts = 0  # chunks posted inline (tests and benchmarks read it)
        # Count and publish the queue depth as one step: shards and the scheduler update it at once.
        self._depth_lock = threading.Lock()
        self.stopped = threading.Event()

    # --- scheduler side -------------------------------------------------------------------------
    def enqueue(self, chunk: Chunk) -> None:
        status = self.p.sglang.status(chunk.room)
        if status is None or status == room_status.FAILED:
            return
        shard = chunk.room % len(self.queues)
        if (self.inline_post and chunk.wait_event is None and not self.shard_busy[shard]
                and not self.queues[shard].qsize() and self._post_inline(chunk)):
            return
        with self.p.rooms.lock:
            chunk.life = self.p.rooms.get(chunk.room)  # the sender's life: the scheduler holds it
            if chunk.life is not None:
                chunk.life.queued += 1
                chunk.queued = True
        if chunk.life is None:
            return
        q = self.queues[shard]
        if q.qsize() >= self.max_queued:
            with self.p.rooms.lock:
                chunk.life.queued -= 1
                chunk.queued = False
            self.failures.fail_life(chunk.life, f"transfer queue full ({self.max_queued} chunks, "
                                    "SGLANG_MORI_MAX_QUEUED_CHUNKS)", BACKPRESSURE)
            self._publish_depth()
        else:
            # Published with this chunk counted before the put, not after: the put wakes the
            # shard, which would otherwise wait for this thread's GIL to start on it (issue 28).
            # The shard publishes again once it took the chunk, so an idle gauge still reads 0.
            self._publish_depth(1)
            q.put(chunk)

    def _post_inline(self, chunk: Chunk) -> bool:
        """Plan and post `chunk` on the calling thread (SGLang's scheduler, the transfer process's
        reader) instead of waking its shard: True once the chunk is dealt with here (posted,
        dropped, or its room failed through the failure door), False, with nothing changed, when
        it must go to its shard's queue (`enqueue` then queues it). Never waits: whatever would
        (a session still to open, a budget that would hold the write) hands the chunk over
        before anything is posted. The one exception is the engine's resubmission of pairs the
        NIC's send queue refused (SGLANG_MORI_SUBMIT_RETRY_MAX), which backs off once posted."""
        try:
            with self.effects.transition(never_block=True) as fx:
                r, targets = self._inline_targets(chunk, fx)
            if r is None:
                return targets is None  # None: dealt with (dropped or failed); False: hand over
            chunk.life = r
            # A failure of the post, a bug's included, fails this room inside (post_tracked).
            handed_off = self.post_tracked(chunk, r, targets, inline=True) is HAND_OFF
        except Exception as exc:
            # A bug around the post (tracking it, its Success attempt) fails this room, as a shard
            # does (run_shard), never the caller: SGLang's send() or the transfer process's reader,
            # which would only log it and leave the room open with its chunk lost.
            logger.exception("sglang-mori: chunk of room %s failed", chunk.room)
            with self.effects.transition(never_block=True) as fx:
                life = chunk.life if chunk.life is not None else self.p.rooms.get(chunk.room)
                if life is not None:
                    self.failures.conclude_locked(life, f"internal error while sending KV: {exc!r}", OTHER, fx)
            return True
        if not handed_off:
            self.inline_posts += 1
        return not handed_off

    def _inline_targets(self, chunk: Chunk, fx):
        """(life, targets) with a submit token taken when `chunk` may be posted inline (registry
        lock held); (None, None) when there is nothing to post (no life, concluded, failed here);
        (None, False) when it must go to its shard. A room's chunks keep their order: the room
        has no chunk queued or being submitted (a shard's, or a layer-wise write), and nothing
        else hands chunks of it over while this thread posts one."""
        p = self.p
        r = p.rooms.get(chunk.room)
        if r is None or r.concluded:
            return None, None
        if r.queued or r.submitting or r.on_stalled_shard or len(r.targets) != 1:
            return None, False
        budget = p.peers.budget
        if not budget.idle() and any(budget.stalled(t.engine_key) for t in r.live_targets()):
            return None, False  # its shard moves it to the stalled-decodes shard
        targets = self._begin_locked(r, fx)
        return (r, targets) if targets is not None else (None, None)

    def track_without_writes(self, chunk: Chunk) -> bool:
        """On the caller's thread (SGLang's scheduler), track a chunk that has nothing to write
        (layer-wise streamed every page of it) as a shard would, without the hop to the shard's
        thread. False, and nothing changes, while an earlier chunk of the room's life still waits
        in a shard's queue: a room's chunks are tracked in order, so this one must queue too."""
        p = self.p
        status = p.sglang.status(chunk.room)
        if status is None or status == room_status.FAILED:
            return True  # as `enqueue`: nothing to track for a failed or cleared room
        with self.effects.transition(never_block=True) as fx:  # a failure found here is sent from SGLang's thread
            r = p.rooms.get(chunk.room)
            if r is not None and r.queued:
                return False
            chunk.life = r
            if self._begin_locked(r, fx) is not None:
                p.rooms.end_submit(r, [], chunk.is_last, chunk.aux_index, fx)
        return True

    def queued(self) -> int:
        return sum(q.qsize() for q in self.queues) + self.stalled_queue.qsize()

    def _publish_depth(self, about_to_queue: int = 0) -> None:
        with self._depth_lock:
            self.p.metrics.set_queue_depth(self.queued() + about_to_queue)

    # --- shard threads ------------------------------------------------------------------------
    def run_shard(self, q: queue.Queue) -> None:
        shard = next((i for i, own in enumerate(self.queues) if own is q), None)
        busy = self.shard_busy
        while not self.stopped.is_set():
            chunk = q.get()
            if chunk is None:
                return
            if shard is not None:
                busy[shard] = True
            try:
                if q is not self.stalled_queue and self._to_stalled_shard(chunk):
                    self.stalled_queue.put(chunk)  # still counted in its life's `queued`
                    continue
                self.submit(chunk, defer_held=q is not self.stalled_queue)
            except Exception as exc:  # a bug must fail one room, not stop the shard
                logger.exception("sglang-mori: chunk of room %s failed", chunk.room)
                if chunk.life is not None:
                    self.failures.fail_life(chunk.life, f"internal error while sending KV: {exc!r}", OTHER)
            finally:
                # Also on dequeue: published only on enqueue, the gauge kept its last value when
                # idle. After the chunk's post, not before it (issue 28: send() to the engine call).
                self._publish_depth()
                if shard is not None:
                    busy[shard] = False

    def _to_stalled_shard(self, chunk: Chunk) -> bool:
        """Whether a chunk a shard just took goes on to the stalled-decodes shard instead.

        A room moves there when a decode it writes to has stalled (`InflightBudget.stalled`) and
        no earlier chunk of it is still being submitted elsewhere (a layer-wise submit token); it
        stays while its decode is stalled or any chunk of it is on its way there, and comes back
        once neither holds, so that another decode stalling later does not hold it. This shard
        took the room's chunks in order and finished each before taking the next, and a chunk
        moves only behind every earlier one of its room, so their order holds. A decode that
        stalls after this check is caught where the write would be held (`post_tracked`'s
        `defer_held`)."""
        life = chunk.life
        if life is None:
            return False
        budget = self.p.peers.budget
        # Nothing in flight anywhere and the room not moved: it stays, decided without a lock on
        # a lone request's way to its engine call (issue 28). `on_stalled_shard` is written only
        # by the thread of the room's own shard, this one.
        if not life.on_stalled_shard and budget.idle():
            return False
        with self.p.rooms.lock:
            if life.concluded:
                return False  # dropped wherever it is taken
            if life.submitting and not life.on_stalled_shard:
                return False
            stalled = any(budget.stalled(t.engine_key) for t in life.live_targets())
            # `queued` counts this chunk: more means an earlier one of the room is queued there.
            on_its_way = life.on_stalled_shard and (life.queued > 1 or life.submitting > 0)
            life.on_stalled_shard = stalled or on_its_way
            return life.on_stalled_shard

    def stop(self) -> None:
        self.stopped.set()
        self.p.peers.budget.wake()  # a shard holding a write for its peer's budget gives up now
        for q in (*self.queues, self.stalled_queue):
            q.put(None)

    def submit(self, chunk: Chunk, defer_held: bool = False) -> None:
        """`defer_held`: a first write the budget would hold sends the chunk on to the stalled-decodes
        shard instead (`post`)."""
        p = self.p
        with self.effects.transition() as fx:
            # The chunk's own life, never the room id's current one (a next life by now, maybe);
            # a chunk handed in without `enqueue` (tests, tools) is for the current life.
            r = chunk.life if chunk.life is not None else p.rooms.get(chunk.room)
            if chunk.queued:  # taken off the queue and, below, tracked or dropped at once
                chunk.queued = False
                r.queued -= 1
            targets = self._begin_locked(r, fx)
        if targets is not None:
            self.post_tracked(chunk, r, targets, defer_held)

    def _begin_locked(self, r, fx) -> Optional[list]:
        """A submit token on room life `r` (registry lock held) and its live targets; None when
        nothing may be written: no life, concluded, failed here (no metadata, refused layout), or
        its sender was cleared (a queued attempt's next life may hold the room id now)."""
        if r is None or r.concluded:
            return None
        if r.phase is Phase.AWAITING_METADATA:
            problem = (NO_METADATA, PROTOCOL)
        else:
            problem = next(((t.reject_reason, LAYOUT) for t in r.targets.values() if t.reject_reason), None)
        if problem is not None:
            self.failures.conclude_locked(r, *problem, fx)
            return None
        if not self.p.rooms.begin_submit(r, fx):
            return None
        return r.live_targets()

    def post_tracked(self, chunk: Chunk, r, targets, defer_held: bool = False, inline: bool = False):
        """Post `chunk` to `targets` for room life `r`, whose submit token the caller took
        (`rooms.begin_submit`), then track its writes and give the token back; a failure fails
        the room through the failure door. The step the layer-wise worker shares (it waits for a
        held write itself). `defer_held` (a transfer shard): a chunk whose first write would be
        held, nothing of it posted, goes on to the stalled-decodes shard, queued again for its
        room, and its room with it. `inline` (`_post_inline`): the caller must not wait; a chunk
        that would, nothing of it posted, gives its token back and HAND_OFF is returned. Returns
        the number of writes tracked."""
        writes: List[TrackedWrite] = []
        failure = None
        announce = [chunk.announce]  # still due after `post`: a last chunk's, held back (announce.py)
        try:
            failure = self.post(chunk, targets, writes, r, defer_held, announce=announce, inline=inline)
        except Exception as exc:
            # A bug fails this room through the door in the same transition that tracks the
            # chunk: failed later, a last chunk with nothing tracked could conclude Success first.
            logger.exception("sglang-mori: chunk of room %s failed", chunk.room)
            failure = f"internal error while sending KV: {exc!r}", OTHER
        finally:
            handed_off = failure is HAND_OFF
            deferred = failure is DEFERRED
            if deferred or handed_off:
                failure = None
            with self.effects.transition(never_block=inline) as fx:
                if announce[0] and failure is None and writes:
                    # Sent by the completion thread if the writes still run after the grace; moot
                    # once the room concludes (a failure below, or its Success).
                    self.announcer.defer(r, targets, self.p.clock())
                # A deferred or handed-over chunk is not the room's last submitted yet: it comes again.
                self.p.rooms.end_submit(r, writes, chunk.is_last and not (deferred or handed_off),
                                        chunk.aux_index, fx)
                if failure is not None:
                    self.failures.conclude_locked(r, *self._first_cause(r, failure), fx)
                if deferred:
                    chunk.life, chunk.announce, chunk.queued = r, False, True  # decode heard it started
                    r.queued += 1
                    r.on_stalled_shard = True
        if handed_off:
            return HAND_OFF
        if deferred:
            self.stalled_queue.put(chunk)
            self._publish_depth()
            return 0
        if announce[0] and failure is None and not writes:
            self._announce(chunk, targets, announce, block=not inline)  # nothing to wait on: at once
        if failure is None and r.last_submitted:
            # Writes that finished while they were posted (fast links): Success from here, not
            # after a wake-up of the completion thread (success.py).
            self.success.try_succeed(r, never_block=inline)
        return len(writes)

    def _first_cause(self, r, failure: tuple) -> tuple:
        """The reason to fail room life `r` with, under the registry lock: `failure` (this chunk's
        (reason, label)), unless it only says the peer is unusable (PEER_DEAD: "failed recently",
        "cannot reach") while a write of the room already failed or expired. The peer was marked
        by another room's failure that the completion thread saw first; this room's own write is
        its first cause, as the completion thread would have concluded (completion.py)."""
        if failure[1] != PEER_DEAD:
            return failure
        state, reason = r.verdict(self.p.clock())
        if state is not WriteState.FAILED:
            return failure
        timed_out = any(w.handle.state() is WriteState.RUNNING for w in r.writes)
        return reason, TIMEOUT if timed_out else PEER_DEAD

    @staticmethod
    def _sessions_open(peer, batch) -> bool:
        """Every (local, remote) region pair of `batch` was opened (`_open_sessions`): posting it
        dials nothing. Read without the peer's session lock: a pair only ever joins the set."""
        opened = peer.open_pairs
        if batch.sessions_key is not None and ("columns", batch.sessions_key) in opened:
            return True
        return all((local.id, remote.id) in opened for local, remote in zip(batch.local, batch.remote))

    def _open_sessions(self, peer, batch) -> Optional[str]:
        """First contact with every (local, remote) region pair of a write before it is posted;
        None when they are all open.

        The engine opens a pair's session (dial, QPs, remote memory lookup) inside `batch_write`
        when it meets the pair there, and that can raise after earlier pairs of the same call were
        posted: those writes are then in flight with no status to wait on, and their room could
        never prove it drained. Opening the pairs here means a dead or broken peer fails the write
        before a single byte is posted. A batch over the planner's cached descriptor columns is
        checked once per peer (its `sessions_key`), not pair by pair on every chunk.
        """
        opened = peer.open_pairs
        batch_key = ("columns", batch.sessions_key) if batch.sessions_key is not None else None
        if batch_key is not None and batch_key in opened:
            return None
        missing = [(local, remote) for local, remote in zip(batch.local, batch.remote)
                   if (local.id, remote.id) not in opened]
        p = self.p
        if missing:
            with peer.session_lock:
                for local, remote in missing:
                    key = (local.id, remote.id)
                    if key in opened:
                        continue
                    try:
                        p.engine.connect(local, remote)
                    except Exception as exc:
                        reason = f"cannot reach decode engine {peer.engine_key}: {exc}"
                        if p.peers.mark_failed(peer.engine_key, reason):
                            p.metrics.peer_down(peer.engine_key)
                        return reason
                    opened.add(key)
        if batch_key is not None:
            opened.add(batch_key)
        return None

    def post(self, chunk: Chunk, targets, writes: List[TrackedWrite], life=None, defer_held: bool = False,
             announce: Optional[list] = None, inline: bool = False):
        """Post the chunk to every destination, appending each issued write to `writes`;
        (reason, label) of the first failure, None, or DEFERRED (`defer_held`: the first write
        would be held, and nothing was posted). The caller holds a submit token on the room and
        tracks `writes` afterwards, whatever this returns or raises. A write the peer's budget
        holds is dropped, never posted, once room life `life` concludes meanwhile. `announce`
        (`[chunk.announce]`, the caller's): a last chunk's TransferStarted is left due in it when
        the chunk was posted or failed without waiting (the caller holds it back, announce.py)."""
        # Every chunk restarts decode's deadline (TransferStarted): a long chunked prefill is slow,
        # not dead. Announced once the writes are posted, so that the copies start one message
        # sooner (issue 28: the link's latency), unless something may wait first (the forward's
        # event, a write held for its peer's budget): then before that wait, as decode's deadline
        # must restart where prefill's own starts. Before `post` returns, so before any Success or
        # failure of the room (both come after `end_submit`), except a last chunk's that nothing
        # held up: the caller sends that one only if the room is still open after a grace (issue
        # 28: one message per request to decode when the writes finish quickly).
        if announce is None:
            announce = [chunk.announce]
        if chunk.wait_event is not None:
            self._announce(chunk, targets, announce)
            chunk.wait_event.synchronize()  # source KV is ready only after the forward pass
        outcome = _RAISED
        try:
            outcome = self._post_targets(chunk, targets, writes, life, defer_held, announce, inline)
            return outcome
        finally:
            lazy = chunk.is_last and self.announcer.enabled and outcome is not _RAISED and outcome is not DEFERRED
            if not lazy and outcome is not HAND_OFF:  # a handed-over chunk is announced by its shard
                self._announce(chunk, targets, announce, block=not inline)

    def _announce(self, chunk: Chunk, targets, pending: list, block: bool = True) -> None:
        """TransferStarted to each destination of `chunk`, once (`pending[0]` says if still due).
        `block` False on a thread that must not wait (an inline post): a full queue drops it."""
        if not pending[0]:
            return
        pending[0] = False
        p = self.p
        for t in targets:  # each destination under its own attempt
            p.messenger.send(t.address, protocol.TransferStarted(room=chunk.room, attempt=t.attempt,
                                                                 prefill_rank=p.sglang.prefill_rank), block=block)

    def _post_targets(self, chunk: Chunk, targets, writes: List[TrackedWrite], life, defer_held: bool,
                      announce: list, inline: bool = False):
        p = self.p
        deadline = p.clock() + p.timeout_s
        ended = self._ended(life)
        for t in targets:
            reason = p.peers.unusable_reason(t.engine_key)
            if reason:
                return reason, PEER_DEAD
            peer = p.peers.get(t.engine_key)
            try:
                batch = p.planner.write_batch(peer, chunk, t)
            except PlanningError as exc:
                return f"room {chunk.room}: {exc}", BAD_INDEX
            if inline and not writes and len(batch) and not self._sessions_open(peer, batch):
                return HAND_OFF  # opening one dials the peer: its shard does that
            failure = self._open_sessions(peer, batch) if len(batch) else None
            if failure is not None:
                return failure, PEER_DEAD
            if self.effects.try_slot(peer.engine_key, batch.nbytes):
                admission = Admission.ADMITTED
            elif inline and not writes:
                return HAND_OFF  # the budget would hold it: its shard waits, not this thread
            elif defer_held and not writes:
                return DEFERRED
            else:  # held: decode hears the chunk started before the wait
                self._announce(chunk, targets, announce)
                admission = self.effects.take_slot(peer.engine_key, deadline, batch.nbytes, ended)
            if admission.held:
                p.metrics.writes_held(batch.nbytes)
                if not admission:
                    # Never posted: no byte of it can land, nothing of it to wait for.
                    p.metrics.writes_dropped(batch.nbytes)
                    if admission is Admission.ABANDONED:
                        logger.info("sglang-mori: room %s: %d bytes held for decode engine %s dropped unsent (the "
                                    "room ended while they waited)", chunk.room, batch.nbytes, peer.engine_key)
                    return self._not_admitted(peer.engine_key, admission)
            try:
                handle = p.engine.write(peer.engine_key, batch, deadline=deadline, retry_max=p.config.submit_retry_max)
            except SubmitError as exc:
                # Track what was issued: it must drain (or be given up on) like any write.
                p.metrics.transfer_started(peer.engine_key)
                writes.append(TrackedWrite(exc.handle, deadline))
                return f"submitting KV writes to {peer.engine_key} failed: {exc}", SUBMIT_ERROR
            except BaseException:
                # No handle tracks this slot: give it back before the shard fails the room.
                self.effects.return_unused_slot(peer.engine_key, batch.nbytes)
                raise
            # Count the start before the handle is visible: the completion thread may finish it at once.
            p.metrics.transfer_started(peer.engine_key)
            for _ in range(handle.retries):
                p.metrics.retry(SUBMIT_ERROR)
            writes.append(TrackedWrite(handle, deadline))
        return None

    def _ended(self, life):
        """What a held write asks of its room while it waits: has its life (or this service) ended?"""
        stopped = self.stopped
        if life is None:
            return stopped.is_set
        return lambda: life.concluded or stopped.is_set()

    def _not_admitted(self, peer_key: str, admission):
        """(reason, label) for a write the peer's budget held and never let through. A dropped
        write's room concluded already, so this reason is recorded nowhere (the first cause wins)."""
        budget = self.p.peers.budget
        if admission is Admission.ABANDONED:
            return (f"room ended while its writes to decode engine {peer_key} were held "
                    "(SGLANG_MORI_MAX_INFLIGHT_BYTES_PER_PEER); dropped unsent", ABORTED)
        return (f"decode engine {peer_key} has {budget.count(peer_key)} transfers "
                f"({budget.posted_bytes(peer_key)} bytes) in flight and none finished before the deadline "
                "(SGLANG_MORI_MAX_INFLIGHT_PER_PEER, SGLANG_MORI_MAX_INFLIGHT_BYTES_PER_PEER)", TIMEOUT)
