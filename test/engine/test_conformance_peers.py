"""Conformance: routing, first contact, dead peers, torn-down memory, notifications, wait_all."""

from __future__ import annotations

import importlib
import time

import msgspec
import numpy as np
import pytest

from engine_peer import wait_until

pytestmark = pytest.mark.timeout(90)

WAIT_MS = 20_000
# Real RDMA reports a dead peer after the RC retry budget (seconds); softio sees the TCP close.
DEAD_PEER_S = 30


def new_status(io):
    cpp = importlib.import_module(
        "sglang_mori.softio" if io.__name__.startswith("sglang_mori") else "mori.cpp")
    return cpp.TransferStatus()


def test_unregistered_peer_is_bad_state_and_batch_stops_there(io, initiator, make_initiator,
                                                              shared_peer):
    local, lmem = initiator.local(4096)
    remote, rmem = initiator.remote(shared_peer, 4096, 0)
    stranger = make_initiator()  # never registered the peer
    _, smem = stranger.local(4096)
    status = stranger.engine.write(smem, 0, rmem, 0, 64, stranger.engine.allocate_transfer_uid())
    assert status.Code() == io.StatusCode.ERR_BAD_STATE

    # engine.batch_*: after a pair without a route the remaining pairs are never posted (INIT).
    uids = [initiator.engine.allocate_transfer_uid() for _ in range(2)]
    other_engine_mem = smem  # its engine is not registered in `initiator`
    statuses = initiator.engine.batch_write(
        [lmem, lmem], [[0], [0]], [other_engine_mem, rmem], [[0], [0]], [[64], [64]], uids)
    assert [s.Code() for s in statuses] == [io.StatusCode.ERR_BAD_STATE, io.StatusCode.INIT]
    for timeout in (0, 50, -1):
        assert initiator.engine.wait_all([statuses[1]], timeout) == io.StatusCode.INIT
        assert initiator.engine.wait_all(statuses, timeout) == io.StatusCode.ERR_BAD_STATE
    assert not remote.any()


def test_deregistered_peer_is_bad_state_but_existing_sessions_still_work(io, initiator,
                                                                        shared_peer):
    local, lmem = initiator.local(4096, seed=2)
    remote, rmem = initiator.remote(shared_peer, 4096, 0)
    session = initiator.engine.create_session(lmem, rmem)
    engine = initiator.engine
    assert engine.write(lmem, 0, rmem, 0, 64, engine.allocate_transfer_uid()).WaitFor(WAIT_MS) \
        == io.StatusCode.SUCCESS
    engine.deregister_remote_engine(io.EngineDesc.unpack(shared_peer.desc_blob))
    status = engine.write(lmem, 0, rmem, 0, 64, engine.allocate_transfer_uid())
    assert status.Code() == io.StatusCode.ERR_BAD_STATE
    assert engine.create_session(lmem, rmem) is None
    # A session made before bypasses routing, as in MORI (its connection was not destroyed).
    status = session.write(100, 100, 100, session.allocate_transfer_uid())
    assert status.WaitFor(WAIT_MS) == io.StatusCode.SUCCESS
    assert np.array_equal(remote[:64], local[:64]) and np.array_equal(remote[100:200],
                                                                       local[100:200])


def test_removed_backend_means_no_route(io, make_initiator, shared_peer):
    initiator = make_initiator()
    initiator.connect(shared_peer)
    _, lmem = initiator.local(4096)
    _, rmem = initiator.remote(shared_peer, 4096)
    initiator.engine.remove_backend(io.BackendType.RDMA)
    status = initiator.engine.write(lmem, 0, rmem, 0, 64, 0)
    assert status.Code() == io.StatusCode.ERR_BAD_STATE
    initiator.engine.create_backend(io.BackendType.RDMA, io.RdmaBackendConfig())  # for teardown


def test_first_contact_with_a_dead_peer_raises(io, initiator, make_peer):
    peer = make_peer(role="doomed")
    initiator.connect(peer)
    _, lmem = initiator.local(4096)
    _, rmem = initiator.remote(peer, 4096)
    peer.kill()
    with pytest.raises(RuntimeError):
        initiator.engine.write(lmem, 0, rmem, 0, 64, initiator.engine.allocate_transfer_uid())
    with pytest.raises(RuntimeError):
        initiator.engine.create_session(lmem, rmem)


def test_first_contact_with_an_unknown_remote_region_raises(io, initiator, shared_peer):
    _, lmem = initiator.local(4096)
    _, blob = shared_peer.register(4096)
    fields = msgspec.msgpack.decode(blob)
    fields[5] = 8192  # a size the peer never registered
    wrong_size = io.MemoryDesc.unpack(msgspec.msgpack.encode(fields))
    with pytest.raises(RuntimeError):
        initiator.engine.write(lmem, 0, wrong_size, 0, 64, initiator.engine.allocate_transfer_uid())
    fields[5], fields[1] = 4096, 10_000  # an id the peer never handed out
    wrong_id = io.MemoryDesc.unpack(msgspec.msgpack.encode(fields))
    with pytest.raises(RuntimeError):
        initiator.engine.create_session(lmem, wrong_id)


def test_dead_peer_fails_transfers_and_is_reported(io, make_initiator, make_peer):
    initiator = make_initiator(qp=1)
    peer = make_peer(role="victim")
    initiator.connect(peer)
    local, lmem = initiator.local(1 << 20)
    remote, rmem = initiator.remote(peer, 1 << 20)
    engine = initiator.engine
    assert engine.write(lmem, 0, rmem, 0, 1 << 20, engine.allocate_transfer_uid()).WaitFor(
        WAIT_MS) == io.StatusCode.SUCCESS
    assert np.array_equal(remote, local)
    peer.kill()
    # No reconnect: every later transfer fails, with ERR_RDMA_OP, within a bounded time.
    for _ in range(2):
        status = engine.write(lmem, 0, rmem, 0, 4096, engine.allocate_transfer_uid())
        assert status.WaitFor(DEAD_PEER_S * 1000) == io.StatusCode.ERR_RDMA_OP
        assert status.Failed() and status.Message()
    if hasattr(engine, "pop_peer_failure"):
        event = wait_until(engine.pop_peer_failure, DEAD_PEER_S, "a peer failure event")
        assert event.remote_engine_key == peer.key


def test_deregistered_target_memory_breaks_the_connection(io, make_initiator, make_peer):
    initiator = make_initiator(qp=1)
    peer = make_peer(role="teardown")
    initiator.connect(peer)
    local, lmem = initiator.local(8192)
    remote, rmem = initiator.remote(peer, 4096)
    other, omem = initiator.remote(peer, 4096)
    engine = initiator.engine
    assert engine.write(lmem, 0, rmem, 0, 4096, engine.allocate_transfer_uid()).WaitFor(
        WAIT_MS) == io.StatusCode.SUCCESS
    assert engine.write(lmem, 0, omem, 0, 4096, engine.allocate_transfer_uid()).WaitFor(
        WAIT_MS) == io.StatusCode.SUCCESS
    peer.call("deregister", rmem.id)
    status = engine.write(lmem, 4096, rmem, 0, 4096, engine.allocate_transfer_uid())
    assert status.WaitFor(DEAD_PEER_S * 1000) == io.StatusCode.ERR_RDMA_OP
    # The broken connection is not rebuilt: a still-registered region of that peer fails too.
    status = engine.write(lmem, 4096, omem, 0, 4096, engine.allocate_transfer_uid())
    assert status.WaitFor(DEAD_PEER_S * 1000) == io.StatusCode.ERR_RDMA_OP
    assert np.array_equal(other, local[:4096])


def test_notifications_report_completed_writes_to_the_target(io, make_initiator, make_peer):
    initiator = make_initiator(qp=2, notify=True)
    peer = make_peer(qp=2, notify=True, role="notified")
    initiator.connect(peer)
    _, lmem = initiator.local(65536)
    _, rmem = initiator.remote(peer, 65536)
    engine = initiator.engine
    empty_uid = engine.allocate_transfer_uid()
    assert engine.batch_write([lmem], [[]], [rmem], [[]], [[]], [empty_uid])[0].Code() == \
        io.StatusCode.SUCCESS
    uid = engine.allocate_transfer_uid()
    status = engine.batch_write([lmem], [[0, 8192]], [rmem], [[8192, 0]], [[4096, 4096]], [uid])[0]
    assert status.WaitFor(WAIT_MS) == io.StatusCode.SUCCESS
    code = wait_until(lambda: peer.call("pop_inbound", (initiator.key, uid)) is not None,
                      10, "the inbound notification")
    assert code
    assert peer.call("pop_inbound", (initiator.key, uid)) == int(io.StatusCode.SUCCESS)
    # Popping does not erase; an empty batch never notifies; unknown uids have nothing.
    assert peer.call("pop_inbound", (initiator.key, uid)) == int(io.StatusCode.SUCCESS)
    assert peer.call("pop_inbound", (initiator.key, empty_uid)) is None
    assert peer.call("pop_inbound", (initiator.key, uid + 1000)) is None
    assert peer.call("pop_inbound", ("someone-else", uid)) is None


def test_without_notifications_the_target_learns_nothing(io, initiator, shared_peer):
    _, lmem = initiator.local(4096)
    _, rmem = initiator.remote(shared_peer, 4096)
    uid = initiator.engine.allocate_transfer_uid()
    assert initiator.engine.write(lmem, 0, rmem, 0, 4096, uid).WaitFor(WAIT_MS) == \
        io.StatusCode.SUCCESS
    assert shared_peer.call("pop_inbound", (initiator.key, uid)) is None


def test_wait_all_codes_for_zero_positive_and_negative_timeouts(io, initiator):
    codes = io.StatusCode

    def status(code):
        s = new_status(io)
        s.SetCode(code)
        return s

    ok, init = status(codes.SUCCESS), status(codes.INIT)
    running, failed, bad = (status(codes.IN_PROGRESS), status(codes.ERR_RDMA_OP),
                            status(codes.ERR_INVALID_ARGS))
    wait_all = initiator.engine.wait_all
    assert wait_all([], 0) == codes.SUCCESS and wait_all([], -1) == codes.SUCCESS
    assert wait_all([ok, ok], 0) == codes.SUCCESS
    assert wait_all([ok, running], 0) == codes.IN_PROGRESS
    assert wait_all([running, failed], 0) == codes.ERR_RDMA_OP  # failure wins
    assert wait_all([ok, bad, failed], 0) == codes.ERR_INVALID_ARGS  # first in list order
    assert wait_all([init], 0) == codes.INIT
    start = time.monotonic()
    assert wait_all([ok, running, failed], 150) == codes.IN_PROGRESS  # stops at the running one
    assert 0.1 <= time.monotonic() - start < 10
    assert wait_all([failed, running], 100) == codes.ERR_RDMA_OP  # an earlier failure wins
    assert wait_all([ok, init, failed], 100) == codes.INIT
    assert wait_all([ok, bad, failed], -1) == codes.ERR_INVALID_ARGS
    assert wait_all([ok, ok], -1) == codes.SUCCESS
    assert wait_all([init, ok], -1) == codes.INIT
