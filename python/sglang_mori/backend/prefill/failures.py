"""The one way a prefill room fails: record the reason, update SGLang, count it, tell decode."""

from __future__ import annotations

import logging
from typing import Optional

from sglang_mori import protocol
from sglang_mori.backend import room_status
from sglang_mori.backend.prefill.parts import PrefillParts
from sglang_mori.backend.prefill.rooms import PrefillRoom

logger = logging.getLogger(__name__)

# Failed requests by cause (metrics label values, see metrics.FAILURE_REASONS).
TIMEOUT, PEER_DEAD, SUBMIT_ERROR, BAD_INDEX, ABORTED, PROTOCOL, LAYOUT, BACKPRESSURE, OTHER = (
    "timeout", "peer_dead", "submit_error", "bad_index", "aborted", "protocol", "layout_mismatch",
    "backpressure", "other")


class PrefillFailures:
    def __init__(self, parts: PrefillParts):
        self.p = parts

    def fail(self, room_id: int, reason: str, label: str, *, decode_knows: bool = False) -> bool:
        """Conclude the current life of `room_id` as failed; False if it had concluded already
        (the first cause wins) or does not exist.

        A claimed room is failed in SGLang (its sender polls Failed with the reason) and its decode
        ranks are told, unless `decode_knows` (decode's own abort). An unclaimed room (metadata
        came first) keeps the reason: its sender fails with it on arrival."""
        p = self.p
        with p.rooms.lock:
            r = p.rooms.get(room_id)
            told = None if r is None else self._conclude_locked(r, reason, label, decode_knows)
        return self._tell(room_id, told)

    def fail_life(self, r: PrefillRoom, reason: str, label: str) -> bool:
        """Like fail() for a life the caller holds (it may be draining, no longer current)."""
        with self.p.rooms.lock:
            told = self._conclude_locked(r, reason, label, False)
        return self._tell(r.room, told)

    def _conclude_locked(self, r: PrefillRoom, reason: str, label: str, decode_knows: bool):
        """The transition and SGLang's update, under the registry lock; returns (addresses,
        reason) for decode, or None when the room had concluded already."""
        p = self.p
        if not r.conclude(False, reason, p.clock()):
            return None
        # SGLang's tables change only while the sender holds the room: a failure recorded after
        # its clear() would have no reader (and a later request reusing the id would adopt it;
        # claim() drops such a leftover anyway, for the window SGLang's own code shares).
        if r.claimed and p.sglang.status(r.room) is not None:
            p.sglang.fail(r.room, reason)
            reason = p.sglang.failure_reason(r.room) or reason
        p.rooms.notify_locked()
        logger.warning("sglang-mori: room %s failed: %s", r.room, reason)
        p.metrics.request_finished(ok=False, reason=label)
        return ([] if decode_knows else r.notify_addresses()), reason

    def _tell(self, room_id: int, told) -> bool:
        """Tell decode outside the lock (a send to a dead peer must not hold every room up)."""
        if told is None:
            return False
        addresses, reason = told
        self.notify_decode(room_id, addresses, reason)
        return True

    def notify_decode(self, room_id: int, addresses: list, reason: Optional[str]) -> None:
        message = protocol.RoomStatus(room=room_id, status=room_status.FAILED, prefill_rank=self.p.sglang.prefill_rank,
                                      reason=reason)
        self.p.messenger.send_all(addresses, message)

