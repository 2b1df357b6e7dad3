"""Prefill's write fence: stop a failed room's writes before decode frees the pages they target.

Decode's SGLang holds a failed room's pages until prefill acks the abort, but only for
SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT (30 s by default); then it frees them
("releasing anyway") and gives them to the next request. A write still queued on a stalled link at
that moment would land in someone else's KV once the link moves again. So a concluded room whose
writes are still in flight `after_s` after it failed (that timeout less SGLANG_MORI_DRAIN_FENCE_MARGIN_S)
has its decode peers fenced: the engine resets its connections to them, every write posted before
fails and none can land, and the room's handles count as drained, so its abort ACK goes out.

The fence is per peer (the engine cannot stop one room's writes on a shared connection): every
write in flight to that peer fails too, with the fence named in its reason. Those writes were
queued behind the stuck ones on the same lanes. The peer itself is not marked failed; later writes
go over fresh connections.

Engines without a fence (MORI-IO, see docs/reliability.md) keep the old course: the room is given
up on after DRAIN_GIVE_UP_DEADLINES transfer deadlines, poisoned, and never acked.
"""

from __future__ import annotations

import logging
import math
from typing import Optional

from sglang_mori.backend.prefill.parts import PrefillParts
from sglang_mori.backend.prefill.rooms import PrefillRoom

logger = logging.getLogger(__name__)


def fence_after_s(release_timeout_s: float, margin_s: float, give_up_after_s: float) -> float:
    """Seconds after a room's failure at which its writes still in flight are fenced: before
    decode's release timeout by the margin, never later than the give-up, and never sooner than
    half the release timeout. The fence fails every write to that decode, other rooms' too, so
    it is for writes that are stuck, not for the last writes of an abort that are still landing:
    with a short release timeout (5 s) and the 10 s margin, fencing at once failed healthy
    requests to the same decode (the quick soak)."""
    return min(give_up_after_s, max(release_timeout_s / 2, release_timeout_s - margin_s))


class WriteFence:
    def __init__(self, parts: PrefillParts, give_up_deadlines: int):
        self.p = parts
        self._give_up_deadlines = give_up_deadlines
        self._derived = False
        self._after_s: Optional[float] = None
        self.release_timeout_s = 0.0

    @property
    def after_s(self) -> Optional[float]:
        """None: the engine cannot fence (MORI-IO), or decode does not hold pages for an ACK.
        Derived on first use, from settings that do not change while the service runs."""
        if not self._derived:
            p = self.p
            if p.engine.can_fence and p.sglang.deferred_release:
                self.release_timeout_s = float(p.sglang.decode_release_timeout_s)
                self._after_s = fence_after_s(self.release_timeout_s, p.config.drain_fence_margin_s,
                                              self._give_up_deadlines * p.timeout_s)
            self._derived = True
        return self._after_s

    def give_up_after(self, r: PrefillRoom, give_up_after_s: float) -> float:
        """How long after its failure `r` may be given up on (poisoned, never acked): never while
        its fence is pending, which comes first and may make it drained; the give-up otherwise
        (an engine without a fence, or writes the fence did not cover)."""
        return math.inf if self.after_s is not None and not r.fenced else give_up_after_s

    def due(self, r: PrefillRoom, now: float) -> bool:
        """Unlocked look: `r` failed `after_s` ago, is not fenced yet, and still has writes running."""
        if not r.concluded or r.terminal or r.fenced or self.after_s is None:
            return False
        return now - r.concluded_at >= self.after_s and bool(r.unfinished())

    def fence(self, r: PrefillRoom, now: float) -> None:
        """Fence the peers of `r`'s running writes. The handles marked fenced are those tracked
        before the engine's fence (under the registry lock, where submitters track theirs): a
        handle tracked later may have been posted on the new connections."""
        p = self.p
        with p.rooms.lock:
            if r.fenced or r.terminal:
                return
            r.fenced = True  # once: a straggler it did not cover falls back to the give-up
            keys = {h.peer_key for h in r.unfinished()}
            covered = [w.handle for room in p.rooms.with_writes() for w in room.writes
                       if w.handle.peer_key in keys]
            running = {key: sum(1 for h in covered if h.peer_key == key and not h.quiescent()) for key in keys}
        reason = (f"room {r.room} failed {now - r.concluded_at:.1f} s ago with writes still in flight, and decode "
                  f"frees its pages {self.release_timeout_s:.0f} s after the failure")
        fenced = set()
        for key in sorted(keys):
            if not p.engine.fence_peer(key, reason):
                logger.error("sglang-mori: room %s: decode engine %s cannot be fenced (device copies); its %d writes "
                             "in flight keep the room until they end or are given up on", r.room, key, running[key])
                continue
            fenced.add(key)
            peer = p.peers.get(key)
            if peer is not None:
                with peer.session_lock:
                    peer.open_pairs.clear()  # the next write dials the peer before posting
            logger.error("sglang-mori: fenced decode engine %s: %s; its %d writes in flight failed and cannot "
                         "land", key, reason, running[key])
        with p.rooms.lock:
            for handle in covered:
                if handle.peer_key in fenced:
                    handle.fenced = True
            p.rooms.notify_locked()
