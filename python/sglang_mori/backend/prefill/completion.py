"""Prefill completion: watch every submitted write, conclude rooms, drain them, release abort ACKs.

Runs on one thread (service.py). Per pass it waits (GIL released) on the oldest running write, or
sleeps until a submitter or an abort changes something, then advances every room with writes:

- returns the in-flight budget of each write that became terminal, and counts it;
- concludes an open room: Success once every write succeeded and the last chunk was submitted
  (aux rides on that Success message, so "done" never precedes the data), failure on the first
  failed write or expired deadline, or because SGLang failed the room meanwhile;
- finishes a concluded room: DRAINED releases decode's held abort ACKs; POISONED (a write may
  still land) never does, and decode releases those pages at its own timeout.
"""

from __future__ import annotations

import logging

from sglang_mori import protocol
from sglang_mori.backend import room_status
from sglang_mori.backend.prefill.failures import PrefillFailures
from sglang_mori.backend.prefill.parts import PrefillParts
from sglang_mori.backend.prefill.rooms import Phase, PrefillRoom
from sglang_mori.engine import WriteState

logger = logging.getLogger(__name__)

# A room that cannot prove quiescence after this many transfer deadlines is given up on: its pages
# stay poisoned on decode (no ACK), and its in-flight budget is returned to the peer.
DRAIN_GIVE_UP_DEADLINES = 10


class Completion:
    def __init__(self, parts: PrefillParts, failures: PrefillFailures, on_peer_failed):
        self.p = parts
        self.failures = failures
        self.on_peer_failed = on_peer_failed  # (engine key, reason) -> None: fail its rooms
        self.poll_ms = max(1, min(parts.config.wait_poll_ms, 20))

    def run_once(self) -> None:
        p = self.p
        generation = p.rooms.generation
        with p.rooms.lock:
            rooms = p.rooms.with_writes()
        running = next((w.handle for r in rooms for w in r.writes if w.handle.state() is WriteState.RUNNING), None)
        if running is None or not running.wait_running(self.poll_ms):
            # Nothing running: sleep until a submitter or an abort changes something.
            p.rooms.wait_for_change(generation, 0.2)
        now = p.clock()
        for r in rooms:
            self.advance(r, now)
        self.handle_peer_failures()

    def advance(self, r: PrefillRoom, now: float) -> None:
        p = self.p
        for w in r.writes:
            if not w.handle.released and w.handle.quiescent():
                self._release(w.handle, now)
        if not r.concluded:
            self._maybe_conclude(r, now)
        give_up_s = DRAIN_GIVE_UP_DEADLINES * p.timeout_s
        with p.rooms.lock:
            finished = r.try_finish(now, give_up_s)
            publishes = p.rooms.owns_sglang_state(r)
            if finished is None:
                if publishes:
                    p.sglang.set_outstanding(r.room, r.outstanding())
                return
            if publishes:
                p.sglang.drop_outstanding(r.room)
            p.rooms.forget_if_done(r)
            if finished is Phase.POISONED and publishes:
                p.sglang.poison(r.room)
        # The room is finished and never visited again: return every budget it still holds.
        # POISONED: writes given up on. DRAINED: a write that turned quiescent after the release
        # pass above and before try_finish saw every write quiescent (else its slot leaks).
        for w in r.writes:
            if not w.handle.released:
                self._release(w.handle, now)
        if finished is Phase.POISONED:
            if r.unfinished():
                logger.error("sglang-mori: room %s: %d writes never became terminal; its decode pages stay held",
                             r.room, len(r.unfinished()))
            else:
                logger.warning("sglang-mori: room %s: a failed transfer may still have writes in flight; no abort "
                               "ACK (decode releases at its own timeout)", r.room)
        elif publishes:
            p.sglang.release_acks(r.room)

    def _release(self, handle, now: float) -> None:
        """Return a finished (or given-up) write's in-flight budget and record its outcome."""
        handle.released = True
        self.p.peers.budget.release(handle.peer_key)
        ok = handle.state() is WriteState.SUCCEEDED
        reason = None if ok else handle.failure_kind().metric_reason
        self.p.metrics.transfer_finished(handle.peer_key, handle.nbytes, now - handle.started_at, ok=ok, reason=reason)

    def _maybe_conclude(self, r: PrefillRoom, now: float) -> None:
        p = self.p
        status = p.sglang.status(r.room) if r.claimed else None
        if r.claimed and (status is None or status == room_status.FAILED):
            # Failed (or cleared) by SGLang itself, e.g. the scheduler aborted the request.
            reason = p.sglang.failure_reason(r.room) or "room failed on prefill"
            with p.rooms.lock:
                concluded = r.conclude(False, reason, now)
            if concluded and status == room_status.FAILED:
                self.failures.notify_decode(r.room, r.notify_addresses(), reason)
            return
        state, reason = r.verdict(now)
        # Not while a submitter still works on the room: the layer-wise worker may track writes
        # after the last chunk's (it holds a submit token until its batch's end).
        if state is WriteState.SUCCEEDED and r.last_submitted and not r.submitting:
            self._conclude_success(r, now)
        elif state is WriteState.FAILED:
            for w in r.writes:
                if w.handle.state() is WriteState.FAILED and w.handle.failure_kind().breaks_peer:
                    if p.peers.mark_failed(w.handle.peer_key, reason):
                        p.metrics.peer_down(w.handle.peer_key)
            timed_out = any(w.handle.state() is WriteState.RUNNING for w in r.writes)
            self.failures.fail_life(r, reason, "timeout" if timed_out else "peer_dead")

    def _conclude_success(self, r: PrefillRoom, now: float) -> None:
        p = self.p
        aux = p.read_aux(r.aux_index) if p.owns_aux else None
        with p.rooms.lock:
            if p.sglang.status(r.room) == room_status.FAILED or not r.conclude(True, None, now):
                return
            addresses = r.notify_addresses()
        p.sglang.set_status(r.room, room_status.SUCCESS)
        message = protocol.RoomStatus(room=r.room, status=room_status.SUCCESS, prefill_rank=p.sglang.prefill_rank,
                                      aux=aux)
        p.messenger.send_all(addresses, message)
        p.metrics.request_finished(ok=True)

    def handle_peer_failures(self) -> None:
        p = self.p
        for failure in p.engine.pop_peer_failures():
            if p.peers.mark_failed(failure.engine_key, failure.reason):
                logger.error("sglang-mori: decode engine %s failed: %s", failure.engine_key, failure.reason)
            self.on_peer_failed(failure.engine_key, failure.reason)
            p.metrics.peer_down(failure.engine_key)
