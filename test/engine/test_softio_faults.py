"""softio fault injection: each fault shows the failure mode real MORI-IO has (softio only)."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from engine_peer import EnginePeer, wait_until
from sglang_mori.softio import faults

SOFTIO_ONLY = True
pytestmark = pytest.mark.timeout(60)

WAIT_MS = 20_000
FILL = 0xEE
PAGE = 64 * 1024


def scattered(n: int):
    """n non-contiguous 64 KiB entries (nothing merges): local i*2P -> remote i*2P."""
    offsets = [i * 2 * PAGE for i in range(n)]
    return offsets, offsets, [PAGE] * n


def landed(remote, local, offset) -> bool:
    return np.array_equal(remote[offset:offset + PAGE], local[offset:offset + PAGE])


def test_stalled_lane_keeps_the_transfer_in_progress(io, make_initiator, shared_peer):
    initiator = make_initiator(qp=2, post_batch_size=1)
    initiator.connect(shared_peer)
    local, lmem = initiator.local(8 * PAGE)
    remote, rmem = initiator.remote(shared_peer, 8 * PAGE, FILL)
    engine = initiator.engine
    uid = engine.allocate_transfer_uid()
    stalled = (uid + 1) % 2  # post-batch 1 (the second frame) goes to this lane
    faults.stall_lane(engine, stalled)
    lo, ro, sz = scattered(4)
    status = engine.batch_write([lmem], [lo], [rmem], [ro], [sz], [uid])[0]
    # Frames 0 and 2 travel on the healthy lane and land; the transfer is still not done.
    wait_until(lambda: landed(remote, local, ro[0]) and landed(remote, local, ro[2]), 10,
               "the healthy lane's frames")
    assert status.WaitFor(200) == io.StatusCode.IN_PROGRESS
    assert engine.wait_all([status], 0) == io.StatusCode.IN_PROGRESS
    failed = engine.batch_write([lmem], [[0]], [rmem], [[10 * PAGE]], [[1]],
                                [engine.allocate_transfer_uid()])[0]
    assert failed.Code() == io.StatusCode.ERR_INVALID_ARGS
    assert engine.wait_all([status, failed], 0) == io.StatusCode.ERR_INVALID_ARGS
    assert (remote[ro[1]:ro[1] + PAGE] == FILL).all()
    faults.resume_lane(engine, stalled)
    assert status.WaitFor(WAIT_MS) == io.StatusCode.SUCCESS
    assert all(landed(remote, local, r) for r in ro)


def test_failed_lane_fails_the_status_while_other_lanes_still_write(io, make_initiator,
                                                                     shared_peer):
    initiator = make_initiator(qp=4, post_batch_size=1)
    initiator.connect(shared_peer)
    local, lmem = initiator.local(8 * PAGE)
    remote, rmem = initiator.remote(shared_peer, 8 * PAGE, FILL)
    engine = initiator.engine
    uid = engine.allocate_transfer_uid()
    lane_of = [(i + uid) % 4 for i in range(4)]  # frame i is post-batch i
    broken = lane_of[0]
    for lane in range(4):
        if lane != broken:
            faults.stall_lane(engine, lane)
    faults.fail_lane(engine, broken)
    lo, ro, sz = scattered(4)
    status = engine.batch_write([lmem], [lo], [rmem], [ro], [sz], [uid])[0]
    assert status.WaitFor(WAIT_MS) == io.StatusCode.ERR_RDMA_OP
    assert "fail_lane" in status.Message()
    assert (remote == FILL).all()  # failed, and nothing has landed yet
    faults.resume_lane(engine)
    # Failed is not quiescent: the other lanes' writes land after the failure was reported.
    wait_until(lambda: all(landed(remote, local, ro[i]) for i in (1, 2, 3)), 10,
               "writes of the surviving lanes")
    event = wait_until(engine.pop_peer_failure, 5, "the peer failure event")
    assert event.remote_engine_key == shared_peer.key
    assert event.reason == io.PeerFailureReason.LOCAL_QP_ERROR and event.qp_num == broken
    later = engine.write(lmem, 0, rmem, 0, 16, engine.allocate_transfer_uid())
    assert later.Code() == io.StatusCode.ERR_RDMA_OP  # the broken lane is never rebuilt
    assert (remote[ro[0]:ro[0] + PAGE] == FILL).all()


def test_sq_full_blocks_then_fails_and_recovers_after_the_window(io, initiator, shared_peer):
    local, lmem = initiator.local(4 * PAGE)
    remote, rmem = initiator.remote(shared_peer, 4 * PAGE, FILL)
    engine = initiator.engine
    faults.sq_full(engine, seconds=30, backoff_ms=200)
    start = time.monotonic()
    status = engine.write(lmem, 0, rmem, 0, PAGE, engine.allocate_transfer_uid())
    assert time.monotonic() - start >= 0.19  # the submitting thread was blocked
    assert status.Code() == io.StatusCode.ERR_RDMA_OP and "SQ full" in status.Message()
    # A short window and a long backoff: the submit waits the window out and then succeeds.
    faults.sq_full(engine, seconds=0.3, backoff_ms=10_000)
    start = time.monotonic()
    status = engine.write(lmem, 0, rmem, PAGE, PAGE, engine.allocate_transfer_uid())
    assert time.monotonic() - start >= 0.29
    assert status.WaitFor(WAIT_MS) == io.StatusCode.SUCCESS
    assert (remote[:PAGE] == FILL).all()  # the failed submit sent nothing
    assert np.array_equal(remote[PAGE:2 * PAGE], local[:PAGE])


def test_real_send_queue_exhaustion_with_small_depth(io, make_initiator, shared_peer,
                                                     monkeypatch):
    monkeypatch.setenv("MORI_IO_QP_MAX_SEND_WR", "2")
    monkeypatch.setenv("MORI_IO_SQ_BACKOFF_TIMEOUT_US", "200000")
    initiator = make_initiator(qp=1)
    initiator.connect(shared_peer)
    local, lmem = initiator.local(8 * PAGE)
    remote, rmem = initiator.remote(shared_peer, 8 * PAGE, FILL)
    engine = initiator.engine
    faults.stall_lane(engine, 0)  # nothing completes, so nothing frees the two SQ slots
    lo, ro, sz = scattered(2)
    first = engine.batch_write([lmem], [lo], [rmem], [ro], [sz], [engine.allocate_transfer_uid()])
    second = engine.write(lmem, 0, rmem, 6 * PAGE, 16, engine.allocate_transfer_uid())
    assert second.Code() == io.StatusCode.ERR_RDMA_OP and "SQ full" in second.Message()
    faults.resume_lane(engine, 0)
    assert engine.wait_all(first, WAIT_MS) == io.StatusCode.SUCCESS
    third = engine.write(lmem, 0, rmem, 6 * PAGE, 16, engine.allocate_transfer_uid())
    assert third.WaitFor(WAIT_MS) == io.StatusCode.SUCCESS
    assert landed(remote, local, 0) and landed(remote, local, 2 * PAGE)


def test_partial_post_fails_but_earlier_batches_land(io, make_initiator, shared_peer):
    initiator = make_initiator(qp=2, post_batch_size=1)
    initiator.connect(shared_peer)
    local, lmem = initiator.local(8 * PAGE)
    remote, rmem = initiator.remote(shared_peer, 8 * PAGE, FILL)
    engine = initiator.engine
    faults.partial_post(engine, after_batches=2)
    lo, ro, sz = scattered(4)
    status = engine.batch_write([lmem], [lo], [rmem], [ro], [sz],
                                [engine.allocate_transfer_uid()])[0]
    assert status.Code() == io.StatusCode.ERR_RDMA_OP  # failed inside the call
    wait_until(lambda: landed(remote, local, ro[0]) and landed(remote, local, ro[1]), 10,
               "the posted batches")
    # A later transfer over both lanes; lanes are ordered, so anything of batches 2 and 3
    # would have landed before it.
    probe = engine.batch_write([lmem], [[0, 2 * PAGE]], [rmem], [[7 * PAGE, 7 * PAGE + 16]],
                               [[16, 16]], [engine.allocate_transfer_uid()])[0]
    assert probe.WaitFor(WAIT_MS) == io.StatusCode.SUCCESS
    assert (remote[ro[2]:ro[2] + PAGE] == FILL).all() and (remote[ro[3]:ro[3] + PAGE] == FILL).all()


def test_latency_delays_every_post(io, initiator, shared_peer):
    _, lmem = initiator.local(4096)
    _, rmem = initiator.remote(shared_peer, 4096)
    engine = initiator.engine
    faults.set_latency(engine, 150)
    start = time.monotonic()
    statuses = [engine.write(lmem, 0, rmem, 0, 4096, engine.allocate_transfer_uid())
                for _ in range(4)]
    assert engine.wait_all(statuses, WAIT_MS) == io.StatusCode.SUCCESS
    assert time.monotonic() - start >= 0.14


def test_bandwidth_cap_slows_transfers(io, initiator, shared_peer):
    local, lmem = initiator.local(2 << 20)
    remote, rmem = initiator.remote(shared_peer, 2 << 20)
    faults.set_bandwidth(initiator.engine, 8e6)
    start = time.monotonic()
    status = initiator.engine.write(lmem, 0, rmem, 0, 2 << 20,
                                    initiator.engine.allocate_transfer_uid())
    assert status.WaitFor(WAIT_MS) == io.StatusCode.SUCCESS
    assert time.monotonic() - start >= 0.2  # 2 MiB at 8 MB/s is 0.26 s
    assert np.array_equal(remote, local)


def test_peer_killed_mid_transfer(io, make_initiator, make_peer):
    initiator = make_initiator(qp=2)
    peer = make_peer(role="killed-mid-transfer")
    initiator.connect(peer)
    local, lmem = initiator.local(4 << 20)
    remote, rmem = initiator.remote(peer, 4 << 20, FILL)
    engine = initiator.engine
    faults.set_bandwidth(engine, 1e6)  # seconds of transfer: it cannot finish before the kill
    status = engine.write(lmem, 0, rmem, 0, 4 << 20, engine.allocate_transfer_uid())
    wait_until(lambda: (remote != FILL).any(), 10, "the first bytes to land")
    peer.kill()
    assert status.WaitFor(10_000) == io.StatusCode.ERR_RDMA_OP
    assert not np.array_equal(remote, local)
    event = wait_until(engine.pop_peer_failure, 5, "the peer failure event")
    assert event.remote_engine_key == peer.key
    assert event.reason == io.PeerFailureReason.PEER_UNREACHABLE
    assert engine.pop_peer_failure() is None  # one event per failed peer
    later = engine.write(lmem, 0, rmem, 0, 16, engine.allocate_transfer_uid())
    assert later.WaitFor(10_000) == io.StatusCode.ERR_RDMA_OP


def test_kill_peer_cuts_both_directions(io, initiator, make_peer):
    peer = make_peer(role="partitioned")
    initiator.connect(peer)
    local, lmem = initiator.local(PAGE)
    remote, rmem = initiator.remote(peer, PAGE)
    engine = initiator.engine
    # The peer writes into our memory too, so it has lanes to us.
    peer.call("register_remote", engine.get_engine_desc().pack())
    _, peer_blob = peer.register(PAGE, 7)
    peer_mem_id = io.MemoryDesc.unpack(peer_blob).id
    code, _ = peer.call("batch_write", (peer_mem_id, lmem.pack(), [0], [0], [64], WAIT_MS))
    assert code == io.StatusCode.SUCCESS and (local[:64] == 7).all()
    assert engine.write(lmem, 0, rmem, 0, PAGE, engine.allocate_transfer_uid()).WaitFor(
        WAIT_MS) == io.StatusCode.SUCCESS

    faults.kill_peer(engine, peer.key)
    later = engine.write(lmem, 0, rmem, 0, 16, engine.allocate_transfer_uid())
    assert later.WaitFor(WAIT_MS) == io.StatusCode.ERR_RDMA_OP
    code, _ = peer.call("batch_write", (peer_mem_id, lmem.pack(), [0], [0], [64], WAIT_MS))
    assert code == io.StatusCode.ERR_RDMA_OP
    seen = peer.call("pop_peer_failure", 5.0)
    assert seen is not None and seen[0] == initiator.key


def test_kill_engine_makes_it_unreachable(io, make_initiator, make_peer):
    victim = make_initiator()
    peer = make_peer(role="survivor")
    _, vmem = victim.local(PAGE)
    peer.call("register_remote", victim.engine.get_engine_desc().pack())
    _, blob = peer.register(PAGE, 3)
    mem_id = io.MemoryDesc.unpack(blob).id
    code, _ = peer.call("batch_write", (mem_id, vmem.pack(), [0], [0], [64], WAIT_MS))
    assert code == io.StatusCode.SUCCESS
    faults.kill_engine(victim.engine)
    code, _ = peer.call("batch_write", (mem_id, vmem.pack(), [0], [0], [64], WAIT_MS))
    assert code == io.StatusCode.ERR_RDMA_OP
    # A newcomer's first contact cannot even connect.
    newcomer = make_peer(role="newcomer")
    newcomer.call("register_remote", victim.engine.get_engine_desc().pack())
    _, nblob = newcomer.register(PAGE)
    with pytest.raises(RuntimeError, match="connect"):
        newcomer.call("batch_write", (io.MemoryDesc.unpack(nblob).id, vmem.pack(), [0], [0],
                                      [64], WAIT_MS))


def test_faults_from_the_environment_arm_an_engine_in_another_process(io, initiator, engine_kind):
    env = {"SGLANG_MORI_SOFTIO_FAULTS": json.dumps(
        [{"kind": "stall_lane", "lane": 0}, {"kind": "stall_lane", "lane": 1}])}
    peer = EnginePeer(engine_kind, qp=2, env=env, role="env-faults")
    try:
        _, lmem = initiator.local(PAGE)
        peer.call("register_remote", initiator.engine.get_engine_desc().pack())
        _, blob = peer.register(PAGE, 5)
        mem_id = io.MemoryDesc.unpack(blob).id
        code, _ = peer.call("batch_write", (mem_id, lmem.pack(), [0], [0], [64], 300))
        assert code == io.StatusCode.IN_PROGRESS
    finally:
        peer.close()


def test_invalid_fault_environment_is_rejected(io, monkeypatch):
    monkeypatch.setenv("SGLANG_MORI_SOFTIO_FAULTS", '[{"kind": "explode"}]')
    with pytest.raises(RuntimeError, match="SGLANG_MORI_SOFTIO_FAULTS"):
        io.IOEngine("bad-faults", io.IOEngineConfig("127.0.0.1", 0))


def test_kill_engine_after_frames_from_the_environment(io, initiator, engine_kind):
    env = {"SGLANG_MORI_SOFTIO_FAULTS": json.dumps([{"kind": "kill_engine_after", "frames": 3}])}
    dying = EnginePeer(engine_kind, qp=1, env=env, role="dies-after-3-frames")
    try:
        # Our engine is the target here: the peer writes six scattered pages into our memory.
        target, tmem = initiator.local(12 * PAGE)
        target[:] = FILL
        dying.call("register_remote", initiator.engine.get_engine_desc().pack())
        source, blob = dying.register(12 * PAGE)
        source.array[:] = np.arange(12 * PAGE, dtype=np.uint64).astype(np.uint8)
        lo, ro, sz = scattered(6)
        code, message = dying.call("batch_write", (io.MemoryDesc.unpack(blob).id, tmem.pack(),
                                                   lo, ro, sz, WAIT_MS))
        assert code == io.StatusCode.ERR_RDMA_OP and "kill_engine_after" in message
        wait_until(lambda: all(np.array_equal(target[r:r + PAGE], source.array[r:r + PAGE])
                               for r in ro[:3]), 10, "the three frames sent before dying")
        # The lane is ordered and was reset right after frame 3: nothing else ever left.
        assert all((target[r:r + PAGE] == FILL).all() for r in ro[3:])
        code, _ = dying.call("batch_write", (io.MemoryDesc.unpack(blob).id, tmem.pack(), [0],
                                             [0], [16], WAIT_MS))
        assert code == io.StatusCode.ERR_RDMA_OP  # a dead engine stays dead
    finally:
        dying.close()


def test_a_later_status_can_complete_before_an_earlier_one(io, make_initiator, shared_peer):
    initiator = make_initiator(qp=2)
    initiator.connect(shared_peer)
    local, lmem = initiator.local(2 * PAGE)
    remote, rmem = initiator.remote(shared_peer, 2 * PAGE, FILL)
    engine = initiator.engine
    first_uid = engine.allocate_transfer_uid()
    faults.stall_lane(engine, first_uid % 2)
    first = engine.write(lmem, 0, rmem, 0, PAGE, first_uid)
    second = engine.write(lmem, PAGE, rmem, PAGE, PAGE, engine.allocate_transfer_uid())
    assert second.WaitFor(WAIT_MS) == io.StatusCode.SUCCESS
    assert first.Code() == io.StatusCode.IN_PROGRESS  # the later one finished first
    assert (remote[:PAGE] == FILL).all()
    faults.resume_lane(engine)
    assert first.WaitFor(WAIT_MS) == io.StatusCode.SUCCESS
    assert np.array_equal(remote, local)
