"""The link part's phase split (test/gpu/link_bench.py: where our code and the engine's meet) and
its summary line (scripts/gpu_sglang/link_summary.py), without a GPU: the arithmetic of the phases
from stamps, the stamps PhaseClock takes around an engine's calls and puts back, the projection
with the engine's Python at zero, and the summary's labels."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
for path in (ROOT / "test" / "gpu", ROOT / "test" / "inprocess", ROOT / "scripts" / "gpu_sglang"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import link_bench as lb  # noqa: E402
import link_summary  # noqa: E402
from sglang_mori.softio import device_path  # noqa: E402

# A lone request on a GPU (s): send() at 10, the engine call 10.6-10.95, its device submit
# 10.8-10.9, the copy seen done at 12.5, statuses handed back at 12.52, Success at 12.6.
GPU_STAMPS = dict(t0=10.0, end=12.6, call=(10.6, 10.95), submit=(10.8, 10.9), done=(12.5, 12.52))


def test_gpu_phases_split_the_whole_path_in_order():
    p = lb.lone_phases(**GPU_STAMPS)
    assert p["ours_to_engine"] == pytest.approx(0.6)
    assert p["engine_to_submit"] == pytest.approx(0.2)
    assert p["submit"] == pytest.approx(0.1)
    assert p["copy_wait"] == pytest.approx(1.6)
    assert p["engine_completion"] == pytest.approx(0.02)
    assert p["ours_to_success"] == pytest.approx(0.08)
    path = ("ours_to_engine", "engine_to_submit", "submit", "copy_wait", "engine_completion", "ours_to_success")
    assert sum(p[k] for k in path) == pytest.approx(2.6)  # the whole path, send() to Success
    # Off the path: the call's rest runs beside the copy.
    assert p["engine_after_submit"] == pytest.approx(0.05)
    # Session 17's keys keep their meaning (earlier runs stay comparable).
    assert p["to_submit"] == pytest.approx(0.8)
    assert p["to_success"] == pytest.approx(0.1)


def test_cpu_phases_have_the_engine_call_only():
    p = lb.lone_phases(1.0, 3.0, (1.25, 1.5))
    assert p == pytest.approx({"ours_to_engine": 0.25, "engine_call": 0.25, "call_to_success": 1.5})


def test_projection_takes_out_the_engines_python_only():
    phases = [lb.lone_phases(**GPU_STAMPS), None, lb.lone_phases(**GPU_STAMPS)]
    whole = [2.6, 9.9, 2.6]  # the middle request's stamps did not fit: left out of both figures
    gb = 2.6  # 1 GB/s over the measured path
    z = lb.engine_python_zero(whole, phases, plain_gbps=2.0, gb=gb)
    assert z["measured_s"] == pytest.approx(2.6)
    assert z["s"] == pytest.approx(2.6 - 0.22)  # the submit (launch) stays
    assert z["engine_python_ms"] == pytest.approx(220.0)
    assert z["measured_vs_plain_copy"] == pytest.approx(0.5)
    assert z["vs_plain_copy"] == pytest.approx(gb / 2.38 / 2.0)
    assert "projection" in z
    # No GPU stamps (the CPU check): nothing to project.
    assert lb.engine_python_zero([1.0], [lb.lone_phases(0.0, 1.0, (0.1, 0.2))], 2.0, 1.0) is None


class _Engine:
    def __init__(self):
        self.calls = []

    def batch_write(self, *args):
        self.calls.append(args)
        return ["status"]


class _Dev:
    def submit(self, *args):
        return "plain"

    def submit_shared(self, *args):
        return "shared"


def test_clock_stamps_the_engine_and_puts_everything_back():
    engine, dev = _Engine(), _Dev()
    original_succeed = device_path.succeed_all
    with lb.PhaseClock(dev, engine) as clock:
        assert engine.batch_write(1, 2) == ["status"]  # the call still reaches the engine
        assert dev.submit_shared(3) == "shared"
        device_path.succeed_all([])
        assert len(clock.calls) == len(clock.submits) == len(clock.done) == 1
        (c0, c1), (s0, s1), (d0, d1) = clock.calls[0], clock.submits[0], clock.done[0]
        assert c0 <= c1 <= s0 <= s1 <= d0 <= d1
        p = clock.lone(c0, d1)
        assert set(p) >= {"ours_to_engine", "engine_to_submit", "copy_wait", "ours_to_success"}
        engine.batch_write(4)  # a second call: not one request's stamps
        assert clock.lone(c0, d1) is None
        clock.clear()
        assert clock.calls == clock.submits == clock.done == []
    assert engine.calls == [(1, 2), (4,)]
    assert "batch_write" not in engine.__dict__ and not {"submit", "submit_shared"} & set(dev.__dict__)
    assert device_path.succeed_all is original_succeed


def test_clock_without_a_device_engine_stamps_the_call_only():
    engine = _Engine()
    original_succeed = device_path.succeed_all
    with lb.PhaseClock(None, engine) as clock:
        assert device_path.succeed_all is original_succeed
        engine.batch_write()
        c0, c1 = clock.calls[0]
        assert clock.lone(c0 - 0.5, c1 + 1.0) == pytest.approx(
            {"ours_to_engine": 0.5, "engine_call": c1 - c0, "call_to_success": 1.0})
    assert "batch_write" not in engine.__dict__


def _point(phases: dict, zero: dict | None = None) -> dict:
    ours = {"vs_plain_copy": 0.5, "s": 0.0026, "per_s_vs_plain_copy": 0.6, "phases_ms": phases}
    if zero is not None:
        ours["engine_python_zero"] = zero
    return {"shape": "deepseek-v3-mla", "tokens": 8192, "plain_copy": {"gbps": 380.0}, "ours": ours}


def test_summary_prints_the_split_and_labels_the_projection():
    p = {k: round(1e3 * v, 3) for k, v in lb.lone_phases(**GPU_STAMPS).items()}
    zero = lb.engine_python_zero([2.6], [lb.lone_phases(**GPU_STAMPS)], 2.0, 2.6)
    line = link_summary.line("new_in", _point(p, zero))
    assert "phases 600.00|200.00|100.00|1600.00|20.00|80.00 ms" in line
    assert "ours 0.50x" in line
    assert "projected with the engine's Python at zero 0.55x (-220.00 ms; not measured)" in line


def test_summary_reads_earlier_runs_and_the_cpu_check():
    s17 = _point({"to_submit": 0.7, "submit": 0.37, "copy_wait": 1.62, "to_success": 0.15})
    assert "phases 0.70|0.37|1.62|0.15 ms" in link_summary.line("base_in", s17)
    assert "projected" not in link_summary.line("base_in", s17)
    cpu = _point({"ours_to_engine": 0.43, "engine_call": 42.4, "call_to_success": 152.5})
    assert "phases 0.43|42.40|152.50 ms" in link_summary.line("cpu", cpu)
