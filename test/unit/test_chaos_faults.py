"""The chaos run's fault injectors (harness/chaos/faults.py) against a recording host and deployment."""

import pytest

from harness.chaos import faults
from harness.chaos.faults import BY_NAME, FaultContext


class Recorder:
    """Stands in for the Topology and the NetnsPD: records each call the injector makes."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return lambda *args: self.calls.append((name, *args))


def context(deadline_s=0.0):
    rec = Recorder()
    return FaultContext(dep=rec, topo=rec, deadline_s=deadline_s), rec


@pytest.mark.parametrize("make, expected", [
    (lambda: faults._link_down(0.0), [("cut",), ("restore",)]),
    (lambda: faults._link_down(None), [("cut",), ("restore",)]),
    (lambda: faults._throttle("1mbit", 0.0), [("throttle", "1mbit"), ("unthrottle",)]),
    (lambda: faults._stall("prefill", 0.0), [("stall", "prefill"), ("resume", "prefill")]),
    (lambda: faults._restart("decode"), [("kill", "decode"), ("start_role", "decode"), ("wait_role", "decode", 300.0)]),
])
def test_each_fault_applies_then_undoes(make, expected):
    ctx, rec = context()
    make()(ctx)
    assert rec.calls == expected


def test_a_held_fault_is_undone_when_its_hold_is_interrupted_and_holds_its_length(monkeypatch):
    held = []

    def interrupted(seconds):
        held.append(seconds)
        raise KeyboardInterrupt

    monkeypatch.setattr(faults.time, "sleep", interrupted)
    ctx, rec = context(deadline_s=12.0)
    with pytest.raises(KeyboardInterrupt):
        BY_NAME["link_long"].inject(ctx)
    assert rec.calls == [("cut",), ("restore",)] and held == [18.0]  # 1.5 x the deadline
    ctx, rec = context()
    with pytest.raises(KeyboardInterrupt):
        BY_NAME["prefill_stop_10s"].inject(ctx)
    assert rec.calls == [("stall", "prefill"), ("resume", "prefill")] and held[-1] == 10.0
