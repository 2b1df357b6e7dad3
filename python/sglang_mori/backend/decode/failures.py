"""The one way a decode room fails: close the room, record the reason in SGLang, count it.

Both causes come through here: our own (a deadline, aux that does not fit, a duplicate room, an
unreachable bootstrap server) and a prefill rank's `RoomStatus(Failed)`. Nothing else marks a
decode room Failed in SGLang (test_failure_doors.py checks the source). Decode tells nobody:
prefill learns of an abort from the receiver's own Abort message.
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


class DecodeFailures:
    def __init__(self, parts):
        self.p = parts

    def fail(self, room: int, reason: str, label: str) -> bool:
        """Record the reason, mark the room Failed in SGLang, count it; False if already over."""
        p = self.p
        with p.rooms.lock:
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
