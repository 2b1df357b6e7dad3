"""Optimistic requests of a layer-wise batch: joining the stream when decode's destinations arrive.

SGLang's optimistic prefill (`--optimistic-prefill-attempts`) runs a request whose decode has not
sent its destinations yet (`req.pending_bootstrap`). `begin_batch` publishes such a request as
waiting (`LateRoom`, its source pages read before the forward). It joins the batch's streams once
its room is READY *and* SGLang's status reads WaitingForInput (`LateJoins.try_join`):

- at a layer hook (the scheduler thread, while it launches the forward): a catch-up of the groups
  already handed to the worker, then the open group and the later ones with every other stream;
- after the hooks, for a pass that completes its request's input: when the thread that publishes
  the destinations to SGLang (the control thread, or the scheduler's poll draining our socket) has
  done so (`published`), up to SGLang's `send()` for the room (`closed_by_send`). On a GPU the
  hooks run while the scheduler *launches* the forward, a few ms before the device runs it, so
  destinations arriving during the device's forward can only join here. Each fired group is
  caught up against the device event it was posted with (its layers may still be running); after
  the batch's end the join also records the coverage `send()` reads and posts its own end marker.

A pass that does not complete its request stops waiting at the batch's end: SGLang may release
and requeue a chunked request still pending after its middle chunk (`optimistic_release_and_requeue`
does not look at the status then), so its pages are only safe while the forward's hooks run.
SGLang's requeue of a parked request (its poll read Bootstrapping, possibly just before the
destinations were published) goes through hooks.around_requeue: the pass stops waiting
(`requeued`) and writes a join already posted become a hazard for the next forward (session.py).

Threads: the scheduler (hooks, end_batch, send()) and the publishing thread both reach a waiting
request; every change to a batch with waiting requests (its streams, groups, waiting list) and to
the rooms waiting here happens under `lock`, taken before the registry lock and never held across
an engine call (posting only queues work for the layer-wise worker). A batch whose waiting list is
empty costs no lock: the list only shrinks, and it shrinks last under the lock.

A request that never joins is counted once as the `pending_bootstrap` fallback, where that becomes
known: at the batch's end (a pass that does not complete its request, or a forward that handed no
layer off), at `send()`, at SGLang's requeue, when a later pass of the request replaces it, or
when its room concluded.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Dict, List, Optional

import numpy as np

from sglang_mori.backend import room_status
from sglang_mori.backend.prefill.layerwise.ranges import source_pages, stream_range
from sglang_mori.backend.prefill.layerwise.worker import LayerBatch, RoomStream
from sglang_mori.backend.prefill.rooms import Phase, PrefillRoom, decode_prefix_len

TAKES_WRITES = (Phase.READY, Phase.SUBMITTING)
PENDING = "pending_bootstrap"


@dataclass(eq=False)
class LateRoom:
    """A request of a published batch whose destinations were not known when the forward began."""

    view: object  # session.ReqView
    life: PrefillRoom
    page_size: int
    tok_lo: int  # the first token of `src_pages`: the widest range the forward may stream
    src_pages: np.ndarray  # read before the forward (on a GPU a device read mid-forward would sync)
    batch: Optional[LayerBatch] = None

    @property
    def completes_input(self) -> bool:
        """This pass computes the request's last tokens: SGLang parks it (pages held) until its
        status reads WaitingForInput, then calls send() for it."""
        rq = self.view
        return rq.prefix_len + rq.extend_len >= rq.input_len


class LateJoins:
    def __init__(self, session):
        self.s = session
        self.p = session.p
        self.lock = threading.Lock()
        self.rooms: Dict[int, LateRoom] = {}  # room id -> its waiting pass (lock)

    # --- publication (scheduler thread) ---------------------------------------------------------
    def await_destinations(self, rq, page_size: int, waiting: List[LateRoom]) -> Optional[str]:
        """An optimistic request of a batch being published: waiting, or the fallback reason."""
        if not self.s.late_join:
            return PENDING
        if rq.extend_len < self.s.min_tokens:
            return "below_min_tokens"
        with self.p.rooms.lock:
            life = self.p.rooms.get(rq.room)
            if life is None or not life.claimed or life.concluded:
                return PENDING
        # Decode's prefix is not known yet: the pages of the widest range it leaves to stream.
        rng = stream_range(prefix_len=rq.prefix_len, extend_len=rq.extend_len, input_len=rq.input_len,
                           page_size=page_size, decode_prefix_len=0, already_sent=0)
        if rng is None:
            return None  # no whole page completes in this pass: nothing to stream either way
        waiting.append(LateRoom(rq, life, page_size, rng.tok_lo, source_pages(rq.row, rng.tok_lo, rng.tok_hi,
                                                                                page_size)))
        return None

    def forget_concluded(self) -> None:
        """Before each batch: rooms that concluded while waiting (decode aborted, a timeout) stop."""
        with self.lock:
            for late in list(self.rooms.values()):
                if late.life.concluded:
                    self._close(late, PENDING)

    def register(self, batch: LayerBatch) -> None:
        """The batch's waiting requests become reachable by room id; a room's earlier pass still
        waiting (SGLang requeued the request and runs it again) stops waiting."""
        with self.lock:
            for late in batch.waiting:
                late.batch = batch
                old = self.rooms.get(late.view.room)
                if old is not None:
                    self._close(old, PENDING)
                self.rooms[late.view.room] = late

    # --- joining ---------------------------------------------------------------------------------
    def at_hook(self, batch: LayerBatch) -> None:
        """A layer hook of a batch with waiting requests (lock held by the caller)."""
        for late in list(batch.waiting):
            self._settle(late, self.try_join(late))

    def at_end(self, batch: LayerBatch, covered: frozenset) -> None:
        """end_batch, lock held, after its last look (`at_hook`) and the last group: a pass that
        completes its request keeps waiting (if any layer was handed off); any other stops."""
        batch.ended = True
        batch.covered = covered
        for late in list(batch.waiting):
            if not (late.completes_input and batch.groups):
                self._close(late, PENDING)

    def abandon(self, batch: LayerBatch) -> None:
        """end_batch failed before `at_end` (lock held): its waiting requests go chunk-wise."""
        batch.ended = True
        for late in list(batch.waiting):
            self._close(late, PENDING)

    def published(self, room: int) -> None:
        """The room's destinations were just published to SGLang (WaitingForInput), on the
        publishing thread, after the registry lock was let go."""
        if not self.rooms:
            return
        with self.lock:
            late = self.rooms.get(room)
            if late is not None:
                self._settle(late, self.try_join(late))

    def closed_by_send(self, room: int) -> None:
        """SGLang's send() for the room: what it moves is read from the coverage now, so a pass
        still waiting goes chunk-wise and nothing is posted for it later."""
        self._stop_waiting(room)

    def requeued(self, room: int) -> None:
        """SGLang releases the request's pages and requeues it: a pass still waiting never joins
        (a join in progress holds the lock, so it has finished: session.requeued sees its writes)."""
        self._stop_waiting(room)

    def _stop_waiting(self, room: int) -> None:
        """A pass of `room` still waiting never joins: counted as a pending-bootstrap fallback."""
        if not self.rooms:
            return
        with self.lock:
            late = self.rooms.get(room)
            if late is not None:
                self._close(late, PENDING)

    def _settle(self, late: LateRoom, outcome: Optional[str]) -> None:
        if outcome is not None:  # None: not yet
            self._close(late, outcome)

    def _close(self, late: LateRoom, reason: str) -> None:
        """It stops waiting (joined: reason ""); counted as `reason` otherwise."""
        if self.rooms.get(late.view.room) is late:
            del self.rooms[late.view.room]
        batch = late.batch
        if batch is not None and late in batch.waiting:
            batch.waiting = [w for w in batch.waiting if w is not late]  # shrinks last (lock-free readers)
        if reason:
            self.p.metrics.layerwise_fallback(reason)

    def try_join(self, late: LateRoom) -> Optional[str]:
        """Lock held. None: not yet; "": joined, or nothing left to stream; else the fallback
        reason (the request goes chunk-wise)."""
        p, life, rq, batch = self.p, late.life, late.view, late.batch
        # SUBMITTING: an earlier pass of this request joined (SGLang finalizes it at its next
        # poll, so a later pass is rarely still pending; it may be if a batch was built first).
        if life.phase not in TAKES_WRITES:  # read unlocked: the usual answer while decode's message travels
            return PENDING if life.concluded else None
        if p.sglang.status(rq.room) != room_status.WAITING_FOR_INPUT:
            return None  # SGLang cannot see the destinations yet (published right after READY)
        page_size = late.page_size
        with p.rooms.lock:
            if life.phase not in TAKES_WRITES or not life.claimed:
                return None
            if any(t.reject_reason for t in life.targets.values()):
                return "not_ready"  # a destination this rank refused: the room fails, nothing streams
            refusal = next(filter(None, map(p.planner.stream_refusal, life.targets)), None)
            if refusal:
                return refusal
            prefix = decode_prefix_len(life.targets.values())  # what finalize_bootstrap will read
            if prefix % page_size:
                return "unaligned_prefix"
            record = self.s.record_of(life)
            sent = max(record.streamed_until, prefix)
        rng = stream_range(prefix_len=rq.prefix_len, extend_len=rq.extend_len, input_len=rq.input_len,
                           page_size=page_size, decode_prefix_len=prefix, already_sent=sent)
        if rng is None:
            return ""  # decode holds every page this pass completes
        src = late.src_pages[(rng.tok_lo - late.tok_lo) // page_size:(rng.tok_hi - late.tok_lo) // page_size]
        stream = RoomStream(rq.room, life, rng, src)
        with self.s.effects.transition() as fx:
            # The batch token, without Transferring: SGLang polls this request until finalize_bootstrap.
            if life.concluded or not p.rooms.begin_submit(life, fx, transferring=False):
                return None
            record.streamed_until = rng.tok_hi
            record.pending_batches += 1
            if batch.ended:  # send() reads this coverage: recorded with the token, under the same lock
                self.s.add_coverage(stream, batch.covered)
        worker = self.s.worker
        for buffers, event in catch_up(batch.groups):
            worker.post_group(batch, buffers, event, streams=(stream,))
        if batch.ended:
            worker.post_end(batch, streams=(stream,))
            p.metrics.layerwise_late_after_hooks()
        else:
            batch.streams = batch.streams + [stream]  # a new list: queued groups keep the streams they had
        p.metrics.layerwise_late_destinations()
        return ""


def catch_up(groups):
    """The fired groups as catch-up writes, each against the device event it was posted with, so
    an early group does not wait for a later layer. Merged where waiting buys nothing: the groups
    up to the last one whose event has completed already go in one write (events are recorded in
    order on one stream, so every earlier one has completed too), and consecutive groups with the
    same event (on CPU every event is None: the forward is synchronous) go in one write."""
    groups = list(groups)
    done = 0
    for i, (_, event) in enumerate(groups):
        if not _completed(event):
            break
        done = i + 1
    out = []
    if done:
        out.append((frozenset().union(*(buffers for buffers, _ in groups[:done])), groups[done - 1][1]))
    for buffers, event in groups[done:]:
        if out and out[-1][1] is event:
            out[-1] = (out[-1][0] | buffers, event)
        else:
            out.append((buffers, event))
    return out


def _completed(event) -> bool:
    """None (CPU), or a device event whose work is done (a non-blocking query)."""
    if event is None:
        return True
    query = getattr(event, "query", None)
    return bool(query()) if query is not None else False
