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
