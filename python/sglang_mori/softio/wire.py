"""Byte format of the softio data and control connections, and zero-copy socket helpers.

Every connection starts with a HELLO naming its kind (lane or control), the initiator's engine key
and the target key it expects. After that both directions carry fixed 32-byte frame headers:

    op u8 | flags u8 | pad u16 | region u32 | offset u64 | size u64 | tag u64     (little endian)

WRITE is followed by `size` payload bytes that the target receives straight into the region;
READ asks the target to send a READ_RESP with `size` bytes; a SIGNALED frame is answered by an ACK
carrying its tag. One header per merged range: payload pieces of a gathered range follow the
header back to back.

Intra-host lanes (softio/intrahost.py) carry no payload bytes: PULL and PUSH name the initiator's
memory instead, as `pad` pieces of (address u64, length u64) after the header, and the target
copies between that memory and its region with cross-memory attach.
"""

from __future__ import annotations

import logging
import socket
import struct

logger = logging.getLogger("sglang_mori.softio")

HEADER = struct.Struct("<BBHIQQQ")
HEADER_SIZE = HEADER.size  # 32

# initiator -> target
OP_WRITE = 1
OP_READ = 2
OP_NOTIFY = 3  # region = lane index, offset = transfer uid, size = number of lanes
OP_ASK_MR = 4  # control connection: region = memory id
OP_PULL = 5  # intra-host write: the target copies the pieces from the initiator into the region
OP_PUSH = 6  # intra-host read: the target copies the region into the initiator's pieces
# target -> initiator
OP_ACK = 0x81
OP_READ_RESP = 0x82
OP_MR_INFO = 0x84  # size = registered length, tag = 1 if the region exists

FLAG_SIGNALED = 1

MAGIC = b"SOFTIO\x01\x00"
HELLO = struct.Struct("<8sBBHHH")  # magic, kind, lane, pad, initiator key len, target key len
HELLO_REPLY = struct.Struct("<8sBxH")  # magic, status, own key len
KIND_LANE = 1
KIND_CONTROL = 2
KIND_INTRA_LANE = 3  # followed by INTRA_HELLO: the initiator's pid and a token to prove it
HELLO_OK = 0
HELLO_WRONG_TARGET = 1
HELLO_NO_INTRA = 2  # the target cannot (or will not) reach the initiator's memory: use TCP
INTRA_HELLO = struct.Struct("<QQQ")  # initiator pid, address of its token, token value
PIECE = struct.Struct("<QQ")  # address, length (in the initiator's address space)
MAX_PIECES = 64
MAX_KEY_BYTES = 4096

IOV_MAX = 1024  # Linux limit on buffers per sendmsg
# Payloads at most this large are received through the staging buffer (one recv may bring many
# small frames); larger ones go straight from the socket into the destination memory.
SMALL_PAYLOAD = 64 * 1024
STAGING_BYTES = 1024 * 1024
_AFTER_LARGE_LIMIT = 4096


class ProtocolError(Exception):
    """The peer sent something that is not a softio frame; the connection must be dropped."""


def pack_header(op: int, flags: int, region: int, offset: int, size: int, tag: int) -> bytes:
    return HEADER.pack(op, flags, 0, region, offset, size, tag)


# Linux 6.15+: the largest retransmission timeout of this socket, in ms (the kernel's is 120 s).
TCP_RTO_MAX_MS = 44


def tune_socket(sock: socket.socket, buffer_bytes: int, rto_max_ms: int = 0) -> bool:
    """Low latency for headers and ACKs, large buffers for bulk payloads, and, with `rto_max_ms`,
    retransmissions at least that often while data is unacknowledged: after packets were lost
    for a while (a slow or cut link), the kernel's exponential backoff would otherwise wait up to
    two minutes before trying again, long after the link is back. The connection's own lifetime
    is unchanged (TCP_USER_TIMEOUT pins it to what tcp_retries2 gives with the kernel's backoff).
    False when the kernel cannot cap the timeout (older than 6.15; said once in the log)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if buffer_bytes > 0:
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            try:
                sock.setsockopt(socket.SOL_SOCKET, opt, buffer_bytes)
            except OSError:
                pass
    if rto_max_ms <= 0:
        return True
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, _LIFETIME_MS)
        sock.setsockopt(socket.IPPROTO_TCP, TCP_RTO_MAX_MS, rto_max_ms)
    except OSError as exc:
        global _rto_cap_refused
        if not _rto_cap_refused:
            _rto_cap_refused = True
            logger.warning("softio: this kernel cannot cap TCP retransmission timeouts (%s): after a "
                           "lossy stretch of the link a lane may wait up to 120 s to resume", exc)
        return False
    return True


_rto_cap_refused = False
# How long unacknowledged data keeps a connection alive, as with the kernel's defaults: tcp_retries2
# (15) retransmissions backed off from 200 ms up to 120 s take about 924.6 s. A lower maximum
# timeout alone would also shorten that (the kernel derives it from the same backoff), and a lane
# must survive a cut link as long as before.
_LIFETIME_MS = 924_600


def abort_socket(sock: socket.socket) -> None:
    """Close with RST (SO_LINGER 0), as a dying process or a broken QP would look to the peer."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass


def send_buffers(sock: socket.socket, buffers: list) -> None:
    """sendmsg the buffers in order, without copying them, until every byte is out."""
    if len(buffers) == 1:
        sock.sendall(buffers[0])
        return
    index, count = 0, len(buffers)
    while index < count:
        chunk = buffers[index:index + IOV_MAX]
        sent = sock.sendmsg(chunk)
        for buf in chunk:
            length = len(buf)
            if sent >= length:
                sent -= length
                index += 1
                continue
            # Partial send: keep the unsent tail of this buffer and go on from there.
            buffers[index] = memoryview(buf)[sent:]
            break


def recv_exact(sock: socket.socket, size: int) -> bytes:
    """Small blocking read used by handshakes and the control connection."""
    data = bytearray(size)
    view = memoryview(data)
    got = 0
    while got < size:
        n = sock.recv_into(view[got:])
        if n == 0:
            raise EOFError("connection closed by peer")
        got += n
    return bytes(data)


class FrameReader:
    """Buffered reader of frame headers that lands large payloads directly in their destination."""

    __slots__ = ("_sock", "_buf", "_view", "_start", "_end", "_limit")

    def __init__(self, sock: socket.socket, staging_bytes: int = STAGING_BYTES):
        self._sock = sock
        self._buf = bytearray(staging_bytes)
        self._view = memoryview(self._buf)
        self._start = 0
        self._end = 0
        # Bytes one recv may stage. Large after small frames (many frames per syscall); small
        # after a large payload, so the next header does not drag payload through the staging
        # buffer (that would cost a second copy).
        self._limit = staging_bytes

    def _fill(self) -> None:
        if self._start == self._end:
            self._start = self._end = 0
        elif len(self._buf) - self._end < SMALL_PAYLOAD + HEADER_SIZE:
            # Compact: move the unread tail to the front so a header and a small payload fit.
            tail = self._end - self._start
            self._view[:tail] = self._view[self._start:self._end]
            self._start, self._end = 0, tail
        n = self._sock.recv_into(self._view[self._end:self._end + self._limit])
        if n == 0:
            raise EOFError("connection closed by peer")
        self._end += n

    def read_header(self) -> tuple:
        while self._end - self._start < HEADER_SIZE:
            self._fill()
        fields = HEADER.unpack_from(self._buf, self._start)
        self._start += HEADER_SIZE
        return fields

    def read_into(self, dst: memoryview) -> None:
        need = len(dst)
        avail = self._end - self._start
        if avail:
            take = avail if avail < need else need
            dst[:take] = self._view[self._start:self._start + take]
            self._start += take
            if take == need:
                return
            dst = dst[take:]
            need -= take
        if need <= SMALL_PAYLOAD:
            self._limit = len(self._buf)
            while self._end - self._start < need:
                self._fill()
            dst[:] = self._view[self._start:self._start + need]
            self._start += need
            return
        self._limit = _AFTER_LARGE_LIMIT
        sock = self._sock
        got = 0
        while got < need:
            n = sock.recv_into(dst[got:])
            if n == 0:
                raise EOFError("connection closed by peer")
            got += n
