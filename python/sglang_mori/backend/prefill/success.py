"""A room's Success, decided by whichever thread sees the room complete.

A room may succeed once its last chunk is tracked, no submitter holds a token on it and every
write it tracked succeeded (`PrefillRoom.ready_to_succeed`). The thread that makes this true
decides at once, instead of waking another thread to look (each wake-up waits for the GIL
against SGLang's scheduler loop, docs/benchmarks.md "Where PD's 8K TTFT goes"):

- the completion thread, when the room's last running write finishes (completion.py);
- a shard thread after tracking a last chunk, or the layer-wise worker after a batch's end
  marker, when the writes before were done already;
- SGLang's scheduler thread, when layer-wise streaming left its last `send()` nothing to write
  (service.track_last_without_writes): the pages were written during the forward.

Each caller decides under the registry lock and `rooms.succeed` decides again there, so however
many threads try, one Success goes out, and only for a room whose writes all succeeded.
"""

from __future__ import annotations

from sglang_mori.backend import room_status
from sglang_mori.backend.prefill.effects import RoomEffects
from sglang_mori.backend.prefill.parts import PrefillParts
from sglang_mori.backend.prefill.rooms import PrefillRoom


class SuccessDecider:
    def __init__(self, parts: PrefillParts, effects: RoomEffects):
        self.p = parts
        self.effects = effects

    def try_succeed(self, r: PrefillRoom, *, never_block: bool = False, seen_done: bool = False) -> bool:
        """Conclude `r` Success if it is ready now; True if this call did. The first look only
        spares the aux read for rooms that are not done; `rooms.succeed` decides again on the room
        as it is when it concludes. `never_block`: the caller is SGLang's scheduler thread, whose
        Success message must not wait for a full send queue (a decode that stopped reading).
        `seen_done`: the caller (the completion thread) has just seen every write of `r` succeed,
        so the room is most likely ready: one lock hold decides and concludes it, the aux read
        inside (a copy of a few bytes, or the transfer process's dict lookup), instead of a look
        under the lock, the read outside and a second hold (issue 28: the copy's end to Success)."""
        p = self.p
        now = p.clock()
        if seen_done:
            with self.effects.transition(never_block=never_block) as fx:
                return self._succeed_locked(r, r.aux_index, now, fx)
        with p.rooms.lock:
            if not r.ready_to_succeed(now):
                return False
            aux_index = r.aux_index
        aux = p.read_aux(aux_index) if p.owns_aux else None
        with self.effects.transition(never_block=never_block) as fx:
            if p.sglang.status(r.room) == room_status.FAILED:
                return False
            return p.rooms.succeed(r, aux_index, aux, now, fx)

    def _succeed_locked(self, r: PrefillRoom, aux_index, now: float, fx) -> bool:
        """`rooms.succeed` with the aux read here, the registry lock held (try_succeed's
        `seen_done`). `rooms.succeed` decides whether the room is ready; the aux of a room that
        is not (read for nothing) is a few bytes."""
        p = self.p
        if p.sglang.status(r.room) == room_status.FAILED:
            return False
        aux = p.read_aux(aux_index) if p.owns_aux else None
        return p.rooms.succeed(r, aux_index, aux, now, fx)
