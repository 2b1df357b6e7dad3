"""`bench hotpath --steps`: thread CPU per request inside named steps of our code, by thread role.

The per-role totals say which thread costs what; these say which step inside it. Each step is one
method, wrapped for the run so its thread CPU (time.thread_time_ns: kernel time of the wake-ups
and GIL hand-offs that happen inside it included) is added to (thread role, step). Steps nest
(a shard's `submit` holds `post`, which holds the plan and the engine call), so they do not sum
to the role's total; the wrapper itself costs about a microsecond per call.
"""

from __future__ import annotations

import importlib
import threading
import time
from contextlib import contextmanager

from harness.hotpath.meter import role

# (module, class, method, step name). A method missing in the counted checkout is skipped.
STEPS = (
    ("sglang_mori.backend.prefill.submitter", "ChunkSubmitter", "submit", "shard: submit (all of it)"),
    ("sglang_mori.backend.prefill.submitter", "ChunkSubmitter", "post", "shard: post (started, plan, engine)"),
    # SGLANG_MORI_INLINE_POST: the whole inline post, on the thread that hands the chunk over.
    ("sglang_mori.backend.prefill.submitter", "ChunkSubmitter", "_post_inline", "inline post (all of it)"),
    ("sglang_mori.backend.plans", "KVPlanner", "write_batch", "plan: write_batch"),
    ("sglang_mori.engine.transfer_engine", "TransferEngine", "write", "engine wrapper: write (+batch_write)"),
    ("sglang_mori.backend.prefill.success", "SuccessDecider", "try_succeed", "success: try_succeed"),
    ("sglang_mori.backend.messenger", "Messenger", "send", "messenger: send"),
    ("sglang_mori.backend.prefill.completion", "Completion", "run_once", "completion: pass"),
    ("sglang_mori.backend.prefill.control", "PrefillControl", "handle", "control: handle message"),
    ("sglang_mori.backend.decode.service", "DecodeService", "handle", "decode status: handle message"),
    # The reading threads' whole receive path (wake-up, receive, the handling above); minus the
    # handling, what one message costs to get to its handler (inbox.py).
    ("sglang_mori.backend.inbox", "Inbox", "wait_and_drain", "inbox: wait, receive, handle"),
)


class StepMeter:
    def __init__(self):
        self._lock = threading.Lock()
        self.ns: dict = {}
        self.calls: dict = {}
        self.enabled = False

    def reset(self) -> None:
        with self._lock:
            self.ns.clear()
            self.calls.clear()

    def _add(self, step: str, ns: int) -> None:
        key = (role(threading.current_thread().name), step)
        with self._lock:
            self.ns[key] = self.ns.get(key, 0) + ns
            self.calls[key] = self.calls.get(key, 0) + 1

    def report(self, requests: int) -> list:
        return [{"thread": thread, "step": step, "us": round(ns / requests / 1e3, 1),
                 "calls": round(self.calls[(thread, step)] / requests, 2)}
                for (thread, step), ns in sorted(self.ns.items())]


@contextmanager
def metered_steps():
    meter = StepMeter()
    restore = []
    for module, cls_name, method, step in STEPS:
        try:
            cls = getattr(importlib.import_module(module), cls_name)
            original = cls.__dict__[method]
        except (ImportError, AttributeError, KeyError):
            continue

        def timed(*args, _original=original, _step=step, **kwargs):
            if not meter.enabled:
                return _original(*args, **kwargs)
            start = time.thread_time_ns()
            try:
                return _original(*args, **kwargs)
            finally:
                meter._add(_step, time.thread_time_ns() - start)

        setattr(cls, method, timed)
        restore.append((cls, method, original))
    try:
        yield meter
    finally:
        for cls, method, original in restore:
            setattr(cls, method, original)
