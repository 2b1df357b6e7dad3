"""The decode applier: the only decode code that writes SGLang's room tables, and the one way a
decode room fails.

The service and the receiver decide (which message, which reason, whether the aux bytes fit); the
methods here carry the decision out on the room registry, SGLang's tables (through the adapter)
and the request metrics, together, so SGLang's view of a room cannot drift from the registry's.
test_decode_applier.py checks the source: no other module of decode/ or receiver.py calls a write
of the SGLang adapter.

A room fails here for our own causes (a deadline, aux that does not fit, a duplicate room, an
unreachable bootstrap server) and for a prefill rank's `RoomStatus(Failed)`; nothing else marks a
decode room Failed in SGLang (test_failure_doors.py). Decode tells nobody: prefill learns of an
abort from the receiver's own Abort message.
"""

from __future__ import annotations

import logging
from typing import Optional

from sglang_mori.backend import room_status
from sglang_mori.backend.failure_reasons import OTHER

logger = logging.getLogger(__name__)

DUPLICATE_ROOM = "Duplicate decode bootstrap room: another live request uses this id"
AUX_DOES_NOT_FIT = "aux item of {size} bytes for slot {slot} does not fit (item_len {item_len}, buffer {buffer} bytes)"
ABORTED_UNREACHABLE = "Aborted: {reason}"
TRANSFER_DEADLINE = ("KV transfer for room {room} not complete {deadline_s:.1f} s after it started "
                     "(SGLANG_MORI_TRANSFER_TIMEOUT_MS + grace); the prefill may be dead")


class DecodeEffects:
    def __init__(self, parts):
        self.p = parts

    def new_attempt(self, room: int) -> int:
        """A receiver starts on `room`: a new attempt (an earlier one's bookkeeping is stale, and
        so is a failure record an earlier request with this id left unread)."""
        self.p.sglang.drop_stale_failure(room)
        return self.p.rooms.open(room).attempt

    def fail(self, room: int, reason: str, label: str, attempt: Optional[int] = None) -> bool:
        """Record the reason, mark the room Failed in SGLang, count it; False if already over, or
        if `attempt` (when given) is no longer the room's: the caller looked at an earlier
        receiver, and the room id's next receiver is not its to fail."""
        p = self.p
        with p.rooms.lock:
            if attempt is not None and p.rooms.attempt_of(room) != attempt:
                return False
            p.rooms.finish(room, ok=False)
            if p.sglang.status(room) in (None, *room_status.TERMINAL):
                return False
            p.sglang.fail(room, reason)
        logger.warning("sglang-mori: room %s failed: %s", room, reason)
        p.metrics.request_finished(ok=False, reason=label)
        return True

    def prefill_failed(self, room: int, prefill_rank: int, reason: Optional[str]) -> bool:
        """A prefill rank reported the room Failed; counted once, when this made it terminal."""
        p = self.p
        with p.rooms.lock:
            before = p.sglang.status(room)
            if before is None:
                return False  # concluded and cleared already
            p.sglang.apply_prefill_status(room, room_status.FAILED, prefill_rank, reason)
            after = p.sglang.status(room)
            if after == before or after not in room_status.TERMINAL:
                return False
            p.rooms.finish(room, ok=False)
        p.metrics.request_finished(ok=False, reason=OTHER)
        return True

    def prefill_succeeded(self, room: int, prefill_rank: int, reason: Optional[str], before=None) -> bool:
        """A prefill rank reported Success (its aux bytes are in place). Counted once, when this
        made the room Success (with several prefill ranks, the last Success does). Status before,
        SGLang's update and the registry's close are one step under the registry lock, as in
        fail(): a failure decided on another thread (a duplicate room, an unreachable bootstrap
        server) either comes first (Failed stays, nothing is counted here) or finds the room over.
        `before`: SGLang's status of the room, read by a caller holding the registry lock since
        (the service's Success path: one read less per message, issue 28)."""
        p = self.p
        with p.rooms.lock:
            if before is None:
                before = p.sglang.status(room)
                if before is None:
                    return False  # concluded and cleared already
            p.sglang.apply_prefill_status(room, room_status.SUCCESS, prefill_rank, reason)
            if before == room_status.SUCCESS or p.sglang.status(room) != room_status.SUCCESS:
                return False
            p.rooms.finish_held(room, True)
        p.metrics.request_finished(ok=True, reason=None)
        return True

    def arm_abort(self, room: int) -> int:
        """Before an abort is sent: SGLang holds the room's pages until every prefill rank ACKed
        this generation."""
        return self.p.sglang.arm_deferred_abort(room)

    def abort_acked(self, room: int, prefill_rank: int, generation: int) -> None:
        """A prefill rank acknowledged an abort: SGLang may release the pages once all have."""
        self.p.sglang.note_abort_ack(room, prefill_rank, generation)
