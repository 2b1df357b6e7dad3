"""Thread CPU time per role, with the time inside engine calls kept apart.

Every thread's CPU clock (pthread_getcpuclockid, nanoseconds) is read at the start and the end of a
measured window; the scheduler thread's own calls into us are timed one by one with
time.thread_time_ns, since the same thread also runs the harness. softio's IOEngine entry points
are wrapped so the CPU spent inside them is charged to "engine" on the calling thread: on MORI-IO
that is C++ that releases the GIL, so it is not our Python, while the call itself, its arguments and
everything around it are.
"""

from __future__ import annotations

import re
import threading
import time
from contextlib import contextmanager

# The IOEngine methods our backend calls per request whose inside is the engine's work. Status reads
# and allocate_transfer_uid are our calls, kept ours (wrapping 61 of them per chunk would cost more
# than they do; on MORI-IO each is a pybind call that costs about what softio's attribute read does:
# an atomic counter or a field read).
ENGINE_CALLS = ("batch_write", "create_session", "pop_peer_failure")


def role(name: str) -> str:
    """'mori-shard-3' -> 'mori-shard-N': threads of one role are summed."""
    return re.sub(r"\d+", "N", name)


def _thread_clock_ns(thread: threading.Thread):
    try:
        return time.clock_gettime_ns(time.pthread_getcpuclockid(thread.ident))
    except (OSError, TypeError, ProcessLookupError):  # ended meanwhile
        return None


class ThreadClocks:
    """CPU ns per thread (by ident) since `start()`, summed by role at `since()`."""

    def __init__(self):
        self._start: dict = {}

    def start(self) -> None:
        self._start = {t.ident: _thread_clock_ns(t) or 0 for t in threading.enumerate()}

    def since(self) -> dict:
        out: dict = {}
        for t in threading.enumerate():
            now = _thread_clock_ns(t)
            if now is None:
                continue
            used = now - self._start.get(t.ident, 0)
            key = role(t.name)
            out[key] = out.get(key, 0) + used
        return out


class EngineMeter:
    """CPU ns spent inside softio's IOEngine calls, per calling thread role."""

    def __init__(self):
        self._lock = threading.Lock()
        self.ns: dict = {}
        self.calls: dict = {}

    def reset(self) -> None:
        with self._lock:
            self.ns.clear()
            self.calls.clear()

    def _add(self, ns: int) -> None:
        key = role(threading.current_thread().name)
        with self._lock:
            self.ns[key] = self.ns.get(key, 0) + ns
            self.calls[key] = self.calls.get(key, 0) + 1

    def _wrap(self, cls, name: str):
        original = getattr(cls, name)
        meter = self

        def timed(*args, **kwargs):
            start = time.thread_time_ns()
            try:
                return original(*args, **kwargs)
            finally:
                meter._add(time.thread_time_ns() - start)

        setattr(cls, name, timed)
        return original


@contextmanager
def metered_engine():
    from sglang_mori.softio.engine import IOEngine

    meter = EngineMeter()
    originals = [(name, meter._wrap(IOEngine, name)) for name in ENGINE_CALLS]
    try:
        yield meter
    finally:
        for name, original in originals:
            setattr(IOEngine, name, original)


class CallMeter:
    """The scheduler thread's calls into us, timed one by one (thread CPU ns), by call name."""

    def __init__(self):
        self.ns: dict = {}
        self.enabled = False

    def reset(self) -> None:
        self.ns.clear()

    @contextmanager
    def call(self, name: str):
        if not self.enabled:
            yield
            return
        start = time.thread_time_ns()
        try:
            yield
        finally:
            self.ns[name] = self.ns.get(name, 0) + time.thread_time_ns() - start
