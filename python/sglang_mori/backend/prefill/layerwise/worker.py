"""The layer-wise worker thread: posts each layer group of a published batch as the forward
produces it.

A published batch (`LayerBatch`) holds one `RoomStream` per room that streams in it. When the
session publishes it, each stream's room took one submit token (`PrefillRoom.begin_submit`), so
the room counts writes outstanding and cannot conclude Success until the worker has tracked every
write of the batch; the worker gives the token back when it processes the batch's end. A stream
that joins after the batch's end (an optimistic request, late.py) brings its own end marker,
queued after its catch-up groups.

Per layer group and stream the worker does what the chunk submitter does for a chunk, on the same
parts: `rooms.begin_submit` in a transition (skipped when the room concluded meanwhile), then the
submitter's public posting step `ChunkSubmitter.post_tracked` (peer checks, in-flight budget,
engine session, deadline, metrics, TransferStarted, `end_submit` with the tracked handles, and the
failure door on error). A group handed to the worker is therefore either written or its room failed,
which is what lets `send()` skip it (session.py).
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Dict, FrozenSet, List, Optional, Tuple

import numpy as np

from sglang_mori.backend.prefill.failures import OTHER
from sglang_mori.backend.prefill.layerwise.planner import LayerChunk
from sglang_mori.backend.prefill.layerwise.ranges import StreamRange
from sglang_mori.backend.prefill.rooms import PrefillRoom

logger = logging.getLogger(__name__)

MAX_QUEUED_ITEMS = 65536


@dataclass(eq=False)
class RoomStream:
    """One room's pages in one published batch."""

    room: int
    life: PrefillRoom
    rng: StreamRange
    src_pages: np.ndarray
    plans: Dict[str, object] = field(default_factory=dict)  # peer engine key -> full TransferPlan
    announced: bool = False  # TransferStarted sent for this batch (with its first group)

    @property
    def dst_slice(self) -> slice:
        return self.rng.dst_slice


@dataclass(eq=False)
class LayerBatch:
    serial: int
    streams: List[RoomStream]
    group_size: int
    fired: List[int] = field(default_factory=list)  # KV buffers handed to the worker, in order
    # (buffers, device event) of each group handed to the worker, in order: a request joining
    # late catches up each group against the event it was posted with (None on CPU)
    groups: List[Tuple[FrozenSet[int], object]] = field(default_factory=list)
    pending: List[int] = field(default_factory=list)  # buffers of the group being collected
    pending_layers: int = 0
    seen_layers: set = field(default_factory=set)
    excluded: set = field(default_factory=set)  # buffers not counted as streamed (a layer ran twice)
    # Requests SGLang runs before their destinations are known (optimistic prefill), each a
    # `late.LateRoom`: they join the stream when their room turns READY, at a layer hook or,
    # for a pass that completes its request, up to its send() (session.py). While this list is
    # not empty, the batch's streams, groups and waiting list change only under the session's
    # late lock; once it is empty no other thread touches them.
    waiting: list = field(default_factory=list)
    ended: bool = False  # end_batch ran: no further group is fired, late joins bring their own end
    covered: frozenset = frozenset()  # buffers streamed in full (set by end_batch)
    stopped: Optional[str] = None  # fallback reason: no further layers are streamed
    event: object = None  # device event of the last layer seen (GPU); None on CPU
    pool: object = None  # the scheduler's KV pool (for backends that do not name theirs)
    done: threading.Event = field(default_factory=threading.Event)


class LayerWorker:
    def __init__(self, parts, effects, failures, submitter):
        self.p = parts
        self.effects = effects
        self.failures = failures
        self.submitter = submitter  # its post_tracked() is the posting step, shared with chunks
        self.queue: "queue.Queue" = queue.Queue(maxsize=MAX_QUEUED_ITEMS)
        self.stopped = threading.Event()
        self.thread: Optional[threading.Thread] = None

    def start(self) -> None:
        self.thread = threading.Thread(target=self.run, name="mori-layerwise", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.stopped.set()
        try:
            self.queue.put_nowait(None)
        except queue.Full:
            pass
        if self.thread is not None:
            self.thread.join(timeout=3)

    # --- scheduler side -------------------------------------------------------------------------
    def post_group(self, batch: LayerBatch, buffers: FrozenSet[int], event, streams=None) -> None:
        """Write `buffers` for `streams` (default: the batch's streams now; a stream that joins
        later gets its catch-up by a post of its own, never this group a second time)."""
        self.queue.put(("group", batch, buffers, event, tuple(batch.streams if streams is None else streams)))

    def post_end(self, batch: LayerBatch, streams=None) -> None:
        """The batch's end (its streams, which no longer change: a stream joining after this
        brings its own; the batch counts as done), or, with `streams`, the end of streams that
        joined after the batch's end: each gives back its batch token once the writes posted
        before this item are tracked."""
        if streams is None:
            self.queue.put(("end", batch, None, None, ()))
        else:
            self.queue.put(("late_end", batch, None, None, tuple(streams)))

    # --- the thread ---------------------------------------------------------------------------
    def run(self) -> None:
        while not self.stopped.is_set():
            item = self.queue.get()
            if item is None:
                return
            kind, batch, buffers, event, streams = item
            if kind == "end":
                self._end(batch)
                continue
            if kind == "late_end":
                self._give_back(streams)
                continue
            for stream in streams:
                try:
                    self.submit(stream, buffers, event)
                except Exception as exc:  # a bug fails one room, never the thread
                    logger.exception("sglang-mori: layer-wise write of room %s failed", stream.room)
                    self.failures.fail_life(stream.life, f"internal error while streaming KV: {exc!r}", OTHER)

    def submit(self, stream: RoomStream, buffers: FrozenSet[int], event) -> int:
        """Post one layer group of one stream; the number of writes tracked."""
        p = self.p
        life = stream.life
        with self.effects.transition() as fx:
            if life.concluded or not p.rooms.begin_submit(life, fx):
                return 0
            targets = life.live_targets()
        chunk = LayerChunk(room=stream.room, kv_indices=stream.src_pages, index_slice=stream.dst_slice,
                           is_last=False, aux_index=None, state_indices=None, wait_event=event,
                           stream=stream, buffers=buffers, announce=not stream.announced)
        stream.announced = True
        tracked = self.submitter.post_tracked(chunk, life, targets)
        p.metrics.layerwise_writes(tracked)
        return tracked

    def _end(self, batch: LayerBatch) -> None:
        """The batch's end: each stream's batch token goes back; the batch is done."""
        self._give_back(batch.streams)
        batch.done.set()

    def _give_back(self, streams) -> None:
        """Give back each stream's batch token: its writes are all tracked now."""
        p = self.p
        with self.effects.transition() as fx:
            for stream in streams:
                p.rooms.end_submit(stream.life, [], False, None, fx)
                p.rooms.batch_ended(stream.life)
        for stream in streams:
            if stream.life.last_submitted:  # the last chunk came first: this token was what it waited for
                self.submitter.success.try_succeed(stream.life)
