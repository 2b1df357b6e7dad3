"""Failure-detection settings for PD deployments under test: a dead peer is noticed in seconds.

SGLang's defaults wait up to 300 s (bootstrap and KV-waiting timeouts) and probe a prefill every
5 s; tests that kill servers need bounds they can assert on.
"""

from __future__ import annotations

# SGLang clamps the heartbeat interval to >= 2 s; each probe has a (2 s connect, 3 s read) timeout.
HEARTBEAT_INTERVAL_S = 2.0
HEARTBEAT_MAX_FAILURE = 2
# Our backend's deadline for one transfer (ignored by other backends).
MORI_TRANSFER_TIMEOUT_MS = 10_000

FAILURE_ENV = {
    "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": str(HEARTBEAT_INTERVAL_S),
    "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": str(HEARTBEAT_MAX_FAILURE),
    "SGLANG_MORI_TRANSFER_TIMEOUT_MS": str(MORI_TRANSFER_TIMEOUT_MS),
    # Bootstrap and KV-waiting deadlines (seconds), far above any healthy transfer on this host.
    "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "60",
    "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "60",
}


def failure_deadline_s(slack_s: float = 10.0) -> float:
    """Seconds within which a room cut off by a dead prefill must fail on decode.

    The larger of the transfer deadline and heartbeat detection (interval x failures, plus one
    probe's 5 s timeout), plus slack for a loaded 2-core host.
    """
    heartbeat = HEARTBEAT_INTERVAL_S * HEARTBEAT_MAX_FAILURE + 5.0
    return max(MORI_TRANSFER_TIMEOUT_MS / 1000.0, heartbeat) + slack_s
