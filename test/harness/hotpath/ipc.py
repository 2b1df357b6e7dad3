"""`bench hotpath --ipc`: what handing one chunk to a transfer process would cost the scheduler.

A transfer process (docs/design.md, "A transfer process") would own the engine and the threads;
the scheduler's `send()` would only encode one small message per chunk and hand it over. This
measures that hand-off on the sending thread (its CPU clock, encode included, per message) and
its wall time, for the IPCs it could use, with a receiver in another process that decodes every
message (so the sender never outruns a reader that does nothing):

- zmq-ipc: a ZMQ PUSH socket over ipc:// (what our messages use today, over tcp://);
- unix-seqpacket: one send() on an AF_UNIX SOCK_SEQPACKET socket (one syscall, kernel wake-up);
- shm-ring: a shared-memory ring, one slot per message, the receiver polling it (no syscall
  on the sender; the receiver spends a core, outside the scheduler's GIL).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import statistics
import struct
import tempfile
import time
from typing import Optional

import msgspec
import numpy as np


class ChunkHandoff(msgspec.Struct, array_like=True):
    """What the scheduler would hand over per chunk: the room's life, the chunk's pages as
    bytes, where in the request they start, and the last chunk's aux slot."""

    room: int
    life: int
    pages: bytes
    first_page: int
    is_last: bool
    aux_index: Optional[int] = None
    event_handle: Optional[bytes] = None  # an IPC event handle for the forward's readiness


SLOTS = 64
SLOT_BYTES = 8192  # an 8K-token chunk at page 16 is 512 pages = 2 KiB of int32
_HEADER = struct.Struct("<Q")


def _receiver(kind: str, address: str, count: int, ready) -> None:
    decoder = msgspec.msgpack.Decoder(ChunkHandoff)
    if kind == "zmq-ipc":
        import zmq

        ctx = zmq.Context()
        sock = ctx.socket(zmq.PULL)
        sock.bind(address)
        ready.set()
        for _ in range(count):
            decoder.decode(sock.recv())
        sock.close(0)
        ctx.term()
    elif kind == "unix-seqpacket":
        server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        server.bind(address)
        server.listen(1)
        ready.set()
        conn, _ = server.accept()
        for _ in range(count):
            decoder.decode(conn.recv(SLOT_BYTES))
        conn.close()
        server.close()
    else:
        from multiprocessing import shared_memory

        shm = shared_memory.SharedMemory(name=address)
        buf = shm.buf
        ready.set()
        for seq in range(1, count + 1):
            base = ((seq - 1) % SLOTS) * SLOT_BYTES
            while _HEADER.unpack_from(buf, base)[0] != seq:
                pass  # polls: a core of the transfer process, never the scheduler's
            (length,) = struct.unpack_from("<I", buf, base + 8)
            decoder.decode(bytes(buf[base + 12:base + 12 + length]))
            _HEADER.pack_into(buf, base, 0)  # slot free again
        del buf
        shm.close()


def measure(kind: str, pages: int, count: int) -> dict:
    encoder = msgspec.msgpack.Encoder()
    page_list = np.arange(pages, dtype=np.int32)
    ctx = mp.get_context("fork")
    ready = ctx.Event()
    tmp = tempfile.mkdtemp(prefix="mori-ipc-")
    shm = None
    if kind == "zmq-ipc":
        address = f"ipc://{tmp}/chunks"
    elif kind == "unix-seqpacket":
        address = os.path.join(tmp, "chunks.sock")
    else:
        from multiprocessing import shared_memory

        shm = shared_memory.SharedMemory(create=True, size=SLOTS * SLOT_BYTES)
        shm.buf[:] = b"\0" * (SLOTS * SLOT_BYTES)
        address = shm.name
    proc = ctx.Process(target=_receiver, args=(kind, address, count, ready), daemon=True)
    proc.start()
    if not ready.wait(10):
        proc.kill()
        raise RuntimeError(f"{kind}: receiver did not start")
    if kind == "zmq-ipc":
        import zmq

        zctx = zmq.Context()
        sock = zctx.socket(zmq.PUSH)
        sock.connect(address)
        send = sock.send
    elif kind == "unix-seqpacket":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.connect(address)
        send = sock.send
    else:
        buf = shm.buf
        state = {"seq": 0}

        def send(payload: bytes) -> None:
            state["seq"] += 1
            seq = state["seq"]
            base = ((seq - 1) % SLOTS) * SLOT_BYTES
            while _HEADER.unpack_from(buf, base)[0] != 0:
                time.sleep(0)  # ring full: the receiver is behind (not in the measured steady state)
            struct.pack_into("<I", buf, base + 8, len(payload))
            buf[base + 12:base + 12 + len(payload)] = payload
            _HEADER.pack_into(buf, base, seq)  # published last

    cpu, wall = [], []
    for i in range(count):
        c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
        send(encoder.encode(ChunkHandoff(room=i, life=i, pages=page_list.tobytes(), first_page=0, is_last=True,
                                         aux_index=i % 256)))
        cpu.append(time.thread_time_ns() - c0)
        wall.append(time.perf_counter_ns() - w0)
        if i % 8 == 7:
            time.sleep(0.0002)  # requests arrive spaced, not back to back: each send may wake the reader
    proc.join(30)
    if proc.is_alive():  # a message never arrived: end the reader we started, report it
        proc.kill()
        proc.join(5)
    if kind == "zmq-ipc":
        sock.close(0)
        zctx.term()
    elif kind == "unix-seqpacket":
        sock.close()
    else:
        del buf, send
        shm.close()
        shm.unlink()
    warm = slice(count // 10, None)
    return {"ipc": kind, "pages": pages, "messages": count,
            "sender_cpu_us_median": round(statistics.median(cpu[warm]) / 1e3, 2),
            "sender_cpu_us_mean": round(statistics.fmean(cpu[warm]) / 1e3, 2),
            "sender_wall_us_median": round(statistics.median(wall[warm]) / 1e3, 2),
            "receiver_ok": proc.exitcode == 0}


def run_all(pages_list=(16, 512), count: int = 2000) -> list:
    return [measure(kind, pages, count) for pages in pages_list
            for kind in ("zmq-ipc", "unix-seqpacket", "shm-ring")]
