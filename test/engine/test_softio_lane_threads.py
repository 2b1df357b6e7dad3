"""A broken lane's threads end, however many times it is broken.

Shutdown breaks every lane, and the lane's own receiver breaks it again as its socket is reset. The
second call once drained the sentinel the first left for the sender, which then waited forever: one
thread per lane for the life of the process (found as a network namespace kept alive by it:
test_softio_link_recovery's lanes outlived its topology, and the next topology could not be built).
"""

from __future__ import annotations

import pytest

from sglang_mori.softio.enums import PeerFailureReason

SOFTIO_ONLY = True
pytestmark = pytest.mark.timeout(60)

JOIN_S = 10.0


def _lanes(engine):
    return [lane for backend in engine._core.backends.values()
            for peer in backend.peers.all_peers() for lane in peer.lanes]


def test_a_lane_broken_twice_ends_its_sender(io, make_initiator, shared_peer):
    initiator = make_initiator(qp=2)
    initiator.connect(shared_peer)
    local, lmem = initiator.local(4096)
    _, rmem = initiator.remote(shared_peer, 4096)
    engine = initiator.engine
    assert engine.write(lmem, 0, rmem, 0, 4096, engine.allocate_transfer_uid()).WaitFor(20_000) \
        == io.StatusCode.SUCCESS  # the lanes are dialed
    lanes = _lanes(engine)
    assert lanes
    for lane in lanes:
        # Back to back, as shutdown and the lane's receiver do: the sender has not run in between.
        lane.break_lane("test: first break", PeerFailureReason.PEER_UNREACHABLE, report=False)
        lane.break_lane("test: second break", PeerFailureReason.PEER_UNREACHABLE, report=False)
    for lane in lanes:
        lane._sender.join(JOIN_S)
        lane._receiver.join(JOIN_S)
    alive = [t.name for lane in lanes for t in (lane._sender, lane._receiver) if t.is_alive()]
    assert not alive, f"lane threads still running after the lanes broke: {alive}"
