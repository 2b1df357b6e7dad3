"""The interference rig's decode side counted by owner (issue 28, test/gpu/decode_calls.py,
interference_part.py, decode_process.py): our calls' CPU apart from the rig's, decode windows that
send the decode process one command while its steps run (rooms opened before, cleared after), and
the paired per-round statistic."""

from __future__ import annotations

import multiprocessing as mp
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "test" / "gpu"
if str(GPU) not in sys.path:
    sys.path.insert(0, str(GPU))

import decode_calls as dc  # noqa: E402
import interference_part as ip  # noqa: E402


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


class _Service:
    def __init__(self):
        self.forgotten = []

    def new_receiver(self, room):
        _spin(0.002)
        return room + 1

    def record_destination(self, **kw):
        self.new_receiver(0)  # nested: counted in the outer call only
        return kw["bootstrap_room"]

    def forget(self, room, attempt):
        self.forgotten.append((room, attempt))

    def poll_inbox(self):
        _spin(0.001)


def test_timed_calls_count_each_outer_call_its_own_threads_cpu_and_reset_on_take():
    svc = _Service()
    calls = dc.TimedCalls(svc, dc.SCHEDULER_CALLS + dc.STEP_CALLS + ("not_there",))
    assert calls.names == ["new_receiver", "record_destination", "forget", "poll_inbox"]
    assert svc.new_receiver(4) == 5  # the wrapped call still returns what it returned
    assert svc.record_destination(bootstrap_room=9) == 9
    svc.forget(9, 3)
    assert svc.forgotten == [(9, 3)]
    # a poll on another thread while this thread is inside a call: each thread's nesting apart
    inside = threading.Event()
    done = threading.Event()

    def poller():
        inside.wait(5)
        svc.poll_inbox()
        done.set()

    t = threading.Thread(target=poller)
    t.start()
    original = svc.new_receiver

    def slow_receiver(room):
        inside.set()
        done.wait(5)
        return original(room)

    svc.new_receiver = slow_receiver
    svc.new_receiver(1)
    t.join(5)
    calls.add("encode", 0.5, 2)
    taken = calls.take()
    assert taken["new_receiver"][1] == 2 and taken["new_receiver"][0] >= 0.004
    assert taken["record_destination"][1] == 1 and taken["record_destination"][0] >= 0.002
    assert taken["poll_inbox"][1] == 1 and 0.001 <= taken["poll_inbox"][0] < 0.1
    assert taken["forget"][1] == 1
    assert taken["encode"] == (0.5, 2)
    assert all(v == (0.0, 0) for v in calls.take().values())  # counters start again
    out = dc.us_per_request({"a": (0.001, 3), "b": (0.003, 1)}, 4)
    assert out == {"a": 250.0, "b": 750.0, "total": 1000.0}
    assert dc.merge({"a": (1.0, 1)}, {"a": (0.5, 2), "b": (1.0, 1)}) == {"a": (1.5, 3), "b": (1.0, 1)}


class _Sglang:
    def __init__(self):
        self.concluded_at = {}


class _Prefill:
    def __init__(self):
        self.sglang = _Sglang()
        self.sends, self.released = [], []

    def send_all(self, room, pages):
        self.sends.append(room)
        self.sglang.concluded_at[room] = 0.0  # concluded at once

    def release(self, room):
        self.released.append(room)


class _Rig:
    def __init__(self):
        self.prefill = _Prefill()
        self.asked, self.opened, self.claims = [], [], []
        self._room = 100

    def next_rooms(self, n):
        rooms = list(range(self._room, self._room + n))
        self._room += n
        return rooms

    def open_decode(self, reqs, rooms, rows):
        self.opened.append((list(rooms), list(rows)))
        return [[f"frame-{room}"] for room in rooms]

    def claim(self, reqs, room, row, frames):
        self.claims.append((room, row, frames))

    def ask(self, cmd, arg=None, timeout=0):
        self.asked.append((cmd, arg))


class _Reqs:
    count = 2
    src = [["s0"], ["s1"]]


def test_opened_rooms_open_decode_once_and_hand_rooms_out_in_order():
    rig = _Rig()
    pool = ip.OpenedRooms(rig, _Reqs(), 3)
    assert rig.opened == [([100, 101, 102], [0, 1, 0])]  # one command for the window's rooms
    assert pool.take(2) == [(100, 0, ["frame-100"]), (101, 1, ["frame-101"])]
    assert pool.take(2) == [(102, 0, ["frame-102"])] and pool.short == 1
    assert pool.take(1) == [] and pool.short == 2


def test_send_due_with_opened_rooms_claims_sends_and_never_asks_decode(monkeypatch):
    import copy_load

    monkeypatch.setattr(copy_load, "due", lambda elapsed, rate, sent: 3 - sent)  # 3 due in all
    rig = _Rig()
    pool = ip.OpenedRooms(rig, _Reqs(), 2)
    live = []
    due = ip.send_due(rig, _Reqs(), 200.0, time.perf_counter(), 0, live, pool)
    assert due == 3 and pool.short == 1  # 3 due, 2 rooms: 1 short, the schedule goes on
    assert rig.claims == [(100, 0, ["frame-100"]), (101, 1, ["frame-101"])]
    assert rig.prefill.sends == [100, 101] and rig.prefill.released == [100, 101]
    assert rig.asked == [] and live == []  # decode's side is cleared after the window, not here
    # without a pool: the forward windows' path opens and clears through the decode process
    rig2 = _Rig()
    rig2.open_rooms = lambda reqs, rooms, rows: rig2.opened.append((rooms, rows))
    assert ip.send_due(rig2, _Reqs(), 200.0, time.perf_counter(), 1, []) == 3
    assert rig2.opened == [([100, 101], [0, 1])]
    assert rig2.asked == [("clear", [100, 101])]


def test_rooms_for_covers_three_times_the_window_and_the_lead():
    from decode_process import WARM_STEPS

    expected = 200 * (ip.LEAD_S + 3 * (300 + WARM_STEPS) * 2.5 / 1e3) + 8
    assert ip.rooms_for(200.0, 300, 2.5) == pytest.approx(expected, abs=1)
    assert ip.rooms_for(0.0, 300, 2.5) == 8


def test_paired_is_the_median_of_round_ratios_with_a_notch_interval():
    med, half = ip.paired([1.0, -2.0, 3.0, 0.0, 2.0, 1.0, 5.0, -1.0])
    assert med == 1.0
    xs = sorted([1.0, -2.0, 3.0, 0.0, 2.0, 1.0, 5.0, -1.0])
    import statistics

    q = statistics.quantiles(xs, n=4)
    assert half == pytest.approx(1.58 * (q[2] - q[0]) / 8 ** 0.5)
    assert ip.paired([2.0, 4.0])[0] == 3.0
    assert ip.paired([])[0] != ip.paired([])[0]  # nan


def test_decode_owners_splits_our_calls_from_the_polls_and_the_rounds():
    w = ip.Windows(["alone", "ours"])
    for ratio in (1.1, 1.0, 1.02, 1.04):
        w.add("alone", [2.0] * 5, 0, {"mori-decode-status": 0.01})
        w.add("ours", [2.0 * ratio] * 5, 50, {"mori-decode-status": 0.02})
    calls = {"alone": {"poll_inbox": (0.010, 1000)},
             "ours": {"new_receiver": (0.002, 200), "record_destination": (0.004, 200), "encode": (0.001, 200),
                      "forget": (0.001, 200), "poll_inbox": (0.030, 1000), "read_by_poll": (0.0, 390),
                      "read_by_thread": (0.0, 10)}}
    out = ip.decode_owners(w, calls, ["alone", "ours"], 250, {"new_receiver": (0.004, 100)}, 100)
    assert out["decode_scheduler_calls_us_per_request"] == {
        "new_receiver": 10.0, "record_destination": 20.0, "encode": 5.0, "forget": 5.0, "total": 40.0}
    assert out["decode_calls_us_per_request"]["total"] == 190.0
    assert out["decode_calls_us_per_request_fwd_windows"] == {"new_receiver": 40.0, "total": 40.0}
    assert out["decode_poll_us_per_step"] == {"alone": 10.0, "ours": 30.0}
    assert out["decode_messages_per_request"] == {"by_poll": 1.95, "by_thread": 0.05}
    assert out["decode_poll_extra_us_per_request"] == 100.0  # (30 - 10 ms) over 200 requests
    assert out["decode_window_extra_cpu_ms_per_request"]["ours"] == {"mori-decode-status": 0.2}
    assert out["decode_status_thread_extra_us_per_request"] == 200.0
    assert out["decode_watcher_extra_us_per_request"] is None  # no watcher child in these windows
    assert out["decode_slowdown_pct_paired"]["ours"] == 3.0  # rounds +10, 0, +2, +4
    assert out["decode_slowdown_ci95_pct"]["ours"] > 0


def test_decode_process_runs_a_window_on_one_command_and_counts_our_calls(monkeypatch):
    """The real decode process on the rig's CPU mode: `steps_run` answers when the steps end,
    with their times and the process's CPU by role; `calls` has our calls apart (the poll once
    per step, warm steps included; the open's receiver, metadata and encode; the clear's forget)."""
    import numpy as np

    from decode_process import WARM_STEPS
    from sglang_mori import protocol

    monkeypatch.setenv("SGLANG_MORI_GPU_RIG_DEVICE", "cpu")
    paths = [str(GPU), str(ROOT / "test" / "inprocess"), str(ROOT / "python")]
    import decode_process

    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=decode_process.serve, daemon=True,
                       args=(child, "mla", 64, 8, {"transfer_timeout_ms": 30000, "peer_fail_fast_s": 5.0}, paths, 0))
    proc.start()

    def ask(cmd, arg=None):
        conn.send((cmd, arg))
        assert conn.poll(120), "the decode process did not answer"
        out = conn.recv()
        assert not isinstance(out, Exception), out
        return out

    try:
        assert conn.poll(120)
        assert isinstance(protocol.decode(conn.recv()), protocol.Register)
        ask("calls")  # from here on
        times, cpu, read = ask("steps_run", 60)
        # no prefill here: nothing to read; every step (the warm ones too) looked at the socket,
        # but for a first one or two that found the status thread in it (the lock taken)
        assert (read["by_poll"], read["by_thread"]) == (0, 0)
        assert 60 + WARM_STEPS - 2 <= read["poll_looks"] <= 60 + WARM_STEPS
        assert len(times) == 60 and all(t > 0 for t in times)
        # the step thread's own CPU is in the window's (read before that thread ends)
        assert cpu.get("decode-steps", 0.0) > 0.0
        taken = ask("calls")
        assert taken["poll_inbox"][1] == 60 + WARM_STEPS
        assert taken["new_receiver"][1] == 0
        frames = ask("open", ([(77, np.array([1, 2]))], [False]))
        metadata = protocol.decode(frames[0][0])
        assert metadata.room == 77 and metadata.aux_index == 77 % 64
        assert ask("clear", [77]) is None
        taken = ask("calls")
        assert {n: taken[n][1] for n in ("new_receiver", "record_destination", "encode", "forget", "poll_inbox")} == {
            "new_receiver": 1, "record_destination": 1, "encode": 1, "forget": 1, "poll_inbox": 0}
        assert taken["record_destination"][0] > 0
    finally:
        conn.send(("stop", None))
        proc.join(30)
        if proc.is_alive():
            proc.kill()


def test_decode_process_with_the_watcher_process_counts_the_childs_cpu(monkeypatch):
    """SGLANG_MORI_DECODE_ARRIVAL_FLAG=process in the rig: the decode process has its watcher child
    (or fails by name), and each window's CPU has the child's as one more role."""
    from decode_process import WATCHER_ROLE
    from sglang_mori import protocol

    monkeypatch.setenv("SGLANG_MORI_GPU_RIG_DEVICE", "cpu")
    paths = [str(GPU), str(ROOT / "test" / "inprocess"), str(ROOT / "python")]
    import decode_process

    assert WATCHER_ROLE == ip.WATCHER_ROLE
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    config = {"transfer_timeout_ms": 30000, "peer_fail_fast_s": 5.0, "decode_arrival_flag": "process"}
    proc = ctx.Process(target=decode_process.serve, daemon=True, args=(child, "mla", 64, 8, config, paths, 0))
    proc.start()
    try:
        assert conn.poll(120), "the decode process did not start"
        assert isinstance(protocol.decode(conn.recv()), protocol.Register)
        conn.send(("steps_run", 20))
        assert conn.poll(120)
        times, cpu, read = conn.recv()
        assert len(times) == 20 and WATCHER_ROLE in cpu and cpu[WATCHER_ROLE] >= 0.0
    finally:
        conn.send(("stop", None))
        proc.join(30)
        if proc.is_alive():
            proc.kill()
