"""scripts/bench_handoff.py: every transport delivers every chunk with its pages, and the checker
catches a chunk that does not carry what was sent."""

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "bench_handoff.py"
spec = importlib.util.spec_from_file_location("bench_handoff", SCRIPT)
bh = importlib.util.module_from_spec(spec)
sys.modules["bench_handoff"] = bh
spec.loader.exec_module(bh)


@pytest.mark.parametrize("transport", ["zmq", "seqpacket", "shm-ring", "shm-poll"])
def test_each_transport_delivers_every_chunk_intact(transport):
    # Unpaced, more chunks than the ring has slots, so the shared-memory senders wrap around.
    row = bh.run_case(transport, pages_per_chunk=64, rate=0, count=300, seconds=5.0, max_pages=64)
    assert row["sent"] == 300
    assert row["received"] == 300
    assert row["errors"] == 0


def test_checker_counts_a_chunk_with_wrong_pages_or_order():
    check = bh._Checker()
    pages = np.arange(8, dtype=np.int64)
    check.chunk(0, pages, False, -1, 0)  # room 0 starts at page 0: right
    check.chunk(1, pages, False, -1, 0)  # room 1 must start at page 1: wrong pages
    check.chunk(3, pages + 3, True, 3, 0)  # room 2 skipped: out of order
    assert check.errors == 2
    check.chunk(bh.END_ROOM, pages[:1], False, 3, 0)
    assert check.done
