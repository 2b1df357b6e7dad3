"""softio on the wire: strangers and malformed frames drop one connection, never the engine."""

from __future__ import annotations

import socket
import threading

import msgspec
import numpy as np
import pytest

from engine_peer import EnginePeer, dropped
from sglang_mori.softio import wire

SOFTIO_ONLY = True
pytestmark = pytest.mark.timeout(60)

WAIT_MS = 20_000


def address(io, peer):
    desc = io.EngineDesc.unpack(peer.desc_blob)
    return desc.host, desc.port


def dial(io, peer, target_key=None, kind=wire.KIND_LANE) -> socket.socket:
    sock = socket.create_connection(address(io, peer), timeout=5)
    own, target = b"stranger", (target_key or peer.key).encode()
    sock.sendall(wire.HELLO.pack(wire.MAGIC, kind, 0, 0, len(own), len(target)) + own + target)
    return sock


def hello_reply(sock) -> int:
    magic, status, key_len = wire.HELLO_REPLY.unpack(wire.recv_exact(sock, wire.HELLO_REPLY.size))
    assert magic == wire.MAGIC
    wire.recv_exact(sock, key_len)
    return status


def still_serves(io, initiator, peer) -> None:
    local, lmem = initiator.local(4096, seed=21)
    remote, rmem = initiator.remote(peer, 4096)
    status = initiator.engine.write(lmem, 0, rmem, 0, 4096,
                                    initiator.engine.allocate_transfer_uid())
    assert status.WaitFor(WAIT_MS) == io.StatusCode.SUCCESS
    assert np.array_equal(remote, local)


def test_garbage_instead_of_a_hello_is_dropped(io, initiator, shared_peer):
    sock = socket.create_connection(address(io, shared_peer), timeout=5)
    sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(64))
    assert dropped(sock)
    still_serves(io, initiator, shared_peer)


def test_hello_for_another_engine_is_refused(io, initiator, shared_peer):
    sock = dial(io, shared_peer, target_key="somebody-else")
    assert hello_reply(sock) == wire.HELLO_WRONG_TARGET
    assert dropped(sock)
    still_serves(io, initiator, shared_peer)


@pytest.mark.parametrize("frame", [
    wire.pack_header(wire.OP_WRITE, 0, 999_999, 0, 16, 0),  # unknown region
    wire.pack_header(wire.OP_READ, 0, 999_999, 0, 16, 1),
    wire.pack_header(0x7F, 0, 0, 0, 0, 0),  # unknown op
], ids=["write-unknown-region", "read-unknown-region", "unknown-op"])
def test_bad_frames_drop_the_connection(io, initiator, shared_peer, frame):
    sock = dial(io, shared_peer)
    assert hello_reply(sock) == wire.HELLO_OK
    sock.sendall(frame)
    assert dropped(sock)
    still_serves(io, initiator, shared_peer)


def test_out_of_range_write_is_dropped_and_lands_nothing(io, initiator, shared_peer):
    remote, rmem = initiator.remote(shared_peer, 4096, 0xAB)
    sock = dial(io, shared_peer)
    assert hello_reply(sock) == wire.HELLO_OK
    sock.sendall(wire.pack_header(wire.OP_WRITE, wire.FLAG_SIGNALED, rmem.id, 4000, 200, 1)
                 + bytes(200))
    assert dropped(sock)
    assert (remote == 0xAB).all()
    still_serves(io, initiator, shared_peer)


def test_truncated_frames_and_abrupt_closes_are_survived(io, initiator, shared_peer):
    _, rmem = initiator.remote(shared_peer, 4096)
    sock = dial(io, shared_peer)
    assert hello_reply(sock) == wire.HELLO_OK
    sock.sendall(wire.pack_header(wire.OP_WRITE, 0, rmem.id, 0, 1000, 0)[:20])
    wire.abort_socket(sock)
    sock = dial(io, shared_peer)
    assert hello_reply(sock) == wire.HELLO_OK
    sock.sendall(wire.pack_header(wire.OP_WRITE, 0, rmem.id, 0, 1000, 0) + bytes(10))
    sock.close()
    sock = dial(io, shared_peer, kind=wire.KIND_CONTROL)
    assert hello_reply(sock) == wire.HELLO_OK
    sock.sendall(wire.pack_header(wire.OP_WRITE, 0, 0, 0, 0, 0))  # not a control request
    assert dropped(sock)
    still_serves(io, initiator, shared_peer)


def test_silent_stranger_is_dropped_after_the_control_plane_timeout(io, initiator, engine_kind):
    peer = EnginePeer(engine_kind, env={"MORI_IO_CP_TIMEOUT_MS": "300"}, role="impatient")
    try:
        initiator.connect(peer)
        sock = socket.create_connection(address(io, peer), timeout=10)
        assert dropped(sock)  # nothing sent: the handshake times out on the engine's side
        still_serves(io, initiator, peer)
    finally:
        peer.close()


def _fake_peer(io, port: int, key: str = "fake-peer"):
    desc = io.EngineDesc.unpack(msgspec.msgpack.encode([key, "n", "h", "127.0.0.1", port, 1]))
    mem = io.MemoryDesc.unpack(msgspec.msgpack.encode(
        [key, 0, -1, "", 0x1000, 4096, 1, bytes(64), -1, 0, bytes(64), -1, "", 0, 0]))
    return desc, mem


def test_first_contact_with_a_mute_listener_times_out(io, make_initiator, monkeypatch):
    monkeypatch.setenv("MORI_IO_CP_TIMEOUT_MS", "300")
    initiator = make_initiator()
    mute = socket.create_server(("127.0.0.1", 0))  # the kernel accepts; nobody ever answers
    try:
        desc, mem = _fake_peer(io, mute.getsockname()[1])
        initiator.engine.register_remote_engine(desc)
        _, lmem = initiator.local(4096)
        with pytest.raises(RuntimeError, match="timeout"):
            initiator.engine.write(lmem, 0, mem, 0, 16, initiator.engine.allocate_transfer_uid())
    finally:
        mute.close()


def test_first_contact_with_something_else_raises(io, make_initiator):
    initiator = make_initiator()
    server = socket.create_server(("127.0.0.1", 0))
    try:
        desc, mem = _fake_peer(io, server.getsockname()[1])
        initiator.engine.register_remote_engine(desc)
        _, lmem = initiator.local(4096)

        def answer_nonsense():
            conn, _ = server.accept()
            conn.recv(4096)
            conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
            conn.close()

        threading.Thread(target=answer_nonsense, daemon=True).start()
        with pytest.raises(RuntimeError):
            initiator.engine.write(lmem, 0, mem, 0, 16, initiator.engine.allocate_transfer_uid())
    finally:
        server.close()
