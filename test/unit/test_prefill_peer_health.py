"""Which failed statuses put a decode peer into its fail-fast window."""

from sglang_mori.backend.prefill_completion import _breaks_peer


def test_transport_errors_break_the_peer():
    assert _breaks_peer("code 13: transport retry limit exceeded")
    assert _breaks_peer("code 13: EP is degraded, rejecting new submissions")
    assert _breaks_peer("")


def test_submission_pressure_does_not():
    assert not _breaks_peer("code 13: SQ full (batch): ep=3 depth=8192 requested=12 max=8192")
    assert not _breaks_peer("code 13: ibv_post_send failed with 12: Cannot allocate memory")
