"""Shorten the wait of our threads for the GIL in a scheduler process (SGLANG_MORI_GIL_SWITCH_US).

SGLang's scheduler loop never sleeps while it serves: it spins, holding the GIL except inside
short native calls. A thread of ours that wakes up (a chunk handed to the submitter, a copy event
that fired, decode's destinations or a status arriving) must first take the GIL, and CPython
makes the holder give it up only after the switch interval, 5 ms by default. Every such hand-off
on the path from a prefill's last chunk to decode's first token waits up to that long; measured
on real SGLang (docs/benchmarks.md, "Real SGLang on GPUs"), these waits were milliseconds of PD's
time to first token. A shorter interval bounds each wait, at the price of more frequent switches
between threads that both want to run. It is a process-wide setting: we set it once, when our
manager starts, only where the knob asks for it.
"""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger(__name__)


def set_switch_interval(microseconds: int, context: str) -> float:
    """Set Python's thread switch interval; returns the interval it replaced (seconds)."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(microseconds / 1e6)
    logger.info("sglang-mori: thread switch interval %.0f us -> %d us (%s, SGLANG_MORI_GIL_SWITCH_US)",
                before * 1e6, microseconds, context)
    return before
