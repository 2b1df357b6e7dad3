"""Prefill side: accept decode registrations and room metadata, write KV, report completion.

Threads (all daemon, all stoppable):
- control:   reads the manager's ZMQ socket (Register, RoomMetadata, Abort).
- shard-N:   one per SGLANG_MORI_TRANSFER_SHARDS; plans and submits chunks. A room always maps to
             the same shard, so its chunks are submitted in order.
- completion: watches every submitted write, enforces deadlines, concludes rooms, drains them
             and sends abort ACKs only once nothing can still land.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np
import zmq
from sglang.srt.disaggregation.base.conn import KVPoll

from sglang_mori import protocol
from sglang_mori.backend.peers import DecodePeer, PeerRegistry
from sglang_mori.backend.prefill_completion import CompletionMixin
from sglang_mori.backend.room_tracker import RoomTracker
from sglang_mori.engine.transfer_engine import (
    SubmitError,
)
from sglang_mori.planning import PlanningError

logger = logging.getLogger(__name__)

# Replayed metadata for a finished room is rejected for this long after the room finished.
FINISHED_ROOMS_TTL_S = 300.0
FINISHED_ROOMS_MAX = 100_000
UNCLAIMED_PRUNE_INTERVAL_S = 1.0
# A decode peer whose connection broke (MORI does not rebuild it) and that sent nothing since is
# forgotten after this long; at least 10 fail-fast windows.
DEAD_PEER_RETENTION_S = 120.0


@dataclass
class RoomTarget:
    """One decode rank's destination for one room (from RoomMetadata).

    `endpoint` (ip) and `dst_port` are the names SGLang's common code reads to notify a room's
    decode ranks (CommonKVManager._room_notify_targets).
    """

    engine_key: str
    endpoint: str
    dst_port: int
    kv_indices: np.ndarray
    aux_index: Optional[int]
    state_indices: Optional[list]
    required_dst_info_num: int
    decode_prefix_len: Optional[int]
    is_dummy: bool
    reject_reason: Optional[str] = None


@dataclass
class Chunk:
    room: int
    kv_indices: np.ndarray
    index_slice: slice
    is_last: bool
    aux_index: Optional[int]
    state_indices: Optional[list]
    wait_event: object = None


class PrefillService(CompletionMixin):
    def __init__(self, mgr):
        self.mgr = mgr
        self.cfg = mgr.mori_config
        self.peers = PeerRegistry(self.cfg.peer_fail_fast_s)
        self.tracker = RoomTracker()
        self.timeout_s = self.cfg.transfer_timeout_ms / 1000.0
        self.queues = [queue.Queue(maxsize=self.cfg.max_queued_chunks) for _ in range(self.cfg.transfer_shards)]
        self.threads: list = []
        self._inflight_lock = threading.Condition()
        self._meta_lock = threading.Lock()
        # Count and publish the queue depth as one step: shards and the scheduler update it at once.
        self._depth_lock = threading.Lock()
        # Rooms whose sender finished here lately (room -> time): metadata naming one of them is a
        # replay, never the start of a request (see _on_metadata). Bounded in count and age.
        self._finished_rooms: "collections.OrderedDict[int, float]" = collections.OrderedDict()
        # Rooms decode aborted before their sender existed here (room -> time): the sender fails
        # as soon as it starts instead of waiting out the bootstrap timeout for metadata.
        self._early_aborts: "collections.OrderedDict[int, float]" = collections.OrderedDict()
        # Rooms that decode's messages created here before any sender claimed them (room -> first
        # message): dropped if no request claims them within the bootstrap timeout (_prune_unclaimed).
        self._unclaimed: "collections.OrderedDict[int, float]" = collections.OrderedDict()
        self._next_prune = 0.0
        # One lock per shard, taken by that shard while it checks and submits a room's chunk, and by
        # the control thread while it handles that room's Abort: an ACK can then never slip in
        # between "room is still live" and "its writes are tracked".
        self.room_locks = [threading.Lock() for _ in self.queues]

    # --- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        self._spawn("mori-control", self._control_loop)
        for i, q in enumerate(self.queues):
            self._spawn(f"mori-shard-{i}", self._shard_loop, q)
        self._spawn("mori-completion", self._completion_loop)

    def _spawn(self, name, target, *args) -> None:
        t = threading.Thread(target=target, args=args, name=name, daemon=True)
        t.start()
        self.threads.append(t)

    def stop(self) -> None:
        for q in self.queues:
            try:
                q.put_nowait(None)
            except queue.Full:
                pass
        self.tracker.notify()
        for t in self.threads:
            t.join(timeout=3)

    # --- control socket -----------------------------------------------------------------
    def _control_loop(self) -> None:
        sock = self.mgr.server_socket
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        while not self.mgr._stopped:
            try:
                now = time.monotonic()
                if now >= self._next_prune:
                    self._next_prune = now + UNCLAIMED_PRUNE_INTERVAL_S
                    self._prune_unclaimed(now)
                    self._prune_dead_peers()
                if not poller.poll(200):
                    continue
                frames = sock.recv_multipart()
            except zmq.ZMQError:
                if self.mgr._stopped:
                    return
                logger.exception("sglang-mori: control socket error")
                continue
            try:
                self._dispatch(frames)
            except Exception:  # a bug must not stop the control thread
                logger.exception("sglang-mori: control message handling failed")

    def _dispatch(self, frames) -> None:
        try:
            message = protocol.decode(frames)
        except protocol.ProtocolError as err:
            self.mgr.reject_message(err, "prefill control socket")
            if err.reason == protocol.REJECT_VERSION and err.room is not None:
                self.mgr.fail_room(err.room, f"decode speaks another protocol: {err.detail}", "protocol", before_sender=True)
                self._note_unclaimed(err.room)
            return
        if isinstance(message, protocol.Register):
            self._on_register(message)
        elif isinstance(message, protocol.RoomMetadata):
            self._on_metadata(message)
        elif isinstance(message, protocol.Abort):
            self._on_abort(message)
        else:
            self.mgr.reject_message(
                protocol.ProtocolError(protocol.REJECT_MALFORMED, f"{type(message).__name__} sent to prefill"),
                "prefill control socket",
            )

    def _on_register(self, msg: protocol.Register) -> None:
        mgr = self.mgr
        try:
            key = mgr.engine.add_peer(msg.engine_desc)
            kv = [mgr.engine.unpack_memory(b) for b in msg.kv_descs]
            aux = [mgr.engine.unpack_memory(b) for b in msg.aux_descs]
            state = [[mgr.engine.unpack_memory(b) if b else None for b in comp] for comp in msg.state_descs]
        except Exception as exc:
            self.mgr.reject_message(
                protocol.ProtocolError(protocol.REJECT_MALFORMED, f"unusable registration: {exc}"),
                "prefill control socket",
            )
            return
        peer = DecodePeer(
            engine_key=key,
            endpoint=(msg.decode_ip, msg.decode_port),
            attn_tp_size=msg.attn_tp_size,
            attn_tp_rank=msg.attn_tp_rank,
            kv_descs=kv,
            aux_descs=aux,
            state_descs=state,
            layout=None,
        )
        try:
            peer.layout = mgr.planner.accept_peer(key, msg.layout, kv, aux, state)
            # A different aux buffer count is served (leading buffers move), with SGLang's warning.
            mgr.check_peer_aux_buffer_count(f"{msg.decode_ip}:{msg.decode_port}", len(aux))
        except PlanningError as exc:
            peer.rejected = f"decode {msg.decode_ip}:{msg.decode_port} refused at registration: {exc}"
            logger.error("sglang-mori: %s", peer.rejected)
        if peer.rejected is None and kv and mgr.kv_descs:
            try:
                # First contact now, so it can never raise in the middle of a room's batch.
                local = next(d for d in mgr.kv_descs if d is not None)
                mgr.engine.connect(local, kv[0])
            except Exception as exc:
                peer.rejected = f"cannot reach decode engine {key}: {exc}"
                logger.error("sglang-mori: %s", peer.rejected)
        replaced = self.peers.add(peer)
        if replaced is not None:
            self._fail_rooms_of_peer(replaced.engine_key, f"decode engine {replaced.engine_key} was replaced by a restarted engine")
            mgr.engine.remove_peer(replaced.engine_key)
            mgr.planner.forget_peer(replaced.engine_key)
        if peer.rejected is None:
            mgr.metrics.peer_up(key)
        else:
            mgr.metrics.peer_down(key)
        logger.info("sglang-mori: decode peer %s registered from %s:%s (tp %d/%d)%s", key, msg.decode_ip,
                    msg.decode_port, msg.attn_tp_rank, msg.attn_tp_size,
                    f" REJECTED: {peer.rejected}" if peer.rejected else "")

    def _on_metadata(self, msg: protocol.RoomMetadata) -> None:
        mgr = self.mgr
        room = msg.room
        if len(msg.kv_indices) % 4:
            mgr.fail_room(room, f"room {room}: page index list of {len(msg.kv_indices)} bytes is truncated", "protocol",
                          before_sender=True)
            self._note_unclaimed(room)
            return
        target = RoomTarget(
            engine_key=msg.engine_key,
            endpoint=msg.decode_ip,
            dst_port=msg.decode_port,
            kv_indices=np.frombuffer(msg.kv_indices, dtype="<i4").astype(np.int64),
            aux_index=msg.aux_index,
            state_indices=msg.state_indices,
            required_dst_info_num=max(1, msg.required_dst_info_num),
            decode_prefix_len=msg.decode_prefix_len,
            is_dummy=msg.is_dummy,
        )
        if not target.is_dummy:
            self.peers.touch(msg.engine_key)
            target.reject_reason = self.peers.unusable_reason(msg.engine_key) or mgr.planner.check_destination(
                self.peers.get(msg.engine_key), target
            )
        with self._meta_lock:
            current = mgr.request_status.get(room)
            if current is None and self._finished_recently(room):
                # Metadata for a request that already finished here: a replay. Accepting it would
                # resurrect the room (WaitingForInput, its old pages) for nobody, and a later
                # request reusing the id would adopt those stale destinations.
                mgr.reject_message(
                    protocol.ProtocolError("replayed", f"metadata for room {room}, which already finished", room),
                    "prefill control socket",
                )
                return
            if current is not None and current != KVPoll.Bootstrapping:
                # A replay, or metadata for a room already in flight: never re-target live writes.
                mgr.reject_message(
                    protocol.ProtocolError("replayed", f"metadata for room {room} in KVPoll state {int(current)}", room),
                    "prefill control socket",
                )
                return
            if current is None:
                self._note_unclaimed(room, locked=True)
            infos = mgr.transfer_infos.setdefault(room, {})
            infos[msg.engine_key] = target
            ready = len(infos) >= target.required_dst_info_num
        if ready:
            mgr.resolve_kv_replica_factor(infos)
            mgr.req_to_decode_prefix_len[room] = next(
                (i.decode_prefix_len for i in infos.values() if i.decode_prefix_len), 0
            )
            mgr.update_status(room, KVPoll.WaitingForInput)

    # Called by MoriKVSender: a request's sender starts / is cleared on this rank.
    def note_sender_started(self, room: int) -> bool:
        """A sender for `room` starts here; True when decode already aborted the request."""
        with self._meta_lock:
            self._finished_rooms.pop(room, None)
            self._unclaimed.pop(room, None)
            at = self._early_aborts.pop(room, None)
        return at is not None and time.monotonic() - at <= FINISHED_ROOMS_TTL_S

    def _note_unclaimed(self, room: int, locked: bool = False) -> None:
        if locked:
            self._unclaimed.setdefault(room, time.monotonic())
            return
        with self._meta_lock:
            if room not in self.mgr.request_status or room in self._unclaimed:
                self._unclaimed.setdefault(room, time.monotonic())

    def _prune_dead_peers(self) -> None:
        retention = max(DEAD_PEER_RETENTION_S, 10 * self.cfg.peer_fail_fast_s)
        for peer in self.peers.prune_dead(retention):
            logger.info("sglang-mori: forgetting decode engine %s (%s:%s): its connection broke %.0f s "
                        "ago (%s) and it has not spoken since", peer.engine_key, *peer.endpoint,
                        time.monotonic() - peer.broken_at, peer.failed_reason or "failure")
            self.mgr.planner.forget_peer(peer.engine_key)
            self.mgr.engine.remove_peer(peer.engine_key)

    def _prune_unclaimed(self, now: float) -> None:
        """Forget rooms decode's messages created here (metadata, a failure for a room not seen
        yet) that no request claimed within the bootstrap timeout: metadata for a request that
        never reaches this rank, or hostile input, would otherwise stay in request_status,
        transfer_infos and failure_records forever."""
        mgr = self.mgr
        ttl = float(getattr(mgr, "bootstrap_timeout", 300) or 300)
        with self._meta_lock:
            while self._unclaimed:
                room, first = next(iter(self._unclaimed.items()))
                if now - first <= ttl:
                    break
                self._unclaimed.popitem(last=False)
                if mgr.request_status.get(room) not in (None, KVPoll.WaitingForInput, KVPoll.Failed):
                    continue  # claimed after all (a sender moved it on)
                mgr.request_status.pop(room, None)
                mgr.transfer_infos.pop(room, None)
                mgr.req_to_decode_prefix_len.pop(room, None)
                with mgr.failure_lock:
                    mgr.failure_records.pop(room, None)
                logger.info("sglang-mori: room %s: metadata no request claimed within %.0f s dropped", room, ttl)

    def _note_early_abort(self, room: int) -> None:
        now = time.monotonic()
        with self._meta_lock:
            if self._finished_recently(room):
                return  # an abort for the request that already finished under this id
            self._early_aborts[room] = now
            self._early_aborts.move_to_end(room)
            while self._early_aborts and (
                len(self._early_aborts) > FINISHED_ROOMS_MAX
                or now - next(iter(self._early_aborts.values())) > FINISHED_ROOMS_TTL_S
            ):
                self._early_aborts.popitem(last=False)

    def note_sender_finished(self, room: int) -> None:
        now = time.monotonic()
        with self._meta_lock:
            self._finished_rooms[room] = now
            self._finished_rooms.move_to_end(room)
            while self._finished_rooms and (
                len(self._finished_rooms) > FINISHED_ROOMS_MAX
                or now - next(iter(self._finished_rooms.values())) > FINISHED_ROOMS_TTL_S
            ):
                self._finished_rooms.popitem(last=False)

    def _finished_recently(self, room: int) -> bool:
        at = self._finished_rooms.get(room)
        return at is not None and time.monotonic() - at <= FINISHED_ROOMS_TTL_S

    def _on_abort(self, msg: protocol.Abort) -> None:
        from sglang.srt.disaggregation.common.conn import AckTarget

        mgr = self.mgr
        room = msg.room
        with self.room_locks[room % len(self.room_locks)]:
            current = mgr.request_status.get(room)
            if current is not None and current not in (KVPoll.Success, KVPoll.Failed):
                mgr.record_failure(room, "Aborted by decode")
                mgr.update_status(room, KVPoll.Failed)
            elif current is None:
                self._note_early_abort(room)  # the request has not reached this rank yet
            if not mgr.enable_deferred_decode_kv_release or msg.generation is None:
                return
            target = AckTarget(msg.decode_ip, msg.decode_port, msg.generation)
            rt = self.tracker.get(room)
            if (rt is not None and rt.poisoned) or room in mgr._deferred_ack_poisoned_rooms:
                return  # a write may still land: decode falls back to its release timeout
            if rt is None:
                mgr._send_abort_ack(room, target)
                return
            # The completion thread ACKs once the room's writes are proven drained (or poisons it).
            mgr.register_deferred_ack_target(room, target)
            if self.tracker.get(room) is None:  # it drained while we registered
                mgr._maybe_ack_drained_abort(room)
        self.tracker.notify()

    # --- submission ---------------------------------------------------------------------
    def add_transfer_request(self, room, kv_indices, index_slice, is_last_chunk, **kw) -> None:
        mgr = self.mgr
        status = mgr.request_status.get(room)
        if status is None or status == KVPoll.Failed:
            return
        chunk = Chunk(
            room=room,
            kv_indices=np.asarray(kv_indices, dtype=np.int64),
            index_slice=index_slice,
            is_last=is_last_chunk,
            aux_index=kw.get("aux_index"),
            state_indices=kw.get("state_indices"),
            wait_event=kw.get("wait_event"),
        )
        q = self.queues[room % len(self.queues)]
        try:
            q.put_nowait(chunk)
        except queue.Full:
            mgr.fail_room(room, f"transfer queue full ({q.maxsize} chunks, SGLANG_MORI_MAX_QUEUED_CHUNKS)", "backpressure")
        self._publish_queue_depth()

    def _publish_queue_depth(self) -> None:
        with self._depth_lock:
            self.mgr.metrics.set_queue_depth(sum(x.qsize() for x in self.queues))

    def _shard_loop(self, q: queue.Queue) -> None:
        while not self.mgr._stopped:
            chunk = q.get()
            if chunk is None:
                return
            # Also on dequeue: published only on enqueue, the gauge kept its last value when idle.
            self._publish_queue_depth()
            try:
                with self.room_locks[chunk.room % len(self.room_locks)]:
                    self._process(chunk)
            except Exception as exc:
                logger.exception("sglang-mori: chunk of room %s failed", chunk.room)
                self.mgr.fail_room(chunk.room, f"internal error while sending KV: {exc!r}")

    def _process(self, chunk: Chunk) -> None:
        mgr = self.mgr
        room = chunk.room
        if mgr.request_status.get(room) in (None, KVPoll.Failed):
            return
        infos = mgr.transfer_infos.get(room)
        if not infos:
            mgr.fail_room(room, "no destination metadata from decode for this room", "protocol")
            return
        for info in infos.values():
            if info.reject_reason:
                mgr.fail_room(room, info.reject_reason, "layout_mismatch")
                return
        targets = [t for t in infos.values() if not t.is_dummy]
        if chunk.wait_event is not None:
            chunk.wait_event.synchronize()  # source KV is ready only after the forward pass
        rt, fresh = self.tracker.get_or_create(
            room, [((t.endpoint, t.dst_port), t.engine_key, t.aux_index) for t in targets]
        )
        if fresh:
            mgr.update_status(room, KVPoll.Transferring)
        # Every chunk restarts decode's deadline: a long chunked prefill is slow, not dead.
        for t in targets:
            mgr.send_message((t.endpoint, t.dst_port), protocol.TransferStarted(room=room, prefill_rank=mgr._prefill_unique_rank()))
        deadline = time.monotonic() + self.timeout_s
        for t in targets:
            peer = self.peers.get(t.engine_key)
            reason = self.peers.unusable_reason(t.engine_key)
            if reason:
                mgr.fail_room(room, reason, "peer_dead")
                return
            try:
                pairs = mgr.planner.write_pairs(peer, chunk, t)
            except PlanningError as exc:
                mgr.fail_room(room, f"room {room}: {exc}", "bad_index")
                return
            if not self._acquire_inflight(peer, deadline):
                mgr.fail_room(room, f"decode engine {peer.engine_key} has {peer.inflight} transfers in flight "
                              f"(SGLANG_MORI_MAX_INFLIGHT_PER_PEER) and none finished before the deadline", "timeout")
                return
            try:
                handle = mgr.engine.write(peer.engine_key, pairs, deadline=deadline, retry_max=self.cfg.submit_retry_max)
            except SubmitError as exc:
                mgr.metrics.transfer_started(peer.engine_key)  # before the completion thread can see it
                rt.add(exc.handle, deadline)
                mgr._staging_outstanding[room] = len(rt.unfinished())
                mgr.fail_room(room, f"submitting KV writes to {peer.engine_key} failed: {exc}", "submit_error")
                self.tracker.notify()
                return
            # Count the start before the handle is visible: the completion thread may finish it at once.
            mgr.metrics.transfer_started(peer.engine_key)
            rt.add(handle, deadline)
            # Publish the writes at once, not at the completion thread's next pass: SGLang's
            # sender.clear() ACKs a pending abort right away unless this count is positive.
            mgr._staging_outstanding[room] = len(rt.unfinished())
        rt.chunks += 1
        if chunk.is_last:
            rt.aux_index = chunk.aux_index
            rt.last_submitted = True
        self.tracker.notify()

    def _acquire_inflight(self, peer: DecodePeer, deadline: float) -> bool:
        with self._inflight_lock:
            while peer.inflight >= self.cfg.max_inflight_per_peer:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._inflight_lock.wait(remaining)
            peer.inflight += 1
            return True

    def _release_inflight(self, key: str, count: int) -> None:
        peer = self.peers.get(key)
        with self._inflight_lock:
            if peer is not None:
                peer.inflight = max(0, peer.inflight - count)
            self._inflight_lock.notify_all()
