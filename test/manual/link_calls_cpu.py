"""Function calls (Python and C, as the profiler hook sees them) on a lone request's path around
the engine call, counted while link_latency_cpu.py runs its requests: a measure of our Python's
work there that a shared CPU host's noise does not move (issue 28; docs/benchmarks.md "Session
20"). Per request, medians:

- `send_to_call`: the scheduler's send() (PrefillService.add_chunk) to softio's batch_write, on
  the thread that posts (SGLANG_MORI_INLINE_POST=on: SGLang's scheduler);
- `call_to_send_return`: batch_write's return to send()'s (the same thread, after the post);
- `wake_to_success`: the completion thread's wake on a finished write (the whole call's statuses
  completed) to the room's Success status on SGLang's side.

    SGLANG_MORI_INLINE_POST=on scripts/in_private_netns.sh .venv/bin/python test/manual/link_calls_cpu.py [mla61p64|gqa32p16] [REQUESTS]

PYTHONPATH=<checkout>/python counts another checkout's backend (the stand-in engine is this one's).
"""

from __future__ import annotations

import collections
import statistics
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import link_latency_cpu as link  # noqa: E402  (puts the harness on the path)

from harness.hotpath.rig import ConcludedSGLang  # noqa: E402
from sglang_mori.backend import room_status as S  # noqa: E402
from sglang_mori.backend.prefill.service import PrefillService  # noqa: E402
from sglang_mori.engine.transfer_engine import TransferHandle  # noqa: E402
from sglang_mori.softio.engine import IOEngine  # noqa: E402

counts = collections.defaultdict(list)
mine = threading.local()  # .n: calls counted so far on this thread (None: not counting); .key


def _hook(frame, event, arg):
    if event in ("call", "c_call") and getattr(mine, "n", None) is not None:
        mine.n += 1


def _start(key: str) -> None:
    mine.n, mine.key = 0, key


def _stop(key: str) -> None:
    if getattr(mine, "n", None) is not None and mine.key == key:
        counts[key].append(mine.n)
    mine.n = None


def _install() -> None:
    add_chunk, wait_running, set_status = PrefillService.add_chunk, TransferHandle.wait_running, ConcludedSGLang.set_status

    def counted_add_chunk(*a, **k):
        _start("send_to_call")
        try:
            return add_chunk(*a, **k)
        finally:
            _stop("call_to_send_return")

    def counted_wait_running(self, timeout_ms):
        woke = wait_running(self, timeout_ms)
        if woke and int(self.live[-1].Code()) == 0:  # the stand-in completes a call's statuses at once
            _start("wake_to_success")
        return woke

    def counted_set_status(self, room, status):
        if status == S.SUCCESS:
            _stop("wake_to_success")
        return set_status(self, room, status)

    enter = link.StreamLikeWrites.__enter__

    def counted_enter(probe):
        out = enter(probe)
        batch_write = IOEngine.batch_write  # the stand-in, installed by enter

        def counted_batch_write(*a, **k):
            _stop("send_to_call")
            statuses = batch_write(*a, **k)
            if threading.current_thread() is threading.main_thread():
                _start("call_to_send_return")
            return statuses
        IOEngine.batch_write = counted_batch_write
        return out

    PrefillService.add_chunk = counted_add_chunk
    TransferHandle.wait_running = counted_wait_running
    ConcludedSGLang.set_status = counted_set_status
    link.StreamLikeWrites.__enter__ = counted_enter
    threading.setprofile(_hook)
    sys.setprofile(_hook)


def main(shape_key: str = "mla61p64", requests: int = 40) -> None:
    _install()
    link.main(shape_key, 8192, requests)
    for key in ("send_to_call", "call_to_send_return", "wake_to_success"):
        v = counts.get(key)
        if v:
            print(f"{shape_key} {key}: median {statistics.median(v):.0f} calls (min {min(v)}, max {max(v)}, "
                  f"{len(v)} counted)", flush=True)


if __name__ == "__main__":
    main(*(f(a) for f, a in zip((str, int), sys.argv[1:])))
