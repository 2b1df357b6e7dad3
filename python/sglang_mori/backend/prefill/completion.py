"""Prefill completion: watch every submitted write, conclude rooms, drain them, release abort ACKs.

Runs on one thread (service.py). Per pass it advances every room with writes, then waits (GIL
released) on the oldest running write, or, when nothing runs and nothing turned quiescent since the
pass, sleeps until a submitter or an abort changes something. Advancing first matters where writes
finish faster than this thread looks (GPU copies, XGMI): they conclude at once, not after the sleep.
Per room:

- returns the in-flight budget of each write that became terminal, and counts it;
- concludes an open room: Success once every write succeeded and the last chunk was submitted
  (aux rides on that Success message, so "done" never precedes the data; decided under the
  registry lock, where a submitter tracks writes and flags together; success.py, which other
  threads call too when they are the ones to see the room complete), failure on the first
  failed write or expired deadline, or because SGLang failed the room meanwhile;
- finishes a concluded room: DRAINED releases decode's held abort ACKs; POISONED (a write may
  still land) never does, and decode releases those pages at its own timeout;
- fences a failed room's writes still in flight before that timeout, where the engine can (fence.py);
- sends a last chunk's held-back TransferStarted once its grace passed with the room still open
  (announce.py); its waits end by then.
"""

from __future__ import annotations

import logging
import math
from typing import Optional

from sglang_mori.backend import room_status
from sglang_mori.backend.prefill.announce import LazyAnnouncer
from sglang_mori.backend.prefill.effects import RoomEffects
from sglang_mori.backend.prefill.fence import WriteFence
from sglang_mori.backend.prefill.failures import ABORTED, FAILED_ON_PREFILL, PEER_DEAD, TIMEOUT, PrefillFailures
from sglang_mori.backend.prefill.parts import PrefillParts
from sglang_mori.backend.prefill.rooms import Phase, PrefillRoom
from sglang_mori.backend.prefill.success import SuccessDecider
from sglang_mori.engine import WriteState

logger = logging.getLogger(__name__)

# A room that cannot prove quiescence after this many transfer deadlines is given up on: its pages
# stay poisoned on decode (no ACK), and its in-flight budget is returned to the peer.
DRAIN_GIVE_UP_DEADLINES = 10
# The longest SGLANG_MORI_WAIT_POLL_MS the completion thread honours (docs/tuning.md).
COMPLETION_POLL_CAP_MS = 20


class Completion:
    def __init__(self, parts: PrefillParts, effects: RoomEffects, failures: PrefillFailures, on_peer_failed,
                 success: Optional[SuccessDecider] = None):
        self.p = parts
        self.effects = effects
        self.failures = failures
        self.on_peer_failed = on_peer_failed  # (engine key, reason) -> None: fail its rooms
        self.success = success if success is not None else SuccessDecider(parts, effects)
        # How long one pass waits on a running write before looking at every room again: another
        # room's write that finished meanwhile waits this long for its Success, hence the cap.
        self.poll_ms = max(1, min(parts.config.wait_poll_ms, COMPLETION_POLL_CAP_MS))
        self.fence = WriteFence(parts, DRAIN_GIVE_UP_DEADLINES)
        self.announcer = LazyAnnouncer(parts)

    def run_once(self) -> None:
        p = self.p
        generation = p.rooms.generation
        with p.rooms.lock:
            rooms = p.rooms.with_writes()
        # Advance first, wait after: writes that finished before this pass (a GPU copy often
        # finishes before this thread looks) conclude now, not after the idle wait below.
        now = p.clock()
        for r in rooms:
            self.advance(r, now)
        self.handle_peer_failures()
        p.metrics.set_open_rooms(p.rooms.open_count())
        running = next(((r, w.handle) for r in rooms for w in r.writes if w.handle.state() is WriteState.RUNNING),
                       None)
        if running is not None:
            # Bounded by the next held-back TransferStarted too (announce.py): it goes out on time.
            wait_ms = self.poll_ms
            if self.announcer.enabled:
                wait_ms = max(1, math.ceil(self.announcer.wait_s(rooms, now, wait_ms / 1000.0) * 1000.0))
            room, handle = running
            if handle.wait_running(wait_ms) and handle.state() is not WriteState.RUNNING and not room.concluded:
                # The write this thread waited on is done: its room is concluded now, on this
                # wake-up, before the next pass gathers and settles every room (issue 28: a lone
                # request's time from the copy's end to its Success). The next pass settles it.
                self._maybe_conclude(room, p.clock())
        elif not any(not w.handle.released and w.handle.quiescent() for r in rooms for w in r.writes):
            # Nothing running, and no write turned quiescent since the pass (that one is settled
            # at once by the next pass): sleep until a submitter or an abort changes something.
            p.rooms.wait_for_change(generation, self.announcer.wait_s(rooms, now, 0.2))

    def advance(self, r: PrefillRoom, now: float) -> None:
        if not r.concluded:
            self._maybe_conclude(r, now)
            if r.announce_at is not None:
                self.announcer.fire(r, now)  # still open past its grace: decode's deadline starts
            # Every room is settled on every pass, also one whose writes all still run: skipping
            # those (issue 28's second round) made `bench transfer` slower than without the skip
            # in 3 of 3 locked same-run rounds (docs/benchmarks.md), for no CPU per request saved.
        give_up_after_s = self.fence.give_up_after(r, DRAIN_GIVE_UP_DEADLINES * self.p.timeout_s)
        with self.effects.transition() as fx:
            finished = self.p.rooms.settle(r, now, give_up_after_s, fx)
        if finished is None and self.fence.due(r, now):
            self.fence.fence(r, now)  # its writes can no longer land: the next pass finds it drained
        if finished is not Phase.POISONED:
            return
        if r.unfinished():
            logger.error("sglang-mori: room %s: %d writes never became terminal and could not be fenced; no abort "
                         "ACK (decode frees its pages at its release timeout)", r.room, len(r.unfinished()))
        else:
            logger.warning("sglang-mori: room %s: a failed transfer may still have writes in flight; no abort "
                           "ACK (decode releases at its own timeout)", r.room)

    def _maybe_conclude(self, r: PrefillRoom, now: float) -> None:
        p = self.p
        status = p.sglang.status(r.room) if r.claimed else None
        if r.claimed and (status is None or status == room_status.FAILED):
            # Failed (or cleared) by SGLang itself, e.g. the scheduler aborted the request; decode
            # hears of it only if SGLang still holds the room (the failure record is its reason).
            reason = p.sglang.failure_reason(r.room) or FAILED_ON_PREFILL
            with self.effects.transition() as fx:
                self.failures.conclude_locked(r, reason, ABORTED, fx, tell_decode=status == room_status.FAILED)
            return
        # A look outside the lock, to skip rooms whose writes still run. It decides a failure
        # (a failed or expired write stays so, whatever is tracked after it), never a Success:
        # the last chunk's writes may be tracked right after this verdict (success.try_succeed).
        state, reason = r.verdict(now)
        if state is WriteState.SUCCEEDED:
            # `last_submitted`, read outside the lock, only picks the way: one lock hold that
            # concludes (the room is most likely ready), or a look first (a room between chunks
            # is not, and a transition per pass would be spent on it). Both decide under the lock.
            self.success.try_succeed(r, seen_done=r.last_submitted)
        elif state is WriteState.FAILED:
            # The room first, the peer after: once the peer is marked failed, a submitter fails
            # this room's next chunk with "failed recently", and the room's own failure (the
            # first cause) would be lost to that consequence of it.
            timed_out = any(w.handle.state() is WriteState.RUNNING for w in r.writes)
            self.failures.fail_life(r, reason, TIMEOUT if timed_out else PEER_DEAD)
            for w in r.writes:
                # A write our fence failed says nothing of the peer's health.
                if (w.handle.state() is WriteState.FAILED and w.handle.failure_kind().breaks_peer
                        and not w.handle.fenced):
                    if p.peers.mark_failed(w.handle.peer_key, reason):
                        p.metrics.peer_down(w.handle.peer_key)

    def handle_peer_failures(self) -> None:
        p = self.p
        for failure in p.engine.pop_peer_failures():
            # Its rooms first (with the engine's reason), then the peer (later rooms: "failed
            # recently"), as in _maybe_conclude.
            self.on_peer_failed(failure.engine_key, failure.reason)
            if p.peers.mark_failed(failure.engine_key, failure.reason):
                logger.error("sglang-mori: decode engine %s failed: %s", failure.engine_key, failure.reason)
            p.metrics.peer_down(failure.engine_key)
