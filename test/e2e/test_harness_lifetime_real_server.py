"""A harness process that is killed outright (SIGKILL: no handler, no atexit, no finally) leaves no
SGLang server behind, the scheduler and detokenizer it forked included (harness.lifetime). One tiny
standalone server; test/unit/test_harness_lifetime.py covers SIGTERM, SIGINT and each safeguard
alone with fake servers."""

from __future__ import annotations

import signal

import pytest

from harness.lifetime_probe import Probe

pytestmark = [pytest.mark.e2e, pytest.mark.own_servers]

# The watchdog gives SIGTERM 5 s before SIGKILL; an idle tiny server exits well within that.
GONE_S = 30.0


def test_sigkilled_harness_leaves_no_server(tiny_model, tmp_path):
    probe = Probe(tmp_path / "probe.json", ["--server", str(tiny_model)], ready_s=400)
    try:
        members = probe.members()
        # The server, its scheduler and its detokenizer at least, all in the server's group.
        assert len(members) >= 3, members
        probe.kill(signal.SIGKILL)
        left = probe.left_after(GONE_S)
        assert not left, f"still running {GONE_S:.0f} s after the harness process was SIGKILLed: {left}"
    finally:
        probe.close()
