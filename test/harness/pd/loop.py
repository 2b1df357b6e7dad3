"""The event loop both worker sides share: open rooms (all at once or a bounded window), step each
open room once per pass, stop at a deadline.

One pass over all open rooms stands for one scheduler iteration: every room advances by at most
one action per pass (one poll, or one send() of one chunk), so the rooms' sends interleave the way
chunked prefill interleaves requests across forward passes. When a pass makes no progress the loop
naps for a millisecond so the backend's own threads get the CPU (this is a poll loop, not a wait on
any particular event).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable, List, Optional

from harness.pd.plan import RoomPlan
from harness.pd.results import TIMED_OUT, RoomOutcome

IDLE_NAP_S = 0.001


class RoomState:
    """Per-room bookkeeping common to both sides; drivers add their own attributes."""

    def __init__(self, plan: RoomPlan, t_open: Optional[float]):
        self.plan = plan
        self.phase = "open"
        self.done = False
        self.outcome = RoomOutcome(index=plan.index, room=plan.room, status=TIMED_OUT, t_open=t_open)

    def release_refs(self) -> None:
        """Drop what a finished room no longer needs (its sender/receiver and their manager
        state), so a long run keeps only outcomes (the soak measures process RSS growth)."""
        for name in ("sender", "receiver", "mgr"):
            if name in self.__dict__:
                setattr(self, name, None)

    def finish(self, status: int, t: float, failure: Optional[str] = None) -> None:
        self.outcome.status = status
        self.outcome.failure = failure
        self.outcome.t_done = t
        self.done = True


def drive(
    rooms: List[RoomPlan],
    open_room: Callable[[RoomPlan], RoomState],
    step_room: Callable[[RoomState], bool],
    expire_room: Callable[[RoomState], None],
    max_inflight: Optional[int],
    deadline: float,
    on_pass: Optional[Callable[[List[RoomState], List[RoomState]], None]] = None,
    may_open: Optional[Callable[[RoomPlan, List[RoomState]], bool]] = None,
) -> List[RoomOutcome]:
    """Run every room to a terminal state or to `deadline` (time.monotonic()); outcomes by index.
    `may_open(room, active)` (optional) holds back the next room (e.g. until its round opens)."""
    pending = deque(rooms)
    active: List[RoomState] = []
    finished: List[RoomState] = []
    while pending or active:
        while (
            pending
            and (max_inflight is None or len(active) < max_inflight)
            and (may_open is None or may_open(pending[0], active))
        ):
            active.append(open_room(pending.popleft()))
        progressed = False
        for st in active:
            if not st.done:
                progressed = step_room(st) or progressed
        for st in active:
            if st.done:
                st.release_refs()
                finished.append(st)
        active = [st for st in active if not st.done]
        if on_pass is not None:
            on_pass(active, finished)
        if time.monotonic() > deadline:
            for st in active:
                if st.outcome.status == TIMED_OUT:
                    st.outcome.failure = f"no terminal status before the deadline (phase {st.phase})"
                expire_room(st)
            finished.extend(active)
            for r in pending:  # never opened: stays TIMED_OUT
                st = RoomState(r, None)
                st.outcome.failure = "never opened before the deadline"
                finished.append(st)
            break
        if not progressed:
            time.sleep(IDLE_NAP_S)
    return sorted((st.outcome for st in finished), key=lambda o: o.index)
