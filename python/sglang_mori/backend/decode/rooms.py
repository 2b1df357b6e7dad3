"""Decode rooms: one state machine per room, in one registry under one lock.

    AWAITING_PREFILL --(TransferStarted: a chunk was submitted)--> TRANSFERRING --+--> SUCCEEDED
          |                  (each TransferStarted restarts the deadline)         |
          +-----------------------------------------------------------------------+--> FAILED

A room opens when its metadata is built (one attempt id per receiver, so prefill can tell a
retract-rebootstrap from a replay) and leaves when its receiver is cleared. The deadline runs only
once prefill has started writing: before that, SGLang's own waiting timeout applies.
Time is passed in; nothing here touches SGLang or sends anything.
"""

from __future__ import annotations

import enum
import itertools
import os
import secrets
import threading
from dataclasses import dataclass
from typing import Dict, List, Optional


class DecodePhase(enum.Enum):
    AWAITING_PREFILL = "awaiting_prefill"
    TRANSFERRING = "transferring"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


@dataclass(slots=True)
class DecodeRoom:
    room: int
    attempt: int
    aux_index: Optional[int]
    phase: DecodePhase = DecodePhase.AWAITING_PREFILL
    started_at: Optional[float] = None  # latest TransferStarted (one per chunk) from any prefill rank

    @property
    def open(self) -> bool:
        return self.phase is DecodePhase.AWAITING_PREFILL or self.phase is DecodePhase.TRANSFERRING


# Attempt ids: a random 61-bit start per process, then consecutive. Prefill keys replays by the id
# alone, so it must not repeat: within a process a counter never does, and two processes (or a
# restart) collide only if their random starts fall within as many ids of each other as either
# hands out. One C call per receiver (secrets.randbits read the OS's random source every time).
_attempt_ids = itertools.count(secrets.randbits(61) + 1)


def _new_start_after_fork() -> None:
    """A forked child must not continue its parent's sequence."""
    global _attempt_ids
    _attempt_ids = itertools.count(secrets.randbits(61) + 1)


os.register_at_fork(after_in_child=_new_start_after_fork)


def new_attempt_id() -> int:
    """A receiver attempt id, at least 1 and below 2**62 (msgpack's int64 with room to spare)."""
    return next(_attempt_ids)


class DecodeRoomRegistry:
    def __init__(self):
        # The applier (effects.py) holds it across its read of SGLang's status, SGLang's update
        # and the registry's change (fail, prefill_failed, prefill_succeeded), so decisions taken
        # on different threads are serialized: a failure and a Success never both count, and the
        # registry never closes a room one way while SGLang records the other. SGLang's own
        # writes (a receiver's abort or clear) do not take it; its update_status keeps Failed
        # terminal and never reopens a cleared room. Re-entrant: the applier calls finish() under it.
        self.lock = threading.RLock()
        self._rooms: Dict[int, DecodeRoom] = {}
        # The TRANSFERRING rooms, the only ones a deadline sweep must look at: the status thread
        # sweeps every SGLANG_MORI_WAIT_POLL_MS under this lock, and a decode under load holds
        # many more rooms awaiting prefill (receivers whose metadata is out) than transferring.
        self._transferring: Dict[int, DecodeRoom] = {}

    def open(self, room: int, attempt: Optional[int] = None) -> DecodeRoom:
        """A receiver starts on `room`: a new attempt (a previous one is replaced)."""
        r = DecodeRoom(room=room, attempt=attempt or new_attempt_id(), aux_index=None)
        with self.lock:
            self._rooms[room] = r
            self._transferring.pop(room, None)  # the replaced attempt's
        return r

    def set_aux_index(self, room: int, aux_index: Optional[int]) -> DecodeRoom:
        """The receiver publishes its destination (opening the room if nobody did)."""
        with self.lock:
            r = self._rooms.get(room)
            if r is None:
                r = self._rooms[room] = DecodeRoom(room=room, attempt=new_attempt_id(), aux_index=None)
            r.aux_index = aux_index
            return r

    def get(self, room: int) -> Optional[DecodeRoom]:
        with self.lock:
            return self._rooms.get(room)

    def current(self, room: int, attempt: int) -> Optional[DecodeRoom]:
        """`room` while `attempt` is its receiver's, else None (unknown, or another attempt)."""
        with self.lock:
            r = self._rooms.get(room)
            return r if r is not None and r.attempt == attempt else None

    def current_held(self, room: int, attempt: int) -> Optional[DecodeRoom]:
        """current(), for a caller that holds `lock` already (decode's Success path: one
        acquisition per message, issue 28)."""
        r = self._rooms.get(room)
        return r if r is not None and r.attempt == attempt else None

    def attempt_of(self, room: int) -> Optional[int]:
        with self.lock:
            r = self._rooms.get(room)
            return r.attempt if r is not None else None

    def transfer_started(self, room: int, attempt: int, now: float) -> bool:
        """Progress from prefill on `attempt`: (re)start the room's deadline. False for an unknown
        or closed room, or one whose receiver is another attempt (a late TransferStarted of a
        retracted attempt must not keep the next receiver's deadline from running out)."""
        with self.lock:
            r = self._rooms.get(room)
            if r is None or not r.open or r.attempt != attempt:
                return False
            r.phase = DecodePhase.TRANSFERRING
            r.started_at = now
            self._transferring[room] = r
            return True

    def finish(self, room: int, ok: bool) -> bool:
        """SUCCEEDED or FAILED, once; False when it was closed already (or is unknown)."""
        with self.lock:
            return self.finish_held(room, ok)

    def finish_held(self, room: int, ok: bool) -> bool:
        """finish(), for a caller that holds `lock` already."""
        r = self._rooms.get(room)
        if r is None or not r.open:
            return False
        r.phase = DecodePhase.SUCCEEDED if ok else DecodePhase.FAILED
        self._transferring.pop(room, None)
        return True

    def expired(self, now: float, deadline_s: float) -> List[DecodeRoom]:
        """Transferring rooms with no progress for `deadline_s`; each is reported once."""
        out = []
        with self.lock:
            for r in self._transferring.values():
                if r.phase is DecodePhase.TRANSFERRING and now - r.started_at > deadline_s:
                    r.started_at = now  # report once per deadline, the caller fails it
                    out.append(r)
        return out

    def forget(self, room: int, attempt: Optional[int] = None) -> None:
        """Drop `room` (only if it is still `attempt`, when given)."""
        with self.lock:
            r = self._rooms.get(room)
            if r is not None and (attempt is None or r.attempt == attempt):
                del self._rooms[room]
                self._transferring.pop(room, None)

    def __len__(self) -> int:
        with self.lock:
            return len(self._rooms)
