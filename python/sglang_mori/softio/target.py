"""The target side of an engine: it plays the NIC for memory registered with this engine.

A listener accepts connections from initiators; each connection gets its own thread that lands
WRITE frames directly in registered memory, serves READ frames from it, answers SIGNALED frames
with an ACK and counts notifications. The application on this side does nothing. Intra-host lanes
(intrahost.py) land the same way, except that the bytes are copied from the initiator's memory by
cross-memory attach instead of being read from the socket.

Anything that is not a well-formed softio frame for a live region (a stranger, garbage, a
truncated frame, an unknown region, an out-of-range offset) drops that one connection with a log
line; the engine keeps serving everybody else.
"""

from __future__ import annotations

import logging
import socket
import threading
import time

from . import intrahost, wire, xmem
from .wire import (FLAG_SIGNALED, HEADER, OP_ACK, OP_ASK_MR, OP_MR_INFO, OP_NOTIFY, OP_PULL,
                   OP_PUSH, OP_READ, OP_READ_RESP, OP_WRITE, FrameReader, ProtocolError)

logger = logging.getLogger("sglang_mori.softio")


class TargetServer:
    def __init__(self, core, host: str, port: int, socket_buffer: int, rto_max_ms: int,
                 handshake_timeout, accept_intra_host: bool = True):
        self._core = core
        self._accept_intra_host = accept_intra_host
        self._socket_buffer = socket_buffer
        self._rto_max_ms = rto_max_ms  # ACKs and read responses go back over the same connection
        self._handshake_timeout = handshake_timeout
        self._lock = threading.Lock()
        self._inbound: dict[str, set] = {}
        self._closed = False
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((host, port))
            listener.listen(512)
        except OSError as exc:
            listener.close()
            raise RuntimeError(f"softio: cannot listen on {host}:{port}: {exc}") from None
        self._listener = listener
        self.port = listener.getsockname()[1]
        self._thread = threading.Thread(target=self._accept_loop, daemon=True,
                                        name=f"softio-listen-{self.port}")
        self._thread.start()

    # ---- lifecycle -------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop listening and reset every inbound connection."""
        with self._lock:
            self._closed = True
            conns = [c for group in self._inbound.values() for c in group]
            self._inbound.clear()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        except OSError:
            pass
        self._listener.close()
        for conn in conns:
            wire.abort_socket(conn)

    def abort_initiator(self, initiator_key: str) -> None:
        with self._lock:
            conns = self._inbound.pop(initiator_key, set())
        for conn in conns:
            wire.abort_socket(conn)

    # ---- connections -----------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while True:
            try:
                conn, addr = self._listener.accept()
            except OSError:
                return  # listener closed
            if self._closed:
                wire.abort_socket(conn)
                return
            threading.Thread(target=self._serve, args=(conn, addr), daemon=True,
                             name=f"softio-target-{self.port}").start()

    def _serve(self, conn: socket.socket, addr) -> None:
        initiator = None
        try:
            kind, initiator, pid = self._handshake(conn)
            with self._lock:
                if self._closed:
                    raise EOFError("engine shut down")
                self._inbound.setdefault(initiator, set()).add(conn)
            if kind == wire.KIND_CONTROL:
                self._serve_control(conn)
            else:
                self._serve_lane(conn, initiator, pid)
        except EOFError:
            logger.debug("softio %s: connection from %s closed", self._core.key, addr)
        except (ProtocolError, socket.timeout, UnicodeDecodeError) as exc:
            logger.warning("softio %s: dropping connection from %s (%s): %s", self._core.key,
                           initiator or "unknown initiator", addr, exc)
        except OSError as exc:
            logger.info("softio %s: connection from %s (%s) failed: %s", self._core.key,
                        initiator or "unknown initiator", addr, exc)
        finally:
            if initiator is not None:
                with self._lock:
                    group = self._inbound.get(initiator)
                    if group is not None:
                        group.discard(conn)
                        if not group:
                            del self._inbound[initiator]
            wire.abort_socket(conn)

    def _handshake(self, conn: socket.socket):
        conn.settimeout(self._handshake_timeout)
        magic, kind, lane, _, key_len, target_len = wire.HELLO.unpack(
            wire.recv_exact(conn, wire.HELLO.size))
        if magic != wire.MAGIC or kind not in (wire.KIND_LANE, wire.KIND_CONTROL,
                                               wire.KIND_INTRA_LANE):
            raise ProtocolError("not a softio hello")
        if key_len == 0 or key_len > wire.MAX_KEY_BYTES or target_len > wire.MAX_KEY_BYTES:
            raise ProtocolError("bad key length in hello")
        initiator = wire.recv_exact(conn, key_len).decode()
        expected = wire.recv_exact(conn, target_len).decode()
        pid = None
        if kind == wire.KIND_INTRA_LANE:
            pid, token_addr, token = wire.INTRA_HELLO.unpack(
                wire.recv_exact(conn, wire.INTRA_HELLO.size))
        own = self._core.key.encode()
        if expected != self._core.key:
            conn.sendall(wire.HELLO_REPLY.pack(wire.MAGIC, wire.HELLO_WRONG_TARGET, len(own)) + own)
            raise ProtocolError(f"initiator {initiator} expected engine {expected!r}")
        if pid is not None:
            refusal = ("this engine forces TCP" if not self._accept_intra_host
                       else xmem.probe(pid, token_addr, token))
            if refusal is not None:
                logger.info("softio %s: no intra-host lane for %s: %s; it uses TCP",
                            self._core.key, initiator, refusal)
                conn.sendall(wire.HELLO_REPLY.pack(wire.MAGIC, wire.HELLO_NO_INTRA, len(own))
                             + own)
                try:  # a graceful end: the initiator closes once it has read the answer
                    conn.shutdown(socket.SHUT_WR)
                    conn.recv(1)
                except OSError:
                    pass
                raise EOFError("intra-host lane refused")
        conn.sendall(wire.HELLO_REPLY.pack(wire.MAGIC, wire.HELLO_OK, len(own)) + own)
        conn.settimeout(None)
        wire.tune_socket(conn, self._socket_buffer, self._rto_max_ms)
        return kind, initiator, pid

    def _serve_lane(self, conn: socket.socket, initiator: str, pid: int | None) -> None:
        """Land frames in order; `pid` is the initiator's process on an intra-host lane."""
        reader = FrameReader(conn)
        memory = self._core.memory
        write_log = self._core.write_log
        notifications = self._core.notifications
        pack = HEADER.pack
        monotonic = time.monotonic
        while True:
            op, flags, count, region_id, offset, size, tag = reader.read_header()
            if op == OP_WRITE:
                region = _region(memory, region_id, offset, size, "write to")
                if size:
                    reader.read_into(region.view[offset:offset + size])
                if write_log.enabled:
                    write_log.record(region_id, offset, size, monotonic(), initiator)
                if flags & FLAG_SIGNALED:
                    conn.sendall(pack(OP_ACK, 0, 0, 0, 0, 0, tag))
            elif op == OP_PULL or op == OP_PUSH:
                if pid is None:
                    raise ProtocolError("intra-host frame on a TCP lane")
                region = _region(memory, region_id, offset, size,
                                 "write to" if op == OP_PULL else "read from")
                intrahost.land(reader, region, op, offset, size, count, pid)
                if op == OP_PULL and write_log.enabled:
                    write_log.record(region_id, offset, size, monotonic(), initiator)
                if flags & FLAG_SIGNALED:
                    conn.sendall(pack(OP_ACK, 0, 0, 0, 0, 0, tag))
            elif op == OP_READ:
                region = _region(memory, region_id, offset, size, "read from")
                end = offset + size
                header = pack(OP_READ_RESP, flags, 0, region_id, offset, size, tag)
                if size:
                    wire.send_buffers(conn, [header, region.view[offset:end]])
                else:
                    conn.sendall(header)
            elif op == OP_NOTIFY:
                notifications.arrive(initiator, offset, size)
            else:
                raise ProtocolError(f"unknown frame op {op}")

    def _serve_control(self, conn: socket.socket) -> None:
        reader = FrameReader(conn, staging_bytes=4096 + wire.SMALL_PAYLOAD)
        while True:
            op, _, _, region_id, _, _, tag = reader.read_header()
            if op != OP_ASK_MR:
                raise ProtocolError(f"unknown control op {op}")
            region = self._core.memory.get(region_id)
            size, found = (region.size, 1) if region is not None else (0, 0)
            conn.sendall(HEADER.pack(OP_MR_INFO, 0, 0, region_id, 0, size, found))


def _region(memory, region_id: int, offset: int, size: int, verb: str):
    """The live region a frame names, or ProtocolError (the connection is then dropped)."""
    region = memory.get(region_id)
    if region is None:
        raise ProtocolError(f"{verb} unregistered region {region_id}")
    if region.device is not None:
        # Device memory is written by the device path only; a host lane would touch it from the CPU.
        raise ProtocolError(f"{verb} device region {region_id} over a host lane")
    end = offset + size
    if end > region.size:
        raise ProtocolError(f"{verb} [{offset}, {end}) outside region {region_id} "
                            f"of {region.size} bytes")
    return region
