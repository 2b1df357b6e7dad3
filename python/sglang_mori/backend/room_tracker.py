"""Prefill-side bookkeeping of every room with writes in flight.

A room stays here from its first submitted chunk until every status it ever issued is terminal
(quiescent), even after it has concluded: a failed or aborted room may still have writes landing in
decode pages, so its abort ACK (which lets decode reuse those pages) waits for the drain.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Optional

from sglang_mori.engine.transfer_engine import IN_PROGRESS, SUCCESS, TransferHandle


@dataclass
class RoomTransfer:
    room: int
    targets: list  # [(ip, port, engine_key, decode aux index)]
    handles: list = field(default_factory=list)  # TransferHandle, each with its deadline
    deadlines: list = field(default_factory=list)
    last_submitted: bool = False
    aux_index: Optional[int] = None
    concluded: bool = False
    concluded_at: float = 0.0
    bytes_submitted: int = 0
    engine_ops: int = 0
    chunks: int = 0
    started_at: float = field(default_factory=time.monotonic)
    # Set once draining has given up on proving quiescence (a write we cannot account for).
    poisoned: bool = False
    succeeded: bool = False  # concluded with Success

    def add(self, handle: TransferHandle, deadline: float) -> None:
        self.handles.append(handle)
        self.deadlines.append(deadline)
        self.bytes_submitted += handle.nbytes
        self.engine_ops += 1

    def verdict(self, now: float) -> tuple:
        """(code, reason): SUCCESS when every handle succeeded, IN_PROGRESS, or a failure."""
        running = False
        for handle, deadline in zip(self.handles, self.deadlines):
            code = handle.result()
            if code == IN_PROGRESS:
                if now > deadline:
                    late_ms = (now - handle.started_at) * 1000
                    return -1, (
                        f"KV transfer to decode engine {handle.peer_key} timed out: not complete "
                        f"after {late_ms:.0f} ms (SGLANG_MORI_TRANSFER_TIMEOUT_MS)"
                    )
                running = True
            elif code != SUCCESS:
                return code, (
                    f"KV transfer to decode engine {handle.peer_key} failed: "
                    f"{handle.failure_message()}"
                )
        return (IN_PROGRESS, "") if running else (SUCCESS, "")

    def conclude(self, now: float) -> None:
        self.concluded = True
        self.concluded_at = now

    def unfinished(self) -> list:
        return [h for h in self.handles if not h.quiescent()]

    def drain_proven(self) -> bool:
        """No write of this room can still land (see TransferHandle.drained)."""
        return all(h.drained() for h in self.handles)


class RoomTracker:
    def __init__(self):
        self._lock = threading.Lock()
        self._rooms: dict[int, RoomTransfer] = {}
        self.wakeup = threading.Condition(self._lock)
        self.generation = 0

    def get_or_create(self, room: int, targets: list) -> tuple:
        with self._lock:
            existing = self._rooms.get(room)
            if existing is not None:
                return existing, False
            rt = RoomTransfer(room=room, targets=targets)
            self._rooms[room] = rt
            return rt, True

    def get(self, room: int) -> Optional[RoomTransfer]:
        with self._lock:
            return self._rooms.get(room)

    def remove(self, room: int) -> None:
        with self._lock:
            self._rooms.pop(room, None)

    def snapshot(self) -> list:
        with self._lock:
            return list(self._rooms.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._rooms)

    def notify(self) -> None:
        """Something changed (writes submitted, an abort registered): wake the completion thread."""
        with self._lock:
            self.generation += 1
            self.wakeup.notify_all()

    def wait_for_change(self, seen_generation: int, timeout: float) -> None:
        """Sleep until notify() has been called since `seen_generation` was read, or timeout.

        The completion thread must never spin: with no write running (a chunked prefill between
        two chunks) a busy loop would hold the GIL against the scheduler computing the next chunk.
        """
        with self._lock:
            if self.generation == seen_generation:
                self.wakeup.wait(timeout)
