"""A room's last chunk: TransferStarted only if its writes outlive a short grace (issue 28).

TransferStarted moves decode's room to TRANSFERRING and (re)starts decode's own transfer deadline;
nothing else on decode depends on it (pages are protected by Abort/AbortAck). A last chunk whose
writes finish quickly is followed at once by the room's Success, which makes the announcement
moot: each message costs decode a receive (10-35 us of its scheduler's time, docs/benchmarks.md).
So the shard that posted a last chunk holds the announcement back (`defer`, under the registry
lock) for SGLANG_MORI_ANNOUNCE_GRACE_MS, and the completion thread, whose wait is bounded by the
earliest due time (`wait_s`), sends it (`fire`) only if the room is still open then. A room that
concludes first never sends it: decode gets one message, its Success or Failed.

`fire` sends under the registry lock (non-blocking): the room's Success or failure is decided under
that lock too and sent after it, so the send calls are ordered "TransferStarted, then the terminal
status", never the other way round. A send that finds decode's queue full is dropped (logged by the
messenger); decode then only misses its deadline's early start, as when prefill dies before posting.
Why this is safe is argued in docs/design.md ("TransferStarted, lazily").
"""

from __future__ import annotations

from typing import Iterable, Optional

from sglang_mori import protocol


class LazyAnnouncer:
    def __init__(self, parts):
        self.p = parts
        self.grace_s = max(0, parts.config.announce_grace_ms) / 1000.0

    @property
    def enabled(self) -> bool:
        return self.grace_s > 0

    def defer(self, r, targets, now: float) -> None:
        """Registry lock held: announce `targets` of room life `r` at `now + grace` if still open."""
        r.announce_at = now + self.grace_s
        r.announce_to = [(t.address, t.attempt) for t in targets]

    def fire(self, r, now: float) -> bool:
        """Send `r`'s held announcement if it is due and the room still open; True if sent. A
        concluded room's is dropped (its Success or Failed went or goes instead)."""
        if r.announce_at is None or now < r.announce_at:
            return False
        p = self.p
        with p.rooms.lock:
            targets, r.announce_at, r.announce_to = r.announce_to, None, None
            if r.concluded or not targets:
                return False
            rank = p.sglang.prefill_rank
            for address, attempt in targets:
                p.messenger.send(address, protocol.TransferStarted(room=r.room, attempt=attempt, prefill_rank=rank),
                                 block=False)
        return True

    def wait_s(self, rooms: Iterable, now: float, longest_s: float) -> float:
        """How long the completion thread may wait before the next held announcement is due."""
        due: Optional[float] = None
        for r in rooms:
            at = r.announce_at
            if at is not None and not r.concluded and (due is None or at < due):
                due = at
        return longest_s if due is None else max(0.0, min(longest_s, due - now))
