"""The layer-wise session of one prefill rank: publishes batches, collects layers, filters `send()`.

Driven by the scheduler thread through hooks.py (and directly by tests, with plain views):

- `begin_batch(view)` before an extend batch runs: for each request of ours past bootstrap whose
  room takes writes, the full pages this pass completes (ranges.py), their source pages, and one
  submit token on the room (`begin_submit` under `parts.rooms.lock`); returns the `LayerBatch`
  or None (the batch goes chunk-wise; the reason is counted);
- `on_layer(batch, pool, layer_id, event)` after each attention layer: maps the layer to its
  registered buffers (mapping.py) and hands every `group_size` layers to the worker; a request
  that began the forward still waiting for decode's destinations (SGLang's optimistic prefill,
  `pending_bootstrap`) joins once its room is READY and SGLang's status WaitingForInput, at a
  hook or, after the hooks, when the destinations are published, up to its `send()` (late.py;
  nothing to check while no request waits);
- `end_batch(batch)` after the forward: the last group, the coverage of each stream (exactly the
  layers handed to the worker), and the batch's end marker (the worker gives the tokens back);
- `add_chunk(...)` for SGLang's `send()`: submits only what was not streamed;
- `after_checkpoint(room, row)` / `wait_hazards()`: a radix checkpoint that moved a streamed page
  (its old page is freed) while a write from it may still run blocks the next forward (the only
  thing that could rewrite the page) until that write is terminal.

What streaming learns about a room (its coverage, how far it streamed, its batches in flight) is
the room life's own (`PrefillRoom.layerwise`, a `RoomRecord`), and the rank's checkpoint hazards
are the registry's (`rooms.hazards`): both change only under the registry lock, and a new life of
the room id starts with none.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from sglang_mori.backend.prefill.failures import CHECKPOINT_HAZARD_TIMEOUT, TIMEOUT
from sglang_mori.backend.prefill.layerwise.late import TAKES_WRITES, LateJoins
from sglang_mori.backend.prefill.layerwise.mapping import LayerBufferMap
from sglang_mori.backend.prefill.layerwise.planner import selected_chunk
from sglang_mori.backend.prefill.layerwise.ranges import Coverage, source_pages, stream_range
from sglang_mori.backend.prefill.layerwise.worker import LayerBatch, LayerWorker, RoomStream
from sglang_mori.backend.prefill.rooms import PrefillRoom

logger = logging.getLogger(__name__)


def group_ends(layers: int) -> frozenset:
    """Halving groups: after how many layers of a forward a group is written. The first group is
    a quarter of the layers (the link starts early enough to carry the rest while the forward
    runs), then each group is half of the layers still to come and the last layer is alone: a
    forward costs the worker about log2(layers) + 2 writes per room (not one per layer) and what
    remains to send after the forward is one layer's KV. 61 layers: 15, 23, 11, 6, 3, 1, 1, 1."""
    ends, done, left = set(), 0, max(1, int(layers))
    while left > 1:
        take = max(1, left // 4 if done == 0 else left // 2)
        done += take
        left -= take
        ends.add(done)
    ends.add(done + left)
    return frozenset(ends)


@dataclass
class ReqView:
    """What the session needs of one request of an extend batch (hooks.py reads SGLang's Req)."""

    room: int
    prefix_len: int
    extend_len: int
    input_len: int
    decode_prefix_len: int
    start_send_idx: int
    row: object  # the request's req_to_token row (token slots), sliceable
    pending_bootstrap: bool = False


@dataclass
class BatchView:
    reqs: List[ReqView]
    page_size: int
    fallback: Optional[str] = None  # a batch-level reason to go chunk-wise


@dataclass(eq=False)
class RoomRecord:
    """A room life's layer-wise state (`PrefillRoom.layerwise`; registry lock)."""

    life: PrefillRoom
    coverage: Coverage = field(default_factory=Coverage)
    streamed_until: int = 0
    pending_batches: int = 0

    def busy(self) -> bool:
        """A write from this life's pages may still run (or be posted)."""
        return bool(self.life.unfinished()) or self.life.submitting > 0 or self.pending_batches > 0


class LayerwiseSession:
    def __init__(self, parts, service, buffer_map: LayerBufferMap, *, group_size: int, min_tokens: int,
                 min_batch_tokens: int = 0, late_join: bool = True):
        self.p = parts
        self.service = service
        self.map = buffer_map
        # 0: halving groups (group_ends); n >= 1: a write every n layers
        self.group_size = max(0, int(group_size))
        self.group_ends = group_ends(buffer_map.layers) if self.group_size == 0 else frozenset()
        self.min_tokens = max(0, int(min_tokens))
        self.min_batch_tokens = max(0, int(min_batch_tokens))
        # Optimistic requests may join mid-forward only where this rank alone answers SGLang's
        # bootstrap poll (attention TP 1): with more ranks SGLang polls their minimum, so a rank
        # that streamed could see its request released and requeued (its pages freed) because
        # another rank still waits for its destinations (assembly.py).
        self.late_join = bool(late_join)
        self.effects = service.effects
        self.worker = LayerWorker(parts, service.effects, service.failures, service.submitter)
        self._serial = 0
        self.late = LateJoins(self)
        # The thread that publishes a room's destinations to SGLang tells us (late.py).
        service.effects.on_published = self.late.published

    def start(self) -> None:
        self.worker.start()

    def stop(self) -> None:
        self.worker.stop()

    # --- introspection (tests, debugging) -----------------------------------------------------
    @property
    def records(self) -> Dict[int, RoomRecord]:
        """The layer-wise state of each current room life that streamed."""
        with self.p.rooms.lock:
            return {rid: r.layerwise for rid, r in self.p.rooms.rooms.items() if r.layerwise is not None}

    @property
    def hazards(self) -> List[RoomRecord]:
        with self.p.rooms.lock:
            return [life.layerwise for life in self.p.rooms.hazards]

    # --- publication ----------------------------------------------------------------------------
    def begin_batch(self, view: BatchView) -> Optional[LayerBatch]:
        metrics = self.p.metrics
        if self.late.rooms:
            self.late.forget_concluded()
        if view.fallback:
            metrics.layerwise_fallback(view.fallback)
            return None
        if self.min_batch_tokens and sum(rq.extend_len for rq in view.reqs) < self.min_batch_tokens:
            # A short forward is launch-bound: the worker's GIL time would delay its launches
            # more than streaming saves (docs/benchmarks.md, GPU rig); send() moves it all.
            metrics.layerwise_fallback("short_batch")
            return None
        streams: List[RoomStream] = []
        waiting: list = []  # late.LateRoom
        try:
            for rq in view.reqs:
                if rq.pending_bootstrap:
                    reason = self.late.await_destinations(rq, view.page_size, waiting)
                else:
                    reason = self._open_stream(rq, view.page_size, streams)
                if reason:
                    metrics.layerwise_fallback(reason)
        except BaseException:
            if streams:  # give the tokens taken so far back (nothing streams; send() moves it all)
                self._serial += 1
                self.end_batch(LayerBatch(self._serial, streams, self.group_size, stopped="other"))
            raise
        if not streams and not waiting:
            return None
        self._serial += 1
        batch = LayerBatch(self._serial, streams, self.group_size, waiting=waiting)
        if waiting:
            self.late.register(batch)
        return batch

    def _open_stream(self, rq: ReqView, page_size: int, streams: List[RoomStream]) -> Optional[str]:
        if rq.extend_len < self.min_tokens:
            return "below_min_tokens"
        if rq.decode_prefix_len % page_size:
            return "unaligned_prefix"
        p = self.p
        with p.rooms.lock:
            life = p.rooms.get(rq.room)
            if (life is None or not life.claimed or life.phase not in TAKES_WRITES
                    or any(t.reject_reason for t in life.targets.values())):
                return "not_ready"
            refusal = next(filter(None, map(p.planner.stream_refusal, life.targets)), None)
            if refusal:
                return refusal  # e.g. a decode with context parallelism: its chunks are relaid out
            record = self.record_of(life)
            sent = max(record.streamed_until, rq.start_send_idx)
        rng = stream_range(prefix_len=rq.prefix_len, extend_len=rq.extend_len, input_len=rq.input_len,
                           page_size=page_size, decode_prefix_len=rq.decode_prefix_len, already_sent=sent)
        if rng is None:
            return None  # no whole page completes in this pass: nothing to stream, nothing to fall back
        src = source_pages(rq.row, rng.tok_lo, rng.tok_hi, page_size)
        with self.effects.transition() as fx:
            # The batch token (worker._end gives it back).
            if life.concluded or not p.rooms.begin_submit(life, fx):
                return "not_ready"
            record.streamed_until = rng.tok_hi
            record.pending_batches += 1
        streams.append(RoomStream(rq.room, life, rng, src))
        return None

    def on_layer(self, batch: LayerBatch, pool, layer_id: int, event=None) -> None:
        if batch.stopped:
            return
        if layer_id in batch.seen_layers:
            # A layer ran twice in one forward: its first hand-off may have been incomplete, so it
            # is not counted as streamed (send() writes it again once the forward ended).
            batch.excluded.update(self.map.buffers_for(pool, layer_id) or ())
            self.stop_batch(batch, "other")
            return
        buffers = self.map.buffers_for(pool, layer_id)
        if buffers is None:
            self.stop_batch(batch, "unmapped_pool")
            return
        batch.seen_layers.add(layer_id)
        if batch.waiting:  # another thread may join a request into this batch (late.py)
            with self.late.lock:
                self.late.at_hook(batch)
                self._collect(batch, buffers, event)
        else:
            self._collect(batch, buffers, event)

    def _collect(self, batch: LayerBatch, buffers, event) -> None:
        batch.pending.extend(buffers)
        batch.pending_layers += 1
        batch.event = event
        if (len(batch.seen_layers) in self.group_ends if batch.group_size == 0
                else batch.pending_layers >= batch.group_size):
            self._flush(batch)

    def stop_batch(self, batch: LayerBatch, reason: str) -> None:
        """No further layers of `batch` are streamed (they go with `send()`); counted as `reason`."""
        batch.stopped = reason
        self.p.metrics.layerwise_fallback(reason)
        logger.debug("sglang-mori: layer-wise batch %d stops streaming: %s", batch.serial, reason)

    def _flush(self, batch: LayerBatch) -> None:
        if not batch.pending:
            return
        group = frozenset(batch.pending)
        batch.fired.extend(batch.pending)
        batch.groups.append((group, batch.event))
        batch.pending = []
        batch.pending_layers = 0
        self.worker.post_group(batch, group, batch.event)

    def end_batch(self, batch: LayerBatch) -> None:
        """After the forward (also when it raised): the last group, the coverage, the end marker."""
        if batch.waiting:
            with self.late.lock:
                self._end(batch, waiting=True)
        else:
            self._end(batch, waiting=False)

    def _end(self, batch: LayerBatch, waiting: bool) -> None:
        try:
            if waiting:  # one more look; a request completing its input may still join after this
                self.late.at_hook(batch)
            self._flush(batch)
            if not batch.fired and not batch.stopped:
                self.p.metrics.layerwise_fallback("no_layer_hook")
            covered = frozenset(batch.fired) - batch.excluded
            if waiting:
                self.late.at_end(batch, covered)
            batch.ended, batch.covered = True, covered
            with self.p.rooms.lock:
                for stream in batch.streams:
                    self.add_coverage(stream, covered)
        finally:
            if waiting and not batch.ended:  # raised before the end was recorded: nobody joins any more
                self.late.abandon(batch)
            self.worker.post_end(batch)

    def add_coverage(self, stream, covered: frozenset) -> None:
        """The stream's layers `send()` skips (registry lock held)."""
        try:
            stream.life.layerwise.coverage.add(stream.rng, covered, stream.src_pages)
        except ValueError:  # not expected; then send() simply writes these pages again
            logger.exception("sglang-mori: room %s: layer-wise coverage", stream.room)

    def record_of(self, life: PrefillRoom) -> RoomRecord:
        """The room life's layer-wise record, made on first use (registry lock held)."""
        if life.layerwise is None:
            life.layerwise = RoomRecord(life)
        return life.layerwise

    # --- SGLang's send() ------------------------------------------------------------------------
    def add_chunk(self, room_id: int, kv_indices, index_slice: slice, is_last: bool, **kw) -> None:
        self.late.closed_by_send(room_id)  # a pass still waiting goes chunk-wise from here (late.py)
        with self.p.rooms.lock:
            current = self.p.rooms.get(room_id)
            record = None if current is None else current.layerwise
            parts = None
            if record is not None and record.coverage.segments:
                parts = record.coverage.remainder(index_slice, self.map.num_buffers)
        if parts is None:
            self.service.add_chunk(room_id, kv_indices, index_slice, is_last, **kw)
            return
        chunk = selected_chunk(room_id, kv_indices, index_slice, is_last, parts, **kw)
        if chunk is None:
            return
        if is_last and getattr(chunk, "writes_nothing", False):
            self.service.track_last_without_writes(chunk)  # no hop: Success may go out from here
        else:
            self.service.submitter.enqueue(chunk)

    # --- radix checkpoints ------------------------------------------------------------------------
    def after_checkpoint(self, room_id: int, row, page_size: int) -> bool:
        """The request's pages may have moved (dedup into the radix tree frees the old ones): a
        streamed page that moved while a write from it may still run is a hazard. True if any."""
        with self.p.rooms.lock:
            life = self.p.rooms.get(room_id)
            record = None if life is None else life.layerwise
            if record is None or not record.coverage.segments:
                return False
            segments = list(record.coverage.segments)
        moved = False
        for seg in segments:
            now = source_pages(row, seg.tok_lo, seg.tok_lo + len(seg.src_pages) * page_size, page_size)
            if len(now) != len(seg.src_pages) or (now != seg.src_pages).any():
                moved = True
                break
        if not moved:
            return False
        with self.p.rooms.lock:
            running = record.busy()
            if running:
                self.p.rooms.add_hazard(record.life)
        return running

    def requeued(self, room_id: int) -> bool:
        """SGLang is about to release an optimistic request's pages and requeue it (it read
        Bootstrapping, possibly just before the destinations were published and a join read those
        pages). A pass still waiting stops; a write that may still read the pages blocks the next
        forward until it is terminal, as after a checkpoint that moved them. True if one may."""
        self.late.requeued(room_id)
        with self.p.rooms.lock:
            life = self.p.rooms.get(room_id)
            record = None if life is None else life.layerwise
            running = record is not None and record.busy()
            if running:
                self.p.rooms.add_hazard(life)
        return running

    def wait_hazards(self) -> None:
        """Before a forward: wait (bounded) until no write reads a page a checkpoint freed."""
        p = self.p
        with p.rooms.lock:
            hazards = p.rooms.take_hazards()
        if not hazards:
            return
        deadline = p.clock() + p.timeout_s
        for life in hazards:
            while True:
                with p.rooms.lock:
                    busy = life.layerwise.busy()
                if not busy:
                    break
                if p.clock() > deadline:
                    self.service.failures.fail_life(life, CHECKPOINT_HAZARD_TIMEOUT, TIMEOUT)
                    break
                time.sleep(0.001)
