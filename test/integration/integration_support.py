"""Helpers for the integration tests (imported by conftest.py and by tests): a config with the
suite's deadlines, and the full success contract of a harness run."""

from __future__ import annotations

import os

from harness.pd.plan import build_plan, rooms_of_rank
from harness.pd.run import HarnessConfig, HarnessResult

IN_PRIVATE_NETNS = os.environ.get("SGLANG_MORI_IN_NETNS") == "1"

# Short SGLang-side timeouts: a lost room must fail well inside the harness deadline, not hang.
BASE = dict(startup_timeout_s=120.0, transfer_timeout_s=90.0, sglang_timeout_s=45.0)


def config(backend: str = "mori", **kw) -> HarnessConfig:
    return HarnessConfig(backend=backend, **{**BASE, **kw})


def assert_clean(result: HarnessResult, cfg: HarnessConfig) -> None:
    """Every room Success on every rank of both sides, every byte where it belongs, every worker
    still answering at the end."""
    summary = result.summary()
    assert result.error is None, summary
    assert len(result.side("prefill")) == cfg.prefill_tp * cfg.prefill_cp * cfg.prefill_dp * cfg.prefill_pp, summary
    assert len(result.side("decode")) == cfg.decode_tp * cfg.decode_dp * cfg.decode_instances, summary
    assert result.all_succeeded(cfg.rooms), summary
    plan = build_plan(cfg)
    for rep in result.ranks:
        # Every rank ran exactly the rooms of its DP rank (and decode instance).
        mine = [r.index for r in rooms_of_rank(plan, cfg, rep.side, rep.dp_rank, rep.instance)]
        assert [o.index for o in rep.rooms] == mine, summary
        assert all(o.failure is None for o in rep.rooms), summary
    assert result.byte_exact(), summary
    assert all(r.checked_bytes > 0 for r in result.side("decode")), summary
    assert result.alive_at_end and all(result.alive_at_end.values()), result.alive_at_end
    if cfg.start_method == "forkserver":
        # Workers fork with SGLang imported; a silently failed preload costs every run ~15 s.
        assert result.ready is not None and all(result.ready.preloaded.values()), result.ready.preloaded
