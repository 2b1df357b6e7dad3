"""Optional log, on the target, of every write that landed in its registered memory.

Tests use it to prove facts a status cannot show, e.g. that no byte landed in a page after the
page was released. Enable it with SGLANG_MORI_SOFTIO_RECORD_WRITES=1 before the engine is created,
or with `enable_write_log(engine)`. Times are `time.monotonic()` taken after the last byte of the
write landed; CLOCK_MONOTONIC is system-wide on Linux, so times from different processes on one
host compare directly.
"""

from __future__ import annotations

import collections
import os
from typing import NamedTuple

RECORD_WRITES_ENV = "SGLANG_MORI_SOFTIO_RECORD_WRITES"
DEFAULT_MAX_RECORDS = 1_000_000


class WriteRecord(NamedTuple):
    region_id: int  # MemoryDesc.id of the target region
    offset: int  # byte offset inside the region
    size: int  # bytes written by this frame (one merged range)
    time: float  # time.monotonic() when the last byte landed
    initiator_key: str  # engine key of the writer


class WriteLog:
    def __init__(self):
        self.enabled = os.environ.get(RECORD_WRITES_ENV, "").strip().lower() in ("1", "true", "on")
        self._records: collections.deque = collections.deque(maxlen=DEFAULT_MAX_RECORDS)

    def enable(self, max_records: int = DEFAULT_MAX_RECORDS) -> None:
        if self._records.maxlen != max_records:
            self._records = collections.deque(self._records, maxlen=max_records)
        self.enabled = True

    def record(self, region_id: int, offset: int, size: int, time: float, initiator: str) -> None:
        self._records.append(WriteRecord(region_id, offset, size, time, initiator))

    def snapshot(self, region_id: int | None = None) -> list:
        records = list(self._records)  # deque copies are atomic under the GIL
        if region_id is None:
            return records
        return [r for r in records if r.region_id == region_id]

    def clear(self) -> None:
        self._records.clear()


def _log(engine) -> WriteLog:
    core = getattr(engine, "_core", engine)
    if not hasattr(core, "write_log"):
        raise TypeError("the write log exists on softio IOEngine objects only")
    return core.write_log


def enable_write_log(engine, max_records: int = DEFAULT_MAX_RECORDS) -> None:
    """Start recording writes that land in this engine's memory (oldest dropped past the cap)."""
    _log(engine).enable(max_records)


def disable_write_log(engine) -> None:
    _log(engine).enabled = False


def get_write_log(engine, region_id: int | None = None) -> list:
    """The recorded writes, oldest first, optionally only those into one region id."""
    return _log(engine).snapshot(region_id)


def clear_write_log(engine) -> None:
    _log(engine).clear()
