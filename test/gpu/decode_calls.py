"""The decode process's CPU by owner (issue 28): thread CPU inside this project's calls, apart from
the rig's own work on the same threads.

In a deployment SGLang's scheduler thread makes these calls between decode steps (the receiver's
init and its metadata, its clear, its polls); in the rig the first three run on the decode
process's MainThread beside the rig's pipe commands and FakeSGLang, and the poll on the step
thread. Per-thread CPU by role cannot tell ours from the rig's there: each call is wrapped on the
service object and timed with `time.thread_time` (the calling thread's CPU, so a call that waits
for the GIL is not charged the wait).
"""

from __future__ import annotations

import threading
import time

# The DecodeService calls SGLang's scheduler thread makes (receiver.py): a new receiver, its
# destination (RoomMetadata), its clear; and the step loop's poll of the inbox.
SCHEDULER_CALLS = ("new_receiver", "record_destination", "forget")
STEP_CALLS = ("poll_inbox",)


class TimedCalls:
    """CPU seconds and count of each named method of `target`, from its wrapping on (or the last
    `take`). A call made from inside another wrapped call is counted in the outer one only."""

    def __init__(self, target, names):
        self.names = [n for n in names if callable(getattr(target, n, None))]
        self.seconds = dict.fromkeys(self.names, 0.0)
        self.calls = dict.fromkeys(self.names, 0)
        self._local = threading.local()  # nesting depth per thread (MainThread and the step thread call at once)
        for name in self.names:
            setattr(target, name, self._timed(name, getattr(target, name)))

    def _timed(self, name: str, call):
        clock, local = time.thread_time, self._local

        def timed(*args, **kwargs):
            depth = getattr(local, "depth", 0)
            local.depth = depth + 1
            start = clock()
            try:
                return call(*args, **kwargs)
            finally:
                local.depth = depth
                if depth == 0:
                    self.seconds[name] += clock() - start
                    self.calls[name] += 1
        return timed

    def add(self, name: str, seconds: float, calls: int = 1) -> None:
        """Time spent outside a wrapped method (the receiver's encode of its metadata frames)."""
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds
        self.calls[name] = self.calls.get(name, 0) + calls

    def take(self) -> dict:
        """{name: (seconds, calls)} since the last take; the counters start again."""
        out = {n: (self.seconds[n], self.calls[n]) for n in self.seconds}
        for n in self.seconds:
            self.seconds[n], self.calls[n] = 0.0, 0
        return out


def meter_us_per_call(calls: int = 20000) -> float:
    """What TimedCalls' wrapper itself adds to one call (two thread_time reads and its bookkeeping):
    a wrapped no-op less the bare no-op, each timed in bulk. Decode's empty look at its inbox costs
    about an attribute read with the arrival flag (issue 28, session 20), less than this meter, so
    per-step poll figures are read against it."""
    class _Target:
        def noop(self):
            return 0

    bare, wrapped = _Target(), _Target()
    TimedCalls(wrapped, ("noop",))
    clock = time.perf_counter

    def run(target) -> float:
        call = target.noop
        start = clock()
        for _ in range(calls):
            call()
        return clock() - start

    run(bare), run(wrapped)  # warm
    return round(max(min(run(wrapped) for _ in range(3)) - min(run(bare) for _ in range(3)), 0.0) * 1e6 / calls, 3)


def us_per_request(taken: dict, requests: int) -> dict:
    """{name: us per request} of a `take`, with their total."""
    out = {n: round(s * 1e6 / max(requests, 1), 1) for n, (s, _) in taken.items()}
    out["total"] = round(sum(s for s, _ in taken.values()) * 1e6 / max(requests, 1), 1)
    return out


def merge(into: dict, taken: dict) -> dict:
    """Add one `take` into a running {name: (seconds, calls)}."""
    for n, (s, c) in taken.items():
        s0, c0 = into.get(n, (0.0, 0))
        into[n] = (s0 + s, c0 + c)
    return into
