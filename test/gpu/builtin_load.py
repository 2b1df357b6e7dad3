"""Background load in SGLang's built-in mori backend's pattern, for the interference comparison
(scripts/gpu_bench.py --parts interference): as its `send_kvcache` posts a request, one
`batch_write` per layer buffer over the request's contiguous page runs, from one transfer thread
that then waits for the request's statuses (as its transfer worker does), through the same softio
engine and into the same decode memory as ours.

What it leaves out, and so only flatters the built-in: its bootstrap and status messages, its
queues and room bookkeeping, its aux write. What it keeps is what the issue asks to compare: the
Python a backend runs per request beside the forward, here the smallest the built-in can run."""

from __future__ import annotations

import queue
import threading
import time

from link_bench import EngineCalls


class BuiltinPatternLoad:
    def __init__(self, rig, reqs):
        self.calls = [EngineCalls(rig, reqs, i) for i in range(reqs.count)]
        self._todo: "queue.Queue" = queue.Queue()
        self._idle = threading.Condition()
        self._pending = 0
        self.failures = 0
        self._thread = threading.Thread(target=self._run, name="builtin-transfer-worker", daemon=True)
        self._thread.start()

    def due(self, rate: float, start: float, sent: int) -> int:
        """Queue the requests due by now at `rate`; the new count sent."""
        due = int((time.perf_counter() - start) * rate) - sent
        for k in range(max(0, due)):
            with self._idle:
                self._pending += 1
            self._todo.put((sent + k) % len(self.calls))
        return sent + max(0, due)

    def _run(self) -> None:
        while True:
            k = self._todo.get()
            if k is None:
                return
            try:
                EngineCalls.wait(self.calls[k].post("builtin_calls"))
            except RuntimeError:
                self.failures += 1
            with self._idle:
                self._pending -= 1
                self._idle.notify_all()

    def drain(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        with self._idle:
            while self._pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{self._pending} built-in-pattern requests still pending")
                self._idle.wait(left)

    def close(self) -> None:
        self._todo.put(None)
        self._thread.join(5)
