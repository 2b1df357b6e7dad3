"""CPU time spent inside the engine's own calls, per calling thread role.

The interference report charges a thread role's CPU to the backend, but our shard and completion
threads also run the engine's calls (`batch_write` above all). On MORI-IO those are C++ and release
the GIL; on softio they are Python and hold it. This meter wraps softio's IOEngine entry points
with `time.thread_time()` so the report can split a role's CPU into "ours" and "the engine's".
Status reads (`Code()`) are left out: they are cheap, and timing each would cost more than it.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

from thread_roles import role

# The IOEngine methods our backend calls per request (setup calls are left out on purpose).
_ENGINE_CALLS = ("batch_write", "allocate_transfer_uid", "create_session", "pop_peer_failure")


class EngineMeter:
    def __init__(self):
        self._lock = threading.Lock()
        self._seconds: dict = {}
        self._depth = threading.local()  # nested engine calls are timed once, at the outermost

    def add(self, seconds: float) -> None:
        key = role(threading.current_thread().name)
        with self._lock:
            self._seconds[key] = self._seconds.get(key, 0.0) + seconds

    def reset(self) -> None:
        with self._lock:
            self._seconds.clear()

    def since_reset(self) -> dict:
        with self._lock:
            return dict(self._seconds)

    def _wrap(self, cls, name: str):
        original = getattr(cls, name)
        meter = self

        def timed(*args, **kwargs):
            depth = getattr(meter._depth, "n", 0)
            meter._depth.n = depth + 1
            start = time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                meter._depth.n = depth
                if depth == 0:
                    meter.add(time.thread_time() - start)

        setattr(cls, name, timed)
        return original


@contextmanager
def metered_engine():
    """Patch softio's IOEngine for the duration; yields the EngineMeter."""
    from sglang_mori.softio.engine import IOEngine

    meter = EngineMeter()
    originals = [(IOEngine, name, meter._wrap(IOEngine, name)) for name in _ENGINE_CALLS]
    try:
        yield meter
    finally:
        for cls, name, original in originals:
            setattr(cls, name, original)
