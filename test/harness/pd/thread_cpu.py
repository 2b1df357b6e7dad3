"""CPU seconds per thread of this process, grouped by the thread's role
(for `scripts/bench_backend.py transfer --thread-cpu`).

Linux keeps each thread's user and system time in /proc/self/task/<tid>/stat; Python names its
threads but (before 3.14) does not give the kernel that name, so the tid is mapped to the Python
thread's name through `Thread.native_id`. Threads of one role (shard-0..7, lane0..3) are summed
under one name with the digits removed, so backends with different thread counts compare.
"""

from __future__ import annotations

import os
import re
import threading

_TICKS = os.sysconf("SC_CLK_TCK")


def _ticks_by_tid() -> dict:
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        # Fields after the parenthesised command name; utime and stime are the 14th and 15th.
        fields = stat[stat.rindex(")") + 2 :].split()
        out[int(tid)] = int(fields[11]) + int(fields[12])
    return out


def role(name: str) -> str:
    """'mori-shard-3' -> 'mori-shard-N'; 'softio-lane2-x-127.0-rx' -> 'softio-laneN-x-N.N-rx'."""
    return re.sub(r"\d+", "N", name)


class ThreadCpu:
    """Snapshot at start; `since()` gives {role: CPU seconds} used from then on (threads that ended
    meanwhile are lost: their time is no longer in /proc)."""

    def __init__(self):
        self._start = _ticks_by_tid()

    def since(self) -> dict:
        names = {t.native_id: t.name for t in threading.enumerate()}
        out: dict = {}
        for tid, ticks in _ticks_by_tid().items():
            used = ticks - self._start.get(tid, 0)
            if used <= 0:
                continue
            key = role(names.get(tid, f"native-{tid}"))
            out[key] = out.get(key, 0.0) + used / _TICKS
        return out
