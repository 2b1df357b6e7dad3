"""Hand-off records, scheduler -> transfer process, one datagram each on AF_UNIX SOCK_SEQPACKET.

`scripts/bench_handoff.py` measured this transport cheapest for the sender: one `sendmsg`, no
helper thread, record boundaries kept by the kernel. A record is a fixed header, then the chunk's
page indices as raw int64, then a tail (the aux items on a chunk that carries them, the reason on a
fail record). The scheduler's sends block only while the child's receive queue is full.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass
from typing import List, Optional

import numpy as np

CLAIM, CHUNK, RELEASE, FAIL = 1, 2, 3, 4

# kind, slot, room, slice start, slice stop, real tokens (-1: none), aux index (-1: none),
# flags (bit 0: last chunk), number of pages
_HEADER = struct.Struct("<Biqqqqqii")
LAST = 1
# Pages per record: a longer chunk goes as several records over consecutive index slices (as if
# SGLang had sent smaller chunks), so one record stays under the kernel's default socket buffer.
MAX_PAGES = 16384
MAX_RECORD = _HEADER.size + MAX_PAGES * 8 + 65536
SOCKET_BUFFER = 1 << 21


@dataclass
class Record:
    kind: int
    slot: int
    room: int
    start: int = 0
    stop: int = 0
    num_kv_tokens: Optional[int] = None
    aux_index: Optional[int] = None
    is_last: bool = False
    pages: Optional[np.ndarray] = None
    aux: Optional[List[bytes]] = None  # CHUNK: this room's aux items (rides on the last chunk)
    reason: str = ""  # FAIL
    label: str = ""  # FAIL: the metrics label


def channel_pair():
    """(scheduler's end, child's end)."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    for s in (a, b):
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            s.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER)
    return a, b


def _encode_aux(items: Optional[List[bytes]]) -> bytes:
    if items is None:
        return b""
    lengths = struct.pack(f"<H{len(items)}I", len(items), *(len(i) for i in items))
    return lengths + b"".join(items)


def _decode_aux(tail: memoryview) -> Optional[List[bytes]]:
    if not len(tail):
        return None
    (count,) = struct.unpack_from("<H", tail, 0)
    lengths = struct.unpack_from(f"<{count}I", tail, 2)
    out, offset = [], 2 + 4 * count
    for n in lengths:
        out.append(bytes(tail[offset:offset + n]))
        offset += n
    return out


class Sender:
    """The scheduler's end. One lock-free caller (SGLang's scheduler thread)."""

    def __init__(self, sock: socket.socket):
        self.sock = sock

    def claim(self, slot: int, room: int) -> None:
        self.sock.send(_HEADER.pack(CLAIM, slot, room, 0, 0, -1, -1, 0, 0))

    def release(self, slot: int, room: int) -> None:
        self.sock.send(_HEADER.pack(RELEASE, slot, room, 0, 0, -1, -1, 0, 0))

    def fail(self, slot: int, room: int, reason: str, label: str) -> None:
        tail = f"{reason}\0{label}".encode("utf-8", "replace")
        self.sock.send(_HEADER.pack(FAIL, slot, room, 0, 0, -1, -1, 0, 0) + tail)

    def chunk(self, slot: int, room: int, pages: np.ndarray, start: int, stop: int, is_last: bool,
              aux_index: Optional[int], aux: Optional[List[bytes]], num_kv_tokens: Optional[int]) -> None:
        pages = np.ascontiguousarray(pages, dtype=np.int64)
        n = len(pages)
        tokens = -1 if num_kv_tokens is None else int(num_kv_tokens)
        aux_i = -1 if aux_index is None else int(aux_index)
        first = 0
        while True:  # one record per MAX_PAGES pages; the last record carries is_last and aux
            part = pages[first:first + MAX_PAGES]
            final = first + MAX_PAGES >= n
            flags = LAST if (final and is_last) else 0
            sub_start = start + first
            sub_stop = stop if final else sub_start + len(part)
            header = _HEADER.pack(CHUNK, slot, room, sub_start, sub_stop, tokens if final else -1,
                                  aux_i if final else -1, flags, len(part))
            self.sock.sendmsg([header, part.data, _encode_aux(aux) if final else b""])
            if final:
                return
            first += MAX_PAGES


class Receiver:
    """The child's end: blocks for the next record; None when the scheduler's end is closed."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.buf = bytearray(MAX_RECORD)
        self.view = memoryview(self.buf)

    def next(self) -> Optional[Record]:
        n = self.sock.recv_into(self.buf)
        if n == 0:
            return None
        kind, slot, room, start, stop, tokens, aux_i, flags, npages = _HEADER.unpack_from(self.buf, 0)
        body = _HEADER.size + npages * 8
        rec = Record(kind=kind, slot=slot, room=room, start=start, stop=stop,
                     num_kv_tokens=None if tokens < 0 else tokens, aux_index=None if aux_i < 0 else aux_i,
                     is_last=bool(flags & LAST))
        if kind == CHUNK:
            rec.pages = np.frombuffer(self.buf, np.int64, npages, _HEADER.size).copy()
            rec.aux = _decode_aux(self.view[body:n])
        elif kind == FAIL:
            reason, _, label = bytes(self.view[body:n]).decode("utf-8", "replace").partition("\0")
            rec.reason, rec.label = reason, label
        return rec
