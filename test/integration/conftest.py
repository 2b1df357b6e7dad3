"""Shared pieces of the integration tests: run a harness session and hold it to the contract.

Every test here starts real processes (bootstrap server, one per prefill TP rank, one per decode TP
rank) through harness.pd.run; the harness stops all of them, by PID, when a run
ends, also on failure. Our backend (`mori`, software engine) is the target; SGLang's Mooncake over
TCP appears once, to show the harness agrees with a reference backend.
"""

from __future__ import annotations

import pytest
from integration_support import IN_PRIVATE_NETNS, assert_clean

from harness.pd.run import HarnessConfig, HarnessResult, run_transfer


@pytest.fixture
def run_clean():
    """run_clean(cfg) -> result, asserting the whole contract."""

    def run(cfg: HarnessConfig, **hooks) -> HarnessResult:
        result = run_transfer(cfg, **hooks)
        assert_clean(result, cfg)
        return result

    return run


@pytest.fixture
def require_netns():
    # Mooncake's engine listens on wildcard addresses whatever SGLANG_HOST_IP says; only run it
    # where nothing outside this machine's private namespace can see those ports.
    if not IN_PRIVATE_NETNS:
        pytest.skip("mooncake binds 0.0.0.0: run under scripts/in_private_netns.sh (make test does)")
