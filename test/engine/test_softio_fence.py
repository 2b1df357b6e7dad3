"""softio's fence_peer: the stand-in for moving a peer's QPs to the error state (MORI-IO has no such
call). Every write posted to the peer before it fails and none of its bytes land afterwards, even
when the link moves again; no peer failure is reported; the next write dials the peer afresh."""

from __future__ import annotations

import numpy as np
import pytest

from sglang_mori.softio import faults

SOFTIO_ONLY = True
pytestmark = pytest.mark.timeout(60)

WAIT_MS = 20_000
FILL = 0xEE
PAGE = 64 * 1024


def test_fenced_writes_fail_never_land_and_the_peer_serves_again(io, make_initiator, shared_peer):
    initiator = make_initiator(qp=2, post_batch_size=1)
    initiator.connect(shared_peer)
    local, lmem = initiator.local(8 * PAGE)
    remote, rmem = initiator.remote(shared_peer, 8 * PAGE, FILL)
    engine = initiator.engine
    faults.stall_lane(engine, 0, shared_peer.key)
    faults.stall_lane(engine, 1, shared_peer.key)
    try:
        stuck = engine.batch_write([lmem], [[0, 2 * PAGE]], [rmem], [[0, 2 * PAGE]], [[PAGE, PAGE]],
                                   [engine.allocate_transfer_uid()])[0]
        assert stuck.WaitFor(100) == io.StatusCode.IN_PROGRESS
        engine.fence_peer(shared_peer.key, "test fence")  # returns once the held batches failed
        assert stuck.Code() == io.StatusCode.ERR_RDMA_OP and "fenced: test fence" in stuck.Message()
    finally:
        faults.resume_lane(engine, None, shared_peer.key)
    assert engine.pop_peer_failure() is None  # the peer is not at fault
    # The next write goes over new lanes and lands; the fenced one's lanes are gone for good.
    later = engine.batch_write([lmem], [[4 * PAGE]], [rmem], [[4 * PAGE]], [[PAGE]],
                               [engine.allocate_transfer_uid()])[0]
    assert later.WaitFor(WAIT_MS) == io.StatusCode.SUCCESS
    assert np.array_equal(remote[4 * PAGE:5 * PAGE], local[4 * PAGE:5 * PAGE])
    assert (remote[:4 * PAGE] == FILL).all()
    assert engine.wait_all([stuck], 0) == io.StatusCode.ERR_RDMA_OP


def test_fence_off_leaves_softio_without_fence_peer_as_mori_io(io, monkeypatch):
    from sglang_mori.engine import TransferEngine

    monkeypatch.setenv("SGLANG_MORI_SOFTIO_FENCE", "0")
    off = TransferEngine(io, role="prefill", host="127.0.0.1", qp_per_transfer=1, post_batch_size=-1, num_workers=1)
    monkeypatch.delenv("SGLANG_MORI_SOFTIO_FENCE")
    on = TransferEngine(io, role="prefill", host="127.0.0.1", qp_per_transfer=1, post_batch_size=-1, num_workers=1)
    try:
        assert (off.can_fence, on.can_fence) == (False, True)
    finally:
        off.close()
        on.close()
