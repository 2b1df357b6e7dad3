"""softio's target-side write log: which bytes landed where, when, and from whom."""

from __future__ import annotations

import time

import numpy as np
import pytest

from engine_peer import EnginePeer
from sglang_mori.softio.write_log import (WriteRecord, clear_write_log, enable_write_log,
                                          get_write_log)

SOFTIO_ONLY = True
pytestmark = pytest.mark.timeout(60)

WAIT_MS = 20_000


def test_write_log_records_every_landed_range(io, initiator, engine_kind):
    peer = EnginePeer(engine_kind, env={"SGLANG_MORI_SOFTIO_RECORD_WRITES": "1"},
                      role="recorder")
    try:
        initiator.connect(peer)
        local, lmem = initiator.local(1 << 16)
        remote, rmem = initiator.remote(peer, 1 << 16)
        _, other = initiator.remote(peer, 4096)
        engine = initiator.engine
        start = time.monotonic()
        # (0,0) and (4096,4096) merge into one range; the third entry is its own range.
        statuses = engine.batch_write([lmem, lmem], [[4096, 0, 20_000], [0]], [rmem, other],
                                      [[4096, 0, 40_000], [100]], [[4096, 4096, 100], [10]],
                                      [engine.allocate_transfer_uid(), engine.allocate_transfer_uid()])
        assert engine.wait_all(statuses, WAIT_MS) == io.StatusCode.SUCCESS
        done = time.monotonic()
        records = [WriteRecord(*r) for r in peer.call("write_log", rmem.id)]
        assert sorted((r.offset, r.size) for r in records) == [(0, 8192), (40_000, 100)]
        for record in records:
            assert record.region_id == rmem.id and record.initiator_key == initiator.key
            assert start <= record.time <= done  # CLOCK_MONOTONIC is shared by processes
        others = [WriteRecord(*r) for r in peer.call("write_log", other.id)]
        assert [(r.offset, r.size) for r in others] == [(100, 10)]
        assert len(peer.call("write_log", None)) == 3
        assert np.array_equal(remote[:8192], local[:8192])
    finally:
        peer.close()


def test_write_log_is_off_by_default_and_controllable_in_process(io, make_initiator):
    writer, target = make_initiator(), make_initiator()
    writer.engine.register_remote_engine(target.engine.get_engine_desc())
    local, lmem = writer.local(4096)
    remote, rmem = target.local(4096)

    def write() -> None:
        status = writer.engine.write(lmem, 0, rmem, 16, 32, writer.engine.allocate_transfer_uid())
        assert status.WaitFor(WAIT_MS) == io.StatusCode.SUCCESS

    write()
    assert get_write_log(target.engine) == []
    enable_write_log(target.engine)
    write()
    (record,) = get_write_log(target.engine, rmem.id)
    assert (record.region_id, record.offset, record.size, record.initiator_key) == \
        (rmem.id, 16, 32, writer.key)
    assert get_write_log(target.engine, rmem.id + 1) == []
    clear_write_log(target.engine)
    assert get_write_log(target.engine) == []
    assert np.array_equal(remote[16:48], local[:32])
