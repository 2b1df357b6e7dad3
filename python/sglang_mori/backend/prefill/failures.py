"""The one way a prefill room fails: record the reason, update SGLang, count it, tell decode.

Nothing else concludes a prefill room as failed (test_failure_doors.py checks the source). The
door records the conclusion and its effects (effects.py); the applier updates SGLang, counts the
failure, and tells decode after the registry lock is let go.
"""

from __future__ import annotations

# Failed requests by cause (metrics label values), re-exported for the prefill side.
from sglang_mori.backend.failure_reasons import (  # noqa: F401
    ABORTED,
    BACKPRESSURE,
    BAD_INDEX,
    LAYOUT,
    OTHER,
    PEER_DEAD,
    PROTOCOL,
    SUBMIT_ERROR,
    TIMEOUT,
)
from sglang_mori.backend.prefill.effects import Effects, Failure, RoomEffects
from sglang_mori.backend.prefill.parts import PrefillParts
from sglang_mori.backend.prefill.rooms import PrefillRoom


# Failure reasons this rank states itself (others carry what went wrong: an engine's message, a
# peer's key, a deadline).
ABORTED_BY_DECODE = "Aborted by decode"
ABORTED_BEFORE_ARRIVAL = "Aborted by decode before the request reached prefill"
ABORTED_ON_PREFILL = "Aborted on prefill"
CLEARED_ON_PREFILL = "the request was cleared on prefill before its transfer ended"
FAILED_ON_PREFILL = "room failed on prefill"
NO_METADATA = "no destination metadata from decode for this room"
CHECKPOINT_HAZARD_TIMEOUT = ("layer-wise writes from pages a radix checkpoint freed did not finish before the "
                             "deadline (SGLANG_MORI_TRANSFER_TIMEOUT_MS)")


class PrefillFailures:
    def __init__(self, parts: PrefillParts, effects: RoomEffects):
        self.p = parts
        self.effects = effects

    def fail(self, room_id: int, reason: str, label: str, *, decode_knows: bool = False) -> bool:
        """Conclude the current life of `room_id` as failed; False if it had concluded already
        (the first cause wins) or does not exist.

        A claimed room is failed in SGLang (its sender polls Failed with the reason) and its decode
        ranks are told, unless `decode_knows` (decode's own abort). An unclaimed room (metadata
        came first) keeps the reason: its sender fails with it on arrival."""
        with self.effects.transition() as fx:
            r = self.p.rooms.get(room_id)
            return r is not None and self.conclude_locked(r, reason, label, fx, tell_decode=not decode_knows)

    def fail_life(self, r: PrefillRoom, reason: str, label: str) -> bool:
        """Like fail() for a life the caller holds (it may be draining, no longer current)."""
        with self.effects.transition() as fx:
            return self.conclude_locked(r, reason, label, fx)

    def conclude_locked(self, r: PrefillRoom, reason: str, label: str, fx: Effects, *,
                        tell_decode: bool = True) -> bool:
        """The door itself, inside a caller's `effects.transition()`."""
        if not r.conclude(False, reason, self.p.clock()):
            return False
        fx.failures.append(Failure(r.room, reason, label, r.notify_destinations() if tell_decode else [],
                                   in_sglang=r.claimed))
        return True
