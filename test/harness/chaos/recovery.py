"""When a deployment serves again after a fault: pure logic over every request sent after it.

"Serving again after" used to be the send time of the first request served right after the fault's
end. A router whose circuit breaker opens a few seconds *later* (sglang_router counts the failures
of requests caught by the fault as they come back, after the first new request went through) then
refused every request for up to its breaker timeout, unseen in the table (issue 29's reruns: 4 s
with the launch_pd settings, a minute with the router's defaults). So the clock stops only at the
first request served right that was sent after the last one, sent after the fault's end, that was
not: a refusal, an error, a wrong answer or no answer at all.
"""

from __future__ import annotations

from typing import Iterable, Optional, Tuple

Outcome = Tuple[float, bool]  # (send time, served right), CLOCK_MONOTONIC as the fault's end


def serving_again_after(outcomes: Iterable[Outcome], fault_end: float) -> Optional[float]:
    """Seconds from `fault_end` to the send time of the first request served right after the last
    one not served right; None when no request after that last failure was served (or none was
    sent after the fault's end)."""
    after = sorted((sent, ok) for sent, ok in outcomes if sent >= fault_end)
    last_bad = max((sent for sent, ok in after if not ok), default=None)
    served = [sent for sent, ok in after if ok and (last_bad is None or sent > last_bad)]
    return served[0] - fault_end if served else None
