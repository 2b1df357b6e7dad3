"""CPU time of a process's threads from /proc, by thread name.

The transfer process logs its start-up CPU (imports, the engine, mapping and proving the pools)
apart from what its threads spend afterwards, by thread: a figure of CPU per request taken over
the child's whole life is mostly start-up at light load (on the GPU host, importing torch and
creating a CUDA context alone take seconds). Read in the process itself, a thread is named after
its Python thread (by native id; their OS names are all the interpreter's); native threads (the
engine's, libzmq's, the GPU runtime's) keep their kernel names.
"""

from __future__ import annotations

import os
import threading
from typing import Dict

_TICKS = os.sysconf("SC_CLK_TCK")


def _task_cpu_s(pid, tid: str) -> float:
    with open(f"/proc/{pid}/task/{tid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS  # utime + stime


def threads_cpu_s(pid="self") -> Dict[str, float]:
    """{thread name: CPU seconds since it started}, threads of one name summed. For this process
    the names are the Python threads' (by native id); else the kernel's `comm`."""
    names = {}
    if pid == "self":
        names = {str(t.native_id): t.name for t in threading.enumerate() if t.native_id is not None}
    out: Dict[str, float] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return out
    for tid in tids:
        try:
            name = names.get(tid)
            if name is None:
                with open(f"/proc/{pid}/task/{tid}/comm") as f:
                    name = f.read().strip()
            out[name] = out.get(name, 0.0) + _task_cpu_s(pid, tid)
        except (FileNotFoundError, ProcessLookupError):  # ended meanwhile
            continue
    return out


def process_cpu_s(pid) -> float:
    """utime + stime of a whole process (its live and ended threads) so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


def since(before: Dict[str, float], after: Dict[str, float]) -> Dict[str, float]:
    """CPU seconds per thread name between two readings, largest first, zeros left out."""
    used = {k: v - before.get(k, 0.0) for k, v in after.items()}
    return dict(sorted(((k, v) for k, v in used.items() if v > 0), key=lambda kv: -kv[1]))


def describe(used: Dict[str, float], limit: int = 8) -> str:
    return ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in list(used.items())[:limit]) or "nothing measurable"
