"""How engine/outcomes.py classifies failed writes: which put a decode peer into its fail-fast
window, which fail only the request, and which metric label each counts under."""

import pytest

from sglang_mori.engine.outcomes import (
    ERR_BAD_STATE,
    ERR_INVALID_ARGS,
    ERR_NOT_FOUND,
    ERR_RDMA_OP,
    INIT,
    FailureKind,
    PeerFailure,
    classify_failure,
)


@pytest.mark.parametrize("message", [
    "code 13: transport retry limit exceeded",
    "code 13: EP is degraded, rejecting new submissions",
    "",
])
def test_transport_errors_break_the_peer(message):
    kind = classify_failure(ERR_RDMA_OP, message)
    assert kind is FailureKind.TRANSPORT and kind.breaks_peer and kind.metric_reason == "peer_dead"


@pytest.mark.parametrize("message", [
    "code 13: SQ full (batch): ep=3 depth=8192 requested=12 max=8192",
    "code 13: ibv_post_send failed with 12: Cannot allocate memory",
])
def test_submission_pressure_does_not(message):
    kind = classify_failure(ERR_RDMA_OP, message)
    assert kind is FailureKind.TRANSIENT and not kind.breaks_peer and kind.metric_reason == "submit_error"


@pytest.mark.parametrize("code", [INIT, ERR_INVALID_ARGS, ERR_NOT_FOUND, ERR_BAD_STATE])
def test_refusals_before_posting(code):
    kind = classify_failure(code, "whatever")
    assert kind is FailureKind.REFUSED and not kind.breaks_peer


def test_timed_out_label():
    assert FailureKind.TIMED_OUT.metric_reason == "timeout" and not FailureKind.TIMED_OUT.breaks_peer


def test_peer_failure_from_an_event_missing_fields():
    class Event:
        remote_engine_key = "decode-x"

    failure = PeerFailure.from_event(Event())
    assert failure.engine_key == "decode-x"
    assert failure.reason == "peer failure of decode-x reported by the engine: ?"
