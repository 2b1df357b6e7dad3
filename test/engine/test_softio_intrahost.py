"""softio's intra-host path: when it is chosen, how a target refuses it, and what a target does
with intra-host frames it cannot trust (softio only; the conformance suite covers the rest)."""

from __future__ import annotations

import ctypes
import os
import socket

import numpy as np
import pytest

from engine_peer import FORCE_TCP_ENV, dropped, unique_key
from sglang_mori import softio
from sglang_mori.softio import faults, wire, xmem
from sglang_mori.softio.intrahost import peer_path

KINDS = ["softio-intrahost"]
pytestmark = pytest.mark.timeout(60)

WAIT_MS = 20_000
FILL = 0xEE


@pytest.fixture
def make_engine(monkeypatch):
    """A softio engine in this process, created with or without FORCE_TCP."""
    made = []

    def make(force_tcp: bool = False):
        monkeypatch.setenv(FORCE_TCP_ENV, "1" if force_tcp else "0")
        engine = softio.IOEngine(unique_key("intrahost"), softio.IOEngineConfig("127.0.0.1", 0))
        engine.create_backend(softio.BackendType.RDMA, softio.RdmaBackendConfig(2))
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.remove_backend(softio.BackendType.RDMA)


def write_and_check(engine, peer, size: int = 1 << 20) -> None:
    """Write `size` random bytes into a new region of the peer and check they landed."""
    local = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    lmem = engine.register_memory(local.ctypes.data, size, -1, softio.MemoryLocationType.CPU)
    buf, blob = peer.register(size, FILL)
    status = engine.write(lmem, 0, softio.MemoryDesc.unpack(blob), 0, size,
                          engine.allocate_transfer_uid())
    assert status.WaitFor(WAIT_MS) == softio.StatusCode.SUCCESS, status.Message()
    assert np.array_equal(buf.array, local)


def path_after_a_write(engine, peer) -> str:
    engine.register_remote_engine(softio.EngineDesc.unpack(peer.desc_blob))
    assert peer_path(engine, peer.key) is None  # lazy: nothing is dialed before the first transfer
    write_and_check(engine, peer)
    return peer_path(engine, peer.key)


def test_a_peer_on_this_host_gets_intra_host_lanes(make_engine, make_peer):
    assert path_after_a_write(make_engine(), make_peer(role="near")) == "intra-host"


def test_force_tcp_on_the_initiator_keeps_tcp_lanes(make_engine, make_peer):
    assert path_after_a_write(make_engine(force_tcp=True), make_peer(role="near")) == "tcp"


def test_a_target_that_forces_tcp_refuses_and_the_initiator_uses_tcp(make_engine, make_peer):
    peer = make_peer(role="tcp-only", env={FORCE_TCP_ENV: "1"})
    assert path_after_a_write(make_engine(), peer) == "tcp"


def test_a_peer_on_another_node_gets_tcp_lanes(make_engine, make_peer):
    peer = make_peer(role="far", env={"MORI_NODE_ID": "another-node"})
    assert path_after_a_write(make_engine(), peer) == "tcp"


def test_a_stalled_intra_host_lane_outlives_the_control_plane_timeout(make_engine, make_peer,
                                                                       monkeypatch):
    """A lane waits for its ACKs as long as writes are outstanding: only control calls time out.
    (Intra-host lanes once kept the dial timeout, so a lane stalled past MORI_IO_CP_TIMEOUT_MS
    broke with "receive failed: timed out" and failed every transfer on it.)"""
    monkeypatch.setenv("MORI_IO_CP_TIMEOUT_MS", "200")
    engine, peer = make_engine(), make_peer(role="near")
    assert path_after_a_write(engine, peer) == "intra-host"
    size = 1 << 16
    local = np.full(size, 7, dtype=np.uint8)
    lmem = engine.register_memory(local.ctypes.data, size, -1, softio.MemoryLocationType.CPU)
    buf, blob = peer.register(size, FILL)
    faults.stall_lane(engine, 0)
    faults.stall_lane(engine, 1)
    status = engine.write(lmem, 0, softio.MemoryDesc.unpack(blob), 0, size,
                          engine.allocate_transfer_uid())
    # Five control-plane timeouts with nothing sent and nothing ACKed: still in progress.
    assert status.WaitFor(1000) == softio.StatusCode.IN_PROGRESS, status.Message()
    faults.resume_lane(engine)
    assert status.WaitFor(WAIT_MS) == softio.StatusCode.SUCCESS, status.Message()
    assert np.array_equal(buf.array, local)


def test_probe_accepts_only_the_process_that_holds_the_token():
    pid, addr, token = xmem.identity()
    assert pid == os.getpid()
    assert xmem.probe(pid, addr, token) is None
    assert "not the initiator" in xmem.probe(pid, addr, token ^ 1)
    assert "cannot read" in xmem.probe(2**31 - 1, addr, token)  # no such process


def test_copy_goes_on_after_short_counts():
    src = np.arange(10_000, dtype=np.uint32).view(np.uint8)
    dst = np.zeros(src.nbytes, dtype=np.uint8)
    calls = []

    def stingy(pid, liov, lcount, riov, rcount, flags):
        """Copies at most 4099 bytes per call, like a kernel that caps one call."""
        local = liov._obj
        budget = min(4099, local.len)
        done = 0
        for k in range(rcount):
            take = min(riov[k].len, budget - done)
            ctypes.memmove(local.base + done, riov[k].base, take)
            done += take
        calls.append(done)
        return done

    pieces = [(src.ctypes.data + 100, 20_000), (src.ctypes.data + 30_000, 5)]
    xmem.copy(stingy, os.getpid(), dst.ctypes.data, pieces)
    assert np.array_equal(dst[:20_000], src[100:20_100])
    assert np.array_equal(dst[20_000:20_005], src[30_000:30_005])
    assert sum(calls) == 20_005 and len(calls) == 5

    with pytest.raises(OSError):
        xmem.copy(lambda *args: 0, os.getpid(), dst.ctypes.data, pieces)  # no progress: an error


# ---- frames a target must not trust ---------------------------------------------------------

def dial(peer, kind: int, identity=None) -> tuple[socket.socket, int]:
    """A raw connection to the peer's engine; (socket, hello status)."""
    desc = softio.EngineDesc.unpack(peer.desc_blob)
    sock = socket.create_connection((desc.host, desc.port), timeout=5)
    own, target = b"stranger", peer.key.encode()
    hello = wire.HELLO.pack(wire.MAGIC, kind, 0, 0, len(own), len(target)) + own + target
    if kind == wire.KIND_INTRA_LANE:
        hello += wire.INTRA_HELLO.pack(*(identity or xmem.identity()))
    sock.sendall(hello)
    magic, status, key_len = wire.HELLO_REPLY.unpack(wire.recv_exact(sock, wire.HELLO_REPLY.size))
    assert magic == wire.MAGIC
    wire.recv_exact(sock, key_len)
    return sock, status


def pull(region_id: int, offset: int, pieces, size=None, count=None) -> bytes:
    size = sum(length for _, length in pieces) if size is None else size
    count = len(pieces) if count is None else count
    return (wire.HEADER.pack(wire.OP_PULL, wire.FLAG_SIGNALED, count, region_id, offset, size, 1)
            + b"".join(wire.PIECE.pack(a, n) for a, n in pieces))


def test_an_intra_hello_with_a_forged_token_is_refused(make_peer):
    peer = make_peer(role="suspicious")
    pid, addr, token = xmem.identity()
    sock, status = dial(peer, wire.KIND_INTRA_LANE, (pid, addr, token ^ 0xFFFF))
    assert status == wire.HELLO_NO_INTRA
    assert dropped(sock)
    sock, status = dial(peer, wire.KIND_INTRA_LANE)
    assert status == wire.HELLO_OK
    sock.close()


def test_intra_host_frames_a_target_cannot_trust_drop_the_connection(make_peer, make_engine):
    peer = make_peer(role="strict")
    buf, blob = peer.register(4096, FILL)
    region = softio.MemoryDesc.unpack(blob).id
    source = np.full(4096, 7, dtype=np.uint8)
    good = [(source.ctypes.data, 64)]
    cases = {
        "pull on a TCP lane": (wire.KIND_LANE, pull(region, 0, good)),
        "memory the initiator does not have": (wire.KIND_INTRA_LANE, pull(region, 0, [(8, 64)])),
        "no pieces": (wire.KIND_INTRA_LANE, pull(region, 0, [], size=64)),
        "pieces that do not add up": (wire.KIND_INTRA_LANE, pull(region, 0, good, size=65)),
        "outside the region": (wire.KIND_INTRA_LANE, pull(region, 4090, good)),
        "unknown region": (wire.KIND_INTRA_LANE, pull(region + 99, 0, good)),
    }
    for name, (kind, frame) in cases.items():
        sock, status = dial(peer, kind)
        assert status == wire.HELLO_OK, name
        sock.sendall(frame)
        assert dropped(sock), name
    assert (buf.array == FILL).all()  # nothing landed
    # A well-formed pull lands and is ACKed; the engine served everybody throughout.
    sock, _ = dial(peer, wire.KIND_INTRA_LANE)
    sock.sendall(pull(region, 100, good))
    op, _, _, _, _, _, tag = wire.HEADER.unpack(wire.recv_exact(sock, wire.HEADER.size))
    assert (op, tag) == (wire.OP_ACK, 1)
    sock.close()
    assert (buf.array[100:164] == 7).all() and (buf.array[164:] == FILL).all()
    engine = make_engine()
    engine.register_remote_engine(softio.EngineDesc.unpack(peer.desc_blob))
    write_and_check(engine, peer, 4096)
