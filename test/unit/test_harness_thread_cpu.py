"""The harness's per-thread CPU breakdown (bench transfer --thread-cpu) charges a thread's work to its role."""

import threading
import time

from harness.pd.thread_cpu import ThreadCpu, role


def test_roles_fold_numbered_threads_together():
    assert role("mori-shard-3") == role("mori-shard-12") == "mori-shard-N"
    assert role("softio-lane2-decode-127.0-rx") == "softio-laneN-decode-N.N-rx"
    assert role("MainThread") == "MainThread"


def test_a_busy_thread_is_charged_to_its_role_and_an_idle_one_is_not():
    cpu = ThreadCpu()
    stop = threading.Event()

    def burn():
        start = time.thread_time()
        while time.thread_time() - start < 0.2:  # 0.2 s of this thread's own CPU
            pass
        stop.wait(30)  # stay alive (and visible) until measured

    def idle():
        stop.wait(30)

    busy = threading.Thread(target=burn, name="burner-1")
    quiet = threading.Thread(target=idle, name="sleeper-1")
    busy.start()
    quiet.start()
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and cpu.since().get("burner-N", 0.0) < 0.15:
            time.sleep(0.05)
        used = cpu.since()
    finally:
        stop.set()
        busy.join()
        quiet.join()
    assert used.get("burner-N", 0.0) >= 0.15
    assert used.get("sleeper-N", 0.0) < 0.05
