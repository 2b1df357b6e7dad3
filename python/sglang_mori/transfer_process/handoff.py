"""Hand-off records, scheduler -> transfer process, one datagram each on AF_UNIX SOCK_SEQPACKET.

`scripts/bench_handoff.py` measured this transport cheapest for the sender: one `sendmsg`, no
helper thread, record boundaries kept by the kernel. A record is a fixed header, then the chunk's
page indices as raw int64 or int32 (the array's own buffer: SGLang hands numpy int32, and converting
it on the scheduler's thread was O(pages) for nothing), then a tail (the aux items on a chunk that
carries them, the reason on a fail record). The aux items go as their own buffers in the sendmsg
(views of SGLang's metadata rows), so the only copy of them is the kernel's. The scheduler's sends block only while the child's receive queue is full.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass
from typing import List, Optional

import numpy as np

CLAIM, CHUNK, RELEASE, FAIL = 1, 2, 3, 4

# kind, slot, room, slice start, slice stop, real tokens (-1: none), aux index (-1: none),
# flags (bit 0: last chunk, bit 1: pages are int32), number of pages
_HEADER = struct.Struct("<Biqqqqqii")
LAST = 1
PAGES32 = 2
_I32, _I64 = np.dtype(np.int32), np.dtype(np.int64)
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


def _aux_buffers(items) -> list:
    """The tail's buffers for sendmsg: the count and lengths (packed already on AuxRows' items),
    then each item as it is (bytes, or a 1-D uint8 view whose len is its byte count); no join, the
    kernel gathers them."""
    head = getattr(items, "head", None) or struct.pack(f"<H{len(items)}I", len(items), *map(len, items))
    return [head, *items]


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
        if not (isinstance(pages, np.ndarray) and pages.ndim == 1 and (pages.dtype == _I32 or pages.dtype == _I64)
                and pages.flags.c_contiguous):
            pages = np.ascontiguousarray(pages, dtype=np.int64)  # anything else: one conversion
        narrow = PAGES32 if pages.dtype == _I32 else 0
        n = len(pages)
        tokens = -1 if num_kv_tokens is None else int(num_kv_tokens)
        aux_i = -1 if aux_index is None else int(aux_index)
        first = 0
        while True:  # one record per MAX_PAGES pages; the last record carries is_last and aux
            part = pages[first:first + MAX_PAGES]
            final = first + MAX_PAGES >= n
            flags = (LAST if (final and is_last) else 0) | narrow
            sub_start = start + first
            sub_stop = stop if final else sub_start + len(part)
            header = _HEADER.pack(CHUNK, slot, room, sub_start, sub_stop, tokens if final else -1,
                                  aux_i if final else -1, flags, len(part))
            if final and aux is not None:
                self.sock.sendmsg([header, part, *_aux_buffers(aux)])
            else:
                self.sock.sendmsg([header, part])
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
        width = 4 if flags & PAGES32 else 8
        body = _HEADER.size + npages * width
        rec = Record(kind=kind, slot=slot, room=room, start=start, stop=stop,
                     num_kv_tokens=None if tokens < 0 else tokens, aux_index=None if aux_i < 0 else aux_i,
                     is_last=bool(flags & LAST))
        if kind == CHUNK:
            # the child's tables take int64 pages; astype copies out of the reused buffer either way
            rec.pages = np.frombuffer(self.buf, _I32 if width == 4 else _I64, npages, _HEADER.size).astype(np.int64)
            rec.aux = _decode_aux(self.view[body:n])
        elif kind == FAIL:
            reason, _, label = bytes(self.view[body:n]).decode("utf-8", "replace").partition("\0")
            rec.reason, rec.label = reason, label
        return rec
