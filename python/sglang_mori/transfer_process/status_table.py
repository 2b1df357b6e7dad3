"""The status table: shared memory the transfer process writes and the scheduler reads.

One slot per room life, chosen by the scheduler at claim and named in the claim record. The child
writes a slot's reason, decode prefix length and destination count before its status, so a reader
that sees a status sees what goes with it (x86 stores are seen in order; numpy writes are plain
stores). The scheduler reads a status with one array index, no message: `poll()` costs about what a
dict lookup does. A slot is reused only after the child set `released` (it will never write it
again), so a late write of one room never lands in the next room's slot.
"""

from __future__ import annotations

import mmap
import os
from multiprocessing import shared_memory
from typing import Optional

import numpy as np

NO_STATUS = -1
REASON_BYTES = 240
DEFAULT_SLOTS = 4096

# (name, dtype, items per slot)
_FIELDS = (
    ("status", np.int8, 1),
    ("released", np.int8, 1),
    ("replicas", np.int32, 1),  # required_dst_info_num of the room's destinations
    ("prefix", np.int64, 1),  # decode_prefix_len
    ("reason", np.uint8, REASON_BYTES),
)
_HEADER = 64  # int64 words: [0] the child's control port, [1] ready flag, [2] start-up failed flag,
_STARTUP_REASON_WORD = 8  # words 8.. hold the start-up failure's reason (UTF-8, NUL-terminated)


def _table_bytes(slots: int) -> int:
    return _HEADER * 8 + sum(np.dtype(dt).itemsize * n * slots for _, dt, n in _FIELDS)


class StatusTable:
    def __init__(self, shm, buf, slots: int):
        self.shm, self.slots = shm, slots  # shm: the owner's SharedMemory, None in the child
        self._map = None if shm is not None else buf
        self.header = np.ndarray((_HEADER,), np.int64, buf, 0)
        offset = _HEADER * 8
        for name, dt, n in _FIELDS:
            shape = (slots,) if n == 1 else (slots, n)
            setattr(self, name, np.ndarray(shape, dt, buf, offset))
            offset += np.dtype(dt).itemsize * n * slots

    @classmethod
    def create(cls, slots: int = DEFAULT_SLOTS) -> "StatusTable":
        shm = shared_memory.SharedMemory(create=True, size=_table_bytes(slots))
        table = cls(shm, shm.buf, slots)
        table.status[:] = NO_STATUS
        table.released[:] = 1
        return table

    @classmethod
    def attach(cls, name: str, slots: int) -> "StatusTable":
        # Mapped directly, not through SharedMemory: in the child that would register the segment
        # with multiprocessing's resource tracker a second time (Python 3.11 has no track=False).
        fd = os.open(f"/dev/shm/{name.lstrip('/')}", os.O_RDWR)
        try:
            buf = mmap.mmap(fd, _table_bytes(slots))
        finally:
            os.close(fd)
        table = cls(None, buf, slots)
        table._name = name
        return table

    @property
    def name(self) -> str:
        return self.shm.name if self.shm is not None else self._name

    # --- the child's side --------------------------------------------------------------------
    def publish_port(self, port: int) -> None:
        self.header[0] = port
        self.header[1] = 1

    def publish_startup_failure(self, reason: str) -> None:
        """The child could not start (its pools, its engine, the registration proof): the reason
        first, then the flag the scheduler waits on."""
        area = self.header[_STARTUP_REASON_WORD:].view(np.uint8)
        raw = reason.encode("utf-8", "replace")[:len(area) - 1]
        area[:len(raw)] = np.frombuffer(raw, np.uint8)
        area[len(raw)] = 0
        self.header[2] = 1

    def write(self, slot: int, status: int, reason: Optional[str] = None, replicas: int = 0,
              prefix: int = 0) -> None:
        if reason is not None:
            raw = reason.encode("utf-8", "replace")[:REASON_BYTES - 1]
            self.reason[slot, :len(raw)] = np.frombuffer(raw, np.uint8)
            self.reason[slot, len(raw)] = 0
        if replicas:
            self.replicas[slot] = replicas
            self.prefix[slot] = prefix
        self.status[slot] = status

    def mark_released(self, slot: int) -> None:
        self.released[slot] = 1

    # --- the scheduler's side ----------------------------------------------------------------
    def ready_port(self) -> Optional[int]:
        return int(self.header[0]) if self.header[1] else None

    def startup_failure(self) -> Optional[str]:
        if not self.header[2]:
            return None
        raw = self.header[_STARTUP_REASON_WORD:].view(np.uint8).tobytes()
        return raw.split(b"\0", 1)[0].decode("utf-8", "replace")

    def open_slot(self, slot: int) -> None:
        self.status[slot] = NO_STATUS
        self.replicas[slot] = 0
        self.prefix[slot] = 0
        self.reason[slot, 0] = 0
        self.released[slot] = 0

    def read_reason(self, slot: int) -> str:
        raw = self.reason[slot].tobytes()
        return raw.split(b"\0", 1)[0].decode("utf-8", "replace")

    def close(self) -> None:
        # Drop the views before closing the mapping (BufferError otherwise).
        for name, _, _ in _FIELDS:
            setattr(self, name, None)
        self.header = None
        if self.shm is None:
            self._map.close()
            return
        self.shm.close()
        self.shm.unlink()
