"""The in-process rigs' one bounded wait: poll a predicate until it holds or the time is up."""

from __future__ import annotations

import time


def wait_until(predicate, what: str, timeout_s: float, interval_s: float = 0.005):
    """The predicate's first truthy value; AssertionError naming `what` after `timeout_s`."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
