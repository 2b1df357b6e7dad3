"""The GPU rig's transfer-process side (test/gpu/prefill_process_side.py) polls at the interval its
caller sets: the link part sets `sglang.poll_s` (link_bench.LINK_POLL_S, 0.1 ms) and records it
with its figures, and until session 19 the side slept its own 0.5 ms between polls regardless,
which added about 0.2 ms to every lone request's send()-to-Success through a transfer process."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

TEST = Path(__file__).resolve().parents[1]
for path in (TEST / "gpu", TEST / "inprocess"):  # as test/gpu/conftest.py puts them
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import prefill_process_side as pps  # noqa: E402
from sglang_mori.backend import room_status as S  # noqa: E402


def _sglang_concluding_on_poll(n: int):
    sglang = pps.PolledSGLang()
    sglang.open(7)
    polls = []

    def poll():
        polls.append(1)
        if len(polls) == n:
            sglang.set_status(7, S.SUCCESS)
    sglang.poll = poll
    return sglang, polls


@pytest.mark.parametrize("poll_s", [0.0001, 0.002])
def test_wait_concluded_sleeps_the_poll_interval_its_caller_set(monkeypatch, poll_s):
    sglang, polls = _sglang_concluding_on_poll(3)
    sglang.poll_s = poll_s
    slept = []
    monkeypatch.setattr(pps.time, "sleep", slept.append)
    done = sglang.wait_concluded([7], 5.0)
    assert list(done) == [7] and len(polls) == 3
    assert slept == [poll_s, poll_s]  # between the polls, none after the one that saw Success


def test_wait_concluded_defaults_to_the_sides_interval(monkeypatch):
    sglang, _ = _sglang_concluding_on_poll(2)
    slept = []
    monkeypatch.setattr(pps.time, "sleep", slept.append)
    sglang.wait_concluded([7], 5.0)
    assert slept == [pps.POLL_S]
