"""A lone request's hop through the transfer process (test/manual/hop_latency_cpu.py's timeline, a
few requests): the child's reader posts the chunk itself (SGLANG_MORI_INLINE_POST's `auto`: no
shard thread's wake-up between the record and the engine call), and every step of the path comes
after the one before it: send() start, the record read, the engine call, the copy's completion,
the status table's write, the scheduler's poll that saw Success."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

MANUAL = Path(__file__).resolve().parents[1] / "manual"
if str(MANUAL) not in sys.path:
    sys.path.insert(0, str(MANUAL))

import hop_latency_cpu  # noqa: E402


@pytest.mark.parametrize("shape", ["mla61p64", "gqa32p16"])
def test_lone_request_is_posted_by_the_reader_and_its_steps_follow_in_order(monkeypatch, shape):
    monkeypatch.delenv("SGLANG_MORI_INLINE_POST", raising=False)  # the default (`auto`)
    out = hop_latency_cpu.main(shape, 1024, 4)
    assert out["on_reader"] == 4  # every measured request's engine call ran on the reader thread
    assert len(out["rows"]) == 4
    for row in out["rows"]:
        for step in ("send", "to_reader", "to_engine", "engine_call", "done_late", "to_table", "to_poll"):
            assert row[step] >= 0, (step, row)
        # the copy (a sleep of COPY_MS in the child's engine) is inside send() -> Success
        assert row["to_reader"] + row["to_engine"] + row["engine_call"] < row["beyond_copy"] + \
            hop_latency_cpu.COPY_MS / 1e3
