"""What decode's step loop pays for one look at its inbox, on the CPU (issue 28, session 20).

SGLang's decode scheduler polls every waiting room each step, and the first poll of the step looks
at our inbox (MoriKVManager.check_status -> DecodeService.poll_inbox -> Inbox.drain_nowait). This
script times that look as the step loop sees it: an Inbox over a TCP PULL socket, its reading
thread running decode's status-thread loop (wait_and_drain(SGLANG_MORI_WAIT_POLL_MS), as
DecodeService does), and a step loop on the main thread: a step's stand-in (STEP_MS of sleep, the
GPU wait during which SGLang holds no GIL), then one timed look (perf_counter_ns around
drain_nowait).

- `empty`: no message waiting (the per-step cost when idle; divided by requests, what shows)
- `message_step`: one message sent (from this thread's PUSH) at the step's start; the look after
  the step, whoever read the message (with the arrival flag the woken status thread often has,
  during the step's sleep: then this look found the flag armed again, or the socket empty)
- `read_by_look`: the same, only the looks that read the message themselves
- `floor`: a no-op method of a plain object reading one attribute, timed the same way after the
  same step (what any call costs here after a step's sleep: cold caches on a shared VM)

Prints one JSON line: medians and 10th/90th percentiles in us, and who read the messages.

    scripts/in_private_netns.sh .venv/bin/python test/manual/inbox_look_cpu.py [STEPS] [STEP_MS]

Base against new: the same command with PYTHONPATH=<other checkout>/python. The inbox's mode:
SGLANG_MORI_DECODE_ARRIVAL_FLAG (off | thread | process where the build has them; unset: the arrival
flag on, as session 20 ran it). Also prints the status thread's CPU and the watcher child's (process
mode) over the measured steps, us per step.
"""

from __future__ import annotations

import inspect
import json
import os
import statistics
import sys
import threading
import time

import zmq

from sglang_mori.backend import inbox as inbox_module

WAIT_POLL_MS = 50  # SGLANG_MORI_WAIT_POLL_MS's default: decode's status thread's sweep interval


def _pct(values, q):
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q * len(values)))] / 1e3, 2)


def _summary(values):
    return {"median_us": round(statistics.median(values) / 1e3, 2), "p10_us": _pct(values, 0.1),
            "p90_us": _pct(values, 0.9), "n": len(values)}


def main(steps: int = 2000, step_ms: float = 1.0) -> dict:
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(f"tcp://127.0.0.1:{port}")
    got = []
    # decode's Inbox as DecodeService makes it (the arrival flag where the build has it)
    mode = os.environ.get("SGLANG_MORI_DECODE_ARRIVAL_FLAG", "1").strip().lower()
    if not hasattr(inbox_module, "arrival_mode"):  # a build with an on/off flag
        mode = mode in ("1", "true", "yes", "on", "thread")
    watch = "watch_arrivals" in inspect.signature(inbox_module.Inbox).parameters
    inbox = inbox_module.Inbox(pull, lambda frames, polled: got.append(polled), "bench socket",
                               poller_backoff_s=WAIT_POLL_MS / 1000.0, **({"watch_arrivals": mode} if watch else {}))
    stop = threading.Event()

    def status_thread():  # DecodeService._run_status_thread_body, without the room sweep
        while not stop.is_set():
            try:
                inbox.wait_and_drain(WAIT_POLL_MS)
            except zmq.ZMQError:
                return
        inbox.thread_done()

    thread = threading.Thread(target=status_thread, name="status-stand-in", daemon=True)
    thread.start()
    empty, message_step, one, floor = [], [], [], []

    class _Plain:
        flag = 0

        def look(self):
            return self.flag

    plain = _Plain()
    step_s = step_ms / 1000.0
    perf = time.perf_counter_ns
    try:
        for _ in range(200):  # warm: the thread sees the poller and goes off the socket
            time.sleep(step_s)
            inbox.drain_nowait()
        thread_cpu0, child_cpu0 = _thread_ns(thread), _child_ns(inbox)
        for i in range(steps):
            if i % 3 == 2:
                time.sleep(step_s)
                t0 = perf()
                plain.look()
                floor.append(perf() - t0)
                continue
            with_message = i % 3 == 1
            if with_message:
                before = len(got)
                push.send(b"x" * 64)
            time.sleep(step_s)  # the step: the message arrives meanwhile
            t0 = perf()
            n = inbox.drain_nowait()
            dt = perf() - t0
            if not with_message:
                if n == 0:
                    empty.append(dt)
            elif len(got) == before + 1:
                message_step.append(dt)
                if n == 1:
                    one.append(dt)
            else:  # not arrived yet: make sure it is gone before the next step
                end = time.monotonic() + 5
                while len(got) == before and time.monotonic() < end:
                    time.sleep(step_s)
                    inbox.drain_nowait()
        thread_cpu, child_cpu = _thread_ns(thread) - thread_cpu0, _child_ns(inbox) - child_cpu0
    finally:
        stop.set()
        inbox.close()
        thread.join(5)
        push.close(0)
        pull.close(0)
        ctx.term()
    return {"module": inbox_module.__file__, "arrival_flag": mode if watch else None,
            "status_thread_cpu_us_per_step": round(thread_cpu / steps / 1e3, 2),
            "watcher_child_cpu_us_per_step": round(child_cpu / steps / 1e3, 2), "steps": steps, "step_ms": step_ms,
            "floor": _summary(floor), "empty": _summary(empty),
            "message_step": _summary(message_step) if message_step else None,
            "read_by_look": _summary(one) if one else None,
            "read_by": {"poller": inbox.by_poller, "thread": inbox.by_thread}}


def _thread_ns(thread) -> int:
    return time.clock_gettime_ns(time.pthread_getcpuclockid(thread.ident))


def _child_ns(inbox) -> int:
    """The watcher child's CPU ns (/proc/PID/schedstat), 0 without one."""
    watcher = getattr(inbox, "_watcher", None)
    if watcher is None:
        return 0
    with open(f"/proc/{watcher.pid}/schedstat") as f:
        return int(f.read().split()[0])


if __name__ == "__main__":
    args = sys.argv[1:]
    print(json.dumps(main(int(args[0]) if args else 2000, float(args[1]) if len(args) > 1 else 1.0)), flush=True)
