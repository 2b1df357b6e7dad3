"""harness.lifetime: the children a harness process starts (and theirs) end when it ends, however it
ends. Fake servers (a process and the child it forked, in one group) keep these tests fast;
test/e2e/test_harness_lifetime.py does the same with a real SGLang server."""

from __future__ import annotations

import os
import signal

import pytest

from harness.lifetime_probe import Probe

# The watchdog's SIGTERM grace is 5 s; a fake server ends on SIGTERM at once.
GONE_S = 15.0


@pytest.fixture
def probe(tmp_path):
    p = Probe(tmp_path / "probe.json", ["--tree"], ready_s=60)
    yield p
    p.close()


def _all_up(p: Probe) -> None:
    # Two fake servers (one forked from a thread that has ended since), each with its child.
    members = p.members()
    assert len(members) == 4 and set(p.pgids) <= set(members), members


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_killed_harness_process_leaves_nothing(probe, sig):
    _all_up(probe)
    probe.kill(sig)
    left = probe.left_after(GONE_S)
    assert not left, f"still running {GONE_S:.0f} s after {sig.name} of the harness process: {left}"


def test_parent_death_signal_ends_the_servers_without_the_watchdog(probe):
    _all_up(probe)
    os.kill(probe.report["watchdog"], signal.SIGKILL)
    probe.kill(signal.SIGKILL)
    # The fake servers' own children carry no parent-death signal (SGLang's do): only the leaders.
    left = probe.left_after(GONE_S, pids=probe.pgids)
    assert not left, f"servers still running {GONE_S:.0f} s after a SIGKILL with no watchdog: {left}"

