"""The interference part's bookkeeping (test/gpu/interference_part.py) and its copies-only load
(test/gpu/copy_load.py), on the rig's CPU mode: window order, medians and per-round ratios, the
CPU attribution, the request schedule, and that the copies-only load moves exactly the bytes of its
requests' pages."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import pytest

GPU = Path(__file__).resolve().parents[1] / "gpu"
if str(GPU) not in sys.path:
    sys.path.insert(0, str(GPU))

import copy_load  # noqa: E402
import interference_part as ip  # noqa: E402


def test_window_order_gives_every_kind_every_place_once_per_cycle():
    kinds = ["alone", "ours", "copies"]
    orders = [ip.window_order(kinds, r) for r in range(3)]
    assert orders[0] == kinds
    for place in range(3):
        assert sorted(o[place] for o in orders) == sorted(kinds)
    assert ip.window_order(kinds, 3) == kinds


def test_windows_medians_ratios_and_cpu_beyond_alone():
    w = ip.Windows(["alone", "ours", "copies"])
    w.add("alone", [1.0, 1.0, 3.0], 0, {"MainThread": 2.0})
    w.add("ours", [1.2, 1.2, 9.0], 10, {"MainThread": 2.0, "mori-shard-N": 0.5})
    w.add("copies", [1.1], 20, {"MainThread": 2.1})
    w.add("alone", [2.0], 0, {"MainThread": 2.0})
    w.add("ours", [2.4], 10, {"MainThread": 2.2})
    w.add("copies", [2.0], 20, {"MainThread": 2.1})
    m = w.medians()
    assert m == pytest.approx({"alone": 1.5, "ours": 1.8, "copies": 1.55})  # over all rounds' samples
    assert w.slowdown_pct()["ours"] == pytest.approx(20.0)
    assert w.slowdown_pct_by_round() == {"ours": [20.0, 20.0], "copies": [10.0, 0.0]}
    assert w.sent == {"alone": 0, "ours": 20, "copies": 40}
    # ours: shard 0.5 s and MainThread 0.2 s beyond alone's 4.0 s, over 20 requests
    assert w.extra_cpu_ms_per_request("ours") == {"mori-shard-N": 25.0, "MainThread": 10.0}
    assert w.extra_cpu_ms_per_request("copies") == {"MainThread": 5.0}


def test_due_sends_the_rate_and_never_a_negative_count():
    sent, rate = 0, 200.0
    for tick in range(501):  # one second in 2 ms ticks
        n = copy_load.due(tick * 0.002, rate, sent)
        assert n >= 0
        sent += n
    assert sent == 200
    assert copy_load.due(0.5, 200.0, 150) == 0  # ahead of the schedule: nothing due


def test_copy_table_turns_the_planner_columns_into_addresses_pair_by_pair():
    lo = np.array([0, 100]), np.array([8])
    ro = np.array([50, 10]), np.array([16])
    sz = np.array([4, 6]), np.array([2])
    dsts, srcs, sizes = copy_load.copy_table((lo, ro, sz), [(0, 1), (1, 0)], [1000, 2000], [5000, 6000])
    assert dsts.tolist() == [6050, 6010, 5016]
    assert srcs.tolist() == [1000, 1100, 2008]
    assert sizes.tolist() == [4, 6, 2]
    with pytest.raises(ValueError):
        copy_load.copy_table((lo, ro, sz), [(0, 0)], [0], [0])


@pytest.fixture
def cpu_rig(monkeypatch):
    import rig_device

    monkeypatch.setattr(rig_device, "DEVICE", "cpu")
    monkeypatch.setattr(rig_device, "ON_GPU", False)


def test_copies_only_load_moves_exactly_its_requests_pages(cpu_rig):
    src = np.array([[0, 1, 2], [6, 7, 3]])
    dst = np.array([[5, 3, 4], [0, 1, 7]])
    load = copy_load.CopyLoad("mla", 16, 8, src, dst)
    try:
        item = 16 * 1152
        assert load.bytes_per_request == [3 * item * 61] * 2
        load.post(0)
        load.post(1)
        for b in range(61):
            s = load.src[b].numpy().reshape(8, item)
            d = load.dst[b].numpy().reshape(8, item)
            assert (d[[5, 3, 4]] == s[[0, 1, 2]]).all()  # request 0 (contiguous pages merged: same bytes)
            assert (d[[0, 1, 7]] == s[[6, 7, 3]]).all()  # request 1 (its later copies win on no page here)
            assert not d[[2, 6]].any()  # pages no request writes stay as they were
    finally:
        load.close()


def test_copies_only_load_runs_windows_on_one_thread_and_counts_them(cpu_rig):
    load = copy_load.CopyLoad("mla", 16, 4, np.array([[0]]), np.array([[1]]))
    try:
        for _ in range(2):  # the same thread serves both windows
            load.start(1000.0)
            with pytest.raises(RuntimeError):
                load.start(1000.0)
            deadline = time.monotonic() + 10
            while load.sent < 3 and time.monotonic() < deadline:
                time.sleep(0.001)
            n = load.stop()
            assert n >= 3 and n == load.sent
        thread = load._thread
        assert thread.is_alive() and thread.name == "copies-only"
    finally:
        load.close()
    assert not thread.is_alive()


def test_side_calls_time_each_call_once_and_not_the_waits_polls():
    class Side:
        def __init__(self):
            self.sent = []
            self.sglang = type("S", (), {})()
            self.sglang.poll = self.poll

        def send_all(self, room, pages):
            self.sent.append(room)
            sum(range(20000))

        def poll(self):
            self.send_all(7, None)  # a deferred send, from inside the poll

        def release(self, room):
            pass

    side = Side()
    calls = ip.SideCalls(side)
    assert calls.names == ["send_all", "poll", "release"]
    side.sglang.poll()  # a wait of the stand-in: not a scheduler loop, its poll is not counted ...
    assert side.sent == [7] and calls.seconds["poll"] == 0.0
    assert calls.seconds["send_all"] > 0  # ... the deferred send it made is a send
    sends = calls.seconds["send_all"]
    side.poll()  # the scheduler loop's poll
    assert side.sent == [7, 7]
    assert calls.seconds["poll"] > 0 and calls.seconds["send_all"] == sends  # nested: counted in the poll
    out = calls.us_per_request(2)
    assert out["total"] == pytest.approx(out["send_all"] + out["poll"] + out["release"], abs=0.2)
