"""Prefill side, completion half: watch submitted writes, conclude rooms, drain them, ACK aborts.

Mixed into PrefillService (prefill_service.py), whose shard threads submit the writes this code
watches; it runs on the completion thread only.
"""

from __future__ import annotations

import ctypes
import logging
import time
from typing import Optional

from sglang.srt.disaggregation.base.conn import KVPoll

from sglang_mori import protocol
from sglang_mori.backend.room_tracker import RoomTransfer
from sglang_mori.engine.transfer_engine import ERR_BAD_STATE, ERR_INVALID_ARGS, IN_PROGRESS, SUCCESS

logger = logging.getLogger(__name__)

# A room that cannot prove quiescence after this many transfer deadlines is given up on: its pages
# stay poisoned on decode (no ACK), and its in-flight budget is returned to the peer.
DRAIN_GIVE_UP_DEADLINES = 10
# Submission-side failures that say nothing about the peer's health: one request fails, the peer
# stays usable (MORI: send queue full after the backoff, a post that could not allocate).
_TRANSIENT_FAILURES = ("SQ full", "ibv_post_send")


def _breaks_peer(message: str) -> bool:
    """Whether a failed status means the connection to the peer is unusable (fail fast for a while)."""
    return not any(marker in message for marker in _TRANSIENT_FAILURES)



class CompletionMixin:
    # --- completion ---------------------------------------------------------------------
    def _completion_loop(self) -> None:
        # Waits end early when the awaited status completes; others are noticed within poll_ms.
        poll_ms = max(1, min(self.cfg.wait_poll_ms, 20))
        while not self.mgr._stopped:
            try:
                generation = self.tracker.generation
                rooms = self.tracker.snapshot()
                pending = next((s for rt in rooms for h in rt.handles for s in (h.first_running(),) if s), None)
                if pending is not None:
                    # Bounded wait on the oldest running status (GIL released) instead of a spin.
                    pending.WaitFor(poll_ms)
                else:
                    # Nothing running: sleep until a shard submits or an abort arrives.
                    self.tracker.wait_for_change(generation, 0.2)
                now = time.monotonic()
                for rt in rooms:
                    self._advance(rt, now)
                self._handle_peer_failures()
            except Exception:
                logger.exception("sglang-mori: completion loop error")

    def _advance(self, rt: RoomTransfer, now: float) -> None:
        mgr = self.mgr
        room = rt.room
        for h in rt.handles:
            if not h.released and h.quiescent():
                self._release(h, now)
        if not rt.concluded:
            self._maybe_conclude(rt, now)
        unfinished = rt.unfinished()
        if not rt.concluded:
            mgr._staging_outstanding[room] = len(unfinished)
            return
        if unfinished and now - rt.concluded_at > DRAIN_GIVE_UP_DEADLINES * self.timeout_s:
            logger.error("sglang-mori: room %s: %d writes never became terminal; its decode pages stay held",
                         room, len(unfinished))
            rt.poisoned = True
            mgr.poison_deferred_ack_room(room)
            for h in unfinished:
                if not h.released:
                    self._release(h, now)
            unfinished = []
        if unfinished:
            mgr._staging_outstanding[room] = len(unfinished)
            return
        # A shard that passed its live check before the room concluded may still be adding writes
        # (it holds the room lock while it submits): never drop the room under it, or those writes
        # would go untracked (no drain, their in-flight budget never returned).
        lock = self.room_locks[room % len(self.room_locks)]
        if not lock.acquire(blocking=False):
            return  # look again on the next pass
        try:
            late = [h for h in rt.handles if not h.released]
            if late and not rt.poisoned:
                for h in late:
                    if h.quiescent():
                        self._release(h, now)
                if any(not h.released for h in late):
                    mgr._staging_outstanding[room] = len(rt.unfinished())
                    return
            self.tracker.remove(room)
            mgr._staging_outstanding.pop(room, None)
        finally:
            lock.release()
        if not rt.poisoned and not rt.succeeded and not rt.drain_proven():
            # Every status is terminal, but one failed after it may have posted writes that are
            # still on the wire: nothing proves these pages are safe, so decode gets no ACK.
            logger.warning("sglang-mori: room %s: a failed transfer may still have writes in flight; "
                           "no abort ACK (decode releases at its own timeout)", room)
            rt.poisoned = True
            mgr.poison_deferred_ack_room(room)
        if not rt.poisoned:
            mgr._maybe_ack_drained_abort(room)

    def _release(self, handle, now: float) -> None:
        """Return a finished (or given-up) handle's in-flight budget and record its outcome."""
        handle.released = True
        self._release_inflight(handle.peer_key, 1)
        code = handle.result()
        ok = code == SUCCESS and not handle.unaccounted
        if ok:
            reason = None
        elif handle.unaccounted or code in (ERR_INVALID_ARGS, ERR_BAD_STATE):
            reason = "submit_error"
        elif code == IN_PROGRESS:
            reason = "timeout"  # given up on while still running
        else:
            reason = "peer_dead"  # an asynchronous transport error (ERR_RDMA_OP and friends)
        self.mgr.metrics.transfer_finished(handle.peer_key, handle.nbytes, now - handle.started_at, ok=ok, reason=reason)

    def _maybe_conclude(self, rt: RoomTransfer, now: float) -> None:
        mgr = self.mgr
        room = rt.room
        status = mgr.request_status.get(room)
        if status is None or status == KVPoll.Failed:
            # Aborted or failed elsewhere: make sure decode hears about it, then drain.
            rt.conclude(now)
            if status == KVPoll.Failed:
                self._notify_failed(rt)
            return
        code, reason = rt.verdict(now)
        if code == SUCCESS and rt.last_submitted:
            rt.conclude(now)
            self._conclude_success(rt)
        elif code not in (SUCCESS, IN_PROGRESS):
            rt.conclude(now)
            if code != -1:
                for h in rt.handles:
                    if h.result() not in (SUCCESS, IN_PROGRESS) and _breaks_peer(h.failure_message()):
                        self.peers.mark_failed(h.peer_key, reason)
            mgr.fail_room(room, reason, "timeout" if code == -1 else "peer_dead")

    def _conclude_success(self, rt: RoomTransfer) -> None:
        mgr = self.mgr
        room = rt.room
        aux = self._read_aux(rt.aux_index)
        if mgr.request_status.get(room) == KVPoll.Failed:
            return
        mgr.update_status(room, KVPoll.Success)
        rt.succeeded = True
        for endpoint, _key, _dst_aux in rt.targets:
            mgr.send_message(
                endpoint,
                protocol.RoomStatus(room=room, status=int(KVPoll.Success), prefill_rank=mgr._prefill_unique_rank(), aux=aux),
            )
        mgr.metrics.request_finished(ok=True)

    def _notify_failed(self, rt: RoomTransfer) -> None:
        mgr = self.mgr
        with mgr.failure_lock:
            reason = mgr.failure_records.get(rt.room, "room failed on prefill")
        for endpoint, _key, _aux in rt.targets:
            mgr.send_message(
                endpoint,
                protocol.RoomStatus(room=rt.room, status=int(KVPoll.Failed), prefill_rank=mgr._prefill_unique_rank(), reason=reason),
            )

    def _read_aux(self, aux_index: Optional[int]) -> Optional[list]:
        """This room's aux (metadata) items as bytes, one per aux buffer; they ride on Success."""
        if aux_index is None:
            return None
        args = self.mgr.kv_args
        return [
            ctypes.string_at(ptr + aux_index * item_len, item_len)
            for ptr, item_len in zip(args.aux_data_ptrs, args.aux_item_lens)
        ]

    # --- peer failure -------------------------------------------------------------------
    def _handle_peer_failures(self) -> None:
        for event in self.mgr.engine.pop_peer_failures():
            key = getattr(event, "remote_engine_key", "")
            reason = f"peer failure reported by the engine: {getattr(event, 'reason', '?')} {getattr(event, 'detail', '')}"
            if self.peers.mark_failed(key, reason):
                logger.error("sglang-mori: decode engine %s failed: %s", key, reason)
            self._fail_rooms_of_peer(key, reason)
            self.mgr.metrics.peer_down(key)

    def _fail_rooms_of_peer(self, key: str, reason: str) -> None:
        for rt in self.tracker.snapshot():
            if not rt.concluded and any(k == key for _e, k, _a in rt.targets):
                rt.conclude(time.monotonic())
                # Already failed (its decode was told) or already cleared by its sender: failing it
                # again would count it twice, or leave a failure record nobody ever pops.
                if self.mgr.request_status.get(rt.room) not in (None, KVPoll.Failed):
                    self.mgr.fail_room(rt.room, reason, "peer_dead")
