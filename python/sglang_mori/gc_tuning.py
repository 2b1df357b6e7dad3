"""Keep full garbage collections from stalling the KV transfer threads.

A scheduler process holds roughly half a million long-lived Python objects (torch, transformers,
SGLang) before it serves anything. CPython's full (generation 2) collection walks all of them with
the GIL held: about 250 ms on the CPU hosts we measure on, during which no transfer thread can
submit a write, notice a completion or move a softio byte. Our transfer path keeps writes in
flight across collections, and each promotion of those in-flight objects brings the next full
collection closer, so a long transfer burst pays for several such stalls (found by profiling
`scripts/bench_backend.py transfer`: one full collection cost about a fifth of a 2-second run).

`gc.freeze()` moves everything alive at start-up into the permanent generation, which collections
skip. It is what SGLang's own `/freeze_gc` endpoint does on request; we do it once, when our
manager has finished start-up (model, KV pools and buffers exist by then), unless
SGLANG_MORI_GC_FREEZE=0. Objects created later are collected as usual.
"""

from __future__ import annotations

import gc
import logging
import threading
import time

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_frozen = False


def freeze_startup_heap(context: str) -> int:
    """Collect garbage once, then freeze what is left; returns how many objects were frozen.

    Idempotent per process: later calls (another manager in the same process) do nothing and
    return 0, so objects created while serving are never frozen by us.
    """
    global _frozen
    with _lock:
        if _frozen:
            return 0
        _frozen = True
        started = time.monotonic()
        gc.collect()
        gc.freeze()
        count = gc.get_freeze_count()
    logger.info(
        "sglang-mori: froze %d start-up objects in the GC's permanent generation (%s, %.0f ms) so "
        "full collections do not stall KV transfer threads; SGLANG_MORI_GC_FREEZE=0 disables this",
        count,
        context,
        (time.monotonic() - started) * 1e3,
    )
    return count
