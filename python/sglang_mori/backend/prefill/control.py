"""Prefill control: decode's messages (Register, RoomMetadata, Abort) and their effect on rooms.

Runs on the control thread (service.py), which also prunes rooms nobody claimed and peers that
died. Every handler turns bad input into a counted rejection or one room's failure, never an
exception out of the thread.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from sglang_mori import protocol
from sglang_mori.backend.peers import DecodePeer
from sglang_mori.backend.prefill.effects import RoomEffects
from sglang_mori.backend.prefill.failures import (
    ABORTED,
    ABORTED_BEFORE_ARRIVAL,
    ABORTED_BY_DECODE,
    PEER_DEAD,
    PROTOCOL,
    PrefillFailures,
)
from sglang_mori.backend.prefill.parts import PrefillParts
from sglang_mori.backend.prefill.rooms import MetadataVerdict, Phase, RoomTarget
from sglang_mori.planning import PlanningError

logger = logging.getLogger(__name__)

# A decode peer whose connection broke (MORI does not rebuild it) and that sent nothing since is
# forgotten after this long; at least 10 fail-fast windows.
DEAD_PEER_RETENTION_S = 120.0


class PrefillControl:
    def __init__(self, parts: PrefillParts, effects: RoomEffects, failures: PrefillFailures,
                 reject: Callable[[protocol.ProtocolError, str], None]):
        self.p = parts
        self.effects = effects
        self.failures = failures
        self.reject = reject  # counts and logs a rejected message
        self._local = threading.local()  # never_block of the message being handled on this thread

    # --- dispatch ---------------------------------------------------------------------------
    def handle(self, frames, never_block: bool = False) -> None:
        """One message from decode. `never_block`: the caller is SGLang's scheduler (its poll read
        the message, inbox.py): a reply or failure status that cannot be queued at once is dropped
        (logged) rather than stall the scheduler up to the send timeout."""
        self._local.never_block = never_block
        try:
            self._dispatch(frames)
        finally:
            self._local.never_block = False

    def _transition(self):
        return self.effects.transition(never_block=getattr(self._local, "never_block", False))

    def _dispatch(self, frames) -> None:
        try:
            message = protocol.decode(frames)
        except protocol.ProtocolError as err:
            self.reject(err, "prefill control socket")
            if err.reason == protocol.REJECT_VERSION and err.room is not None:
                self.fail_unclaimed(err.room, f"decode speaks another protocol: {err.detail}", PROTOCOL)
            return
        if isinstance(message, protocol.Register):
            self.on_register(message)
        elif isinstance(message, protocol.RoomMetadata):
            self.on_metadata(message)
        elif isinstance(message, protocol.Abort):
            self.on_abort(message)
        else:
            self.reject(protocol.ProtocolError(protocol.REJECT_MALFORMED, f"{type(message).__name__} sent to prefill"),
                        "prefill control socket")

    def fail_unclaimed(self, room: int, reason: str, label: str) -> None:
        """Fail a room decode's message names, opening it if no request holds it yet (its sender
        then fails on arrival instead of waiting out the bootstrap timeout)."""
        p = self.p
        with self._transition() as fx:
            self.failures.conclude_locked(p.rooms.open(room, p.clock()), reason, label, fx)

    # --- Register -----------------------------------------------------------------------------
    def on_register(self, msg: protocol.Register) -> None:
        p = self.p
        try:
            key = p.engine.add_peer(msg.engine_desc)
            kv = [p.engine.unpack_memory(b) for b in msg.kv_descs]
            aux = [p.engine.unpack_memory(b) for b in msg.aux_descs]
            state = [[p.engine.unpack_memory(b) if b else None for b in comp] for comp in msg.state_descs]
        except Exception as exc:
            self.reject(protocol.ProtocolError(protocol.REJECT_MALFORMED, f"unusable registration: {exc}"),
                        "prefill control socket")
            return
        peer = DecodePeer(engine_key=key, endpoint=(msg.decode_ip, msg.decode_port), attn_tp_size=msg.attn_tp_size,
                          attn_tp_rank=msg.attn_tp_rank, kv_descs=kv, aux_descs=aux, state_descs=state, layout=None)
        try:
            p.cp.check_decode(decode_all_cp_ranks=msg.cp_all_ranks, decode_tp_size=msg.attn_tp_size,
                              state_types=[s.state_type for s in p.planner.layout.states])
            peer.layout = p.planner.accept_peer(key, msg.layout, kv, aux, state, dcp=(msg.dcp_size, msg.dcp_rank))
            # A different aux buffer count is served (leading buffers move), with SGLang's warning.
            p.sglang.check_peer_aux_buffer_count(f"{msg.decode_ip}:{msg.decode_port}", len(aux))
        except PlanningError as exc:
            peer.rejected = f"decode {msg.decode_ip}:{msg.decode_port} refused at registration: {exc}"
            logger.error("sglang-mori: %s", peer.rejected)
        # No engine session yet: it opens on the first write to this peer (submitter.py), so pairs
        # that never carry bytes (MLA dummy ranks, a DP rank nobody routes to) cost nothing.
        replaced = p.peers.add(peer)
        if replaced is not None:
            self.fail_rooms_of_peer(replaced.engine_key,
                                    f"decode engine {replaced.engine_key} was replaced by a restarted engine")
            self.forget_peer(replaced.engine_key)
        if peer.rejected is None:
            p.metrics.peer_up(key)
        else:
            p.metrics.peer_down(key)
        logger.info("sglang-mori: decode peer %s registered from %s:%s (tp %d/%d)%s", key, msg.decode_ip,
                    msg.decode_port, msg.attn_tp_rank, msg.attn_tp_size,
                    f" REJECTED: {peer.rejected}" if peer.rejected else "")

    def forget_peer(self, key: str) -> None:
        self.p.planner.forget_peer(key)
        self.p.engine.remove_peer(key)

    def fail_rooms_of_peer(self, key: str, reason: str) -> None:
        """Every open room with a destination on `key` fails (draining lives are left to drain).
        Found and failed in one transition: failing by room id after the lock was let go could
        hit a next life that took the id meanwhile, with destinations elsewhere."""
        p = self.p
        with self._transition() as fx:
            for r in list(p.rooms.rooms.values()):
                if not r.concluded and any(t.engine_key == key for t in r.live_targets()):
                    self.failures.conclude_locked(r, reason, PEER_DEAD, fx)

    # --- RoomMetadata -----------------------------------------------------------------------
    def on_metadata(self, msg: protocol.RoomMetadata) -> None:
        p = self.p
        room = msg.room
        try:
            kv_indices = protocol.decode_page_indices(msg.kv_indices, room)
        except protocol.ProtocolError as err:
            self.reject(err, "prefill control socket")
            self.fail_unclaimed(room, err.detail, PROTOCOL)
            return
        target = RoomTarget(
            engine_key=msg.engine_key, attempt=msg.attempt, endpoint=msg.decode_ip, dst_port=msg.decode_port,
            kv_indices=kv_indices, aux_index=msg.aux_index, state_indices=msg.state_indices,
            required_dst_info_num=max(1, msg.required_dst_info_num), decode_prefix_len=msg.decode_prefix_len,
            is_dummy=msg.is_dummy,
        )
        if not target.is_dummy:
            p.peers.touch(msg.engine_key)
            target.reject_reason = p.peers.unusable_reason(msg.engine_key) or p.planner.check_destination(
                p.peers.get(msg.engine_key), target)
        with self._transition() as fx:
            outcome = p.rooms.add_target(target, room, p.clock(), fx)
        if outcome.verdict in (MetadataVerdict.REPLAY, MetadataVerdict.REJECTED):
            self.reject(protocol.ProtocolError("replayed", f"metadata for room {room}: {outcome.detail}", room),
                        "prefill control socket")
        elif outcome.verdict is MetadataVerdict.QUEUED_NEXT_LIFE:
            logger.info("sglang-mori: room %s: attempt %s from %s waits for the room's current life to end",
                        room, msg.attempt, msg.engine_key)

    # --- Abort --------------------------------------------------------------------------------
    def on_abort(self, msg: protocol.Abort) -> None:
        p = self.p
        room = msg.room
        now = p.clock()
        with self._transition() as fx:
            life, known = p.rooms.abort_attempt(room, msg.attempt, now)
            if not known:
                # The request has not reached this rank: open the room failed, so its sender
                # fails on arrival (and metadata for this attempt is not served).
                life = p.rooms.open(room, now)
            if life is not None and not life.concluded:
                reason = ABORTED_BY_DECODE if life.claimed else ABORTED_BEFORE_ARRIVAL
                self.failures.conclude_locked(life, reason, ABORTED, fx, tell_decode=False)
        if not p.sglang.deferred_release or msg.generation is None:
            return
        with self._transition() as fx:
            lives = [r for r in [p.rooms.get(room), *p.rooms.draining_lives(room)] if r is not None]
            if any(r.phase is Phase.POISONED for r in lives) or p.sglang.ack_poisoned(room):
                return  # a write may still land: decode falls back to its release timeout
            if any(r.outstanding() or (r.writes and not r.terminal) for r in lives):
                # Writes were issued and their drain is not decided yet: the completion thread
                # ACKs once they are proven drained (or poisons the room, and no ACK goes out).
                fx.held_acks.append((room, msg.decode_ip, msg.decode_port, msg.generation))
            else:
                fx.sends.append(((msg.decode_ip, msg.decode_port), protocol.AbortAck(
                    room=room, prefill_rank=p.sglang.prefill_rank, generation=msg.generation)))
            fx.changed = True

    # --- housekeeping -------------------------------------------------------------------------
    def prune(self) -> None:
        p = self.p
        ttl = p.sglang.bootstrap_timeout_s
        with p.rooms.lock:
            dropped = p.rooms.prune_unclaimed(p.clock(), ttl)
        for r in dropped:
            logger.info("sglang-mori: room %s: metadata no request claimed within %.0f s dropped", r.room, ttl)
        retention = max(DEAD_PEER_RETENTION_S, 10 * p.config.peer_fail_fast_s)
        for peer in p.peers.prune_dead(retention):
            logger.info("sglang-mori: forgetting decode engine %s (%s:%s): its connection broke %.0f s ago (%s) "
                        "and it has not spoken since", peer.engine_key, *peer.endpoint,
                        p.clock() - peer.broken_at, peer.failed_reason or "failure")
            self.forget_peer(peer.engine_key)
