"""chaos "serving again after": the clock stops at the first request served right after the last
refused one sent after the fault, so a breaker that opens late is counted."""

from harness.chaos.recovery import serving_again_after

END = 100.0


def test_the_first_served_request_when_nothing_fails_after_the_fault():
    outcomes = [(99.0, False), (100.4, True), (101.0, True)]  # the failure before the end is the fault's
    assert abs(serving_again_after(outcomes, END) - 0.4) < 1e-9


def test_a_breaker_opening_after_the_first_served_request_moves_the_clock():
    # Served at once, then refused for ~5 s (the router's breaker opened late), then served again.
    outcomes = [(100.2, True), (103.0, False), (105.5, False), (108.1, True), (109.0, True)]
    assert abs(serving_again_after(outcomes, END) - 8.1) < 1e-9


def test_order_of_the_records_does_not_matter():
    outcomes = [(109.0, True), (105.5, False), (100.2, True), (108.1, True), (103.0, False)]
    assert abs(serving_again_after(outcomes, END) - 8.1) < 1e-9


def test_not_serving_again_when_the_last_request_failed_or_none_was_sent():
    assert serving_again_after([(100.5, True), (110.0, False)], END) is None
    assert serving_again_after([(90.0, True)], END) is None
    assert serving_again_after([], END) is None
