#!/usr/bin/env python3
"""What handing one chunk to a transfer process would cost the prefill scheduler (issue 28).

A transfer process would own the MORI-IO engine and our threads; the scheduler's `send()` would
only hand over (room id, the chunk's KV page indices as int64, is_last, aux index) to it. This
measures that hand-off alone, on CPU, for three transports, with a receiver in another process
that decodes each chunk and checks its pages:

  zmq        a msgspec-encoded struct, one frame on a ZMQ PUSH socket over ipc://
             (our messages use ZMQ today; libzmq's I/O thread in the sender does the write)
  seqpacket  a fixed binary header and the raw page array in one sendmsg() on an AF_UNIX
             SOCK_SEQPACKET socket (one system call, no encoder, no helper thread)
  shm-ring   the header and pages copied into a slot of a multiprocessing.shared_memory ring,
             published by a sequence number written last, the receiver woken by an eventfd
             write per chunk (one system call)
  shm-poll   the same ring, no system call at all on the sender: the receiver looks at the ring
             every --poll-us while idle (its own CPU and up to that much latency, never the
             scheduler's)
  none       the floor: the same header and page copy into private memory, no receiver (what
             any Python of that size costs the sending thread at that rate on this host)

Per chunk, on the sending (scheduler) side: the calling thread's CPU clock around the send
(encode included), its wall time, and the CPU of the sender's other threads (libzmq's I/O thread;
read from /proc/self/task/*/schedstat) divided by the chunks; on the receiving side: the latency
from just before the send to the decoded pages (CLOCK_MONOTONIC, shared by both processes) and the
receiver's CPU per chunk. Rates: paced at 50 and 200 chunks/s, and as fast as the receiver takes
them. Every loop is bounded in count and in time.

    nice -n 19 flock /tmp/heavy-cpu.lock .venv/bin/python scripts/bench_handoff.py
    .venv/bin/python scripts/bench_handoff.py --transports zmq --pages 512 --rates 200 --json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import socket
import struct
import sys
import tempfile
import threading
import time

import msgspec
import numpy as np

# room, aux (-1 = none), sent_ns, page count, is_last; padded to 32 bytes so pages stay aligned
HEADER = struct.Struct("<qqqIB3x")
END_ROOM = -1  # the last message: its aux field carries how many chunks were sent
SLOTS = 64
RECEIVER_IDLE_S = 5.0  # a receiver that hears nothing this long gives up (bounded waits)


class ChunkHandoff(msgspec.Struct, array_like=True):
    room: int
    pages: bytes
    is_last: bool
    aux: int
    sent_ns: int


# ---------------------------------------------------------------- senders (scheduler side)


class ZmqSender:
    def __init__(self, address: str):
        import zmq

        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 2000)
        self._sock.connect(address)
        self._encode = msgspec.msgpack.Encoder().encode

    def send(self, room: int, pages: np.ndarray, is_last: bool, aux: int) -> None:
        self._sock.send(self._encode(ChunkHandoff(room, pages.tobytes(), is_last, aux,
                                                  time.monotonic_ns())))

    def close(self) -> None:
        self._sock.close()
        self._ctx.term()


class SeqpacketSender:
    def __init__(self, address: str):
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock.connect(address)

    def send(self, room: int, pages: np.ndarray, is_last: bool, aux: int) -> None:
        header = HEADER.pack(room, aux, time.monotonic_ns(), len(pages), is_last)
        self._sock.sendmsg([header, pages])  # scatter: no concatenation copy

    def close(self) -> None:
        self._sock.close()


class ShmRing:
    """A ring of fixed slots: [seq u64][header][pages]; seq 0 = free, written last when full."""

    def __init__(self, shm, max_pages: int):
        self.slot_bytes = 8 + HEADER.size + 8 * max_pages
        self.slot_bytes = (self.slot_bytes + 63) // 64 * 64
        self.buf = shm.buf
        self.seqs = [np.ndarray((1,), np.uint64, self.buf, i * self.slot_bytes) for i in range(SLOTS)]

    def slot(self, seq: int) -> int:
        return ((seq - 1) % SLOTS) * self.slot_bytes


class ShmRingSender:
    def __init__(self, ring: ShmRing, wake_fd: int, deadline: float):
        self._ring = ring
        self._wake_fd = wake_fd
        self._seq = 0
        self._deadline = deadline

    def send(self, room: int, pages: np.ndarray, is_last: bool, aux: int) -> None:
        self._seq += 1
        ring, base = self._ring, self._ring.slot(self._seq)
        seq_cell = ring.seqs[(self._seq - 1) % SLOTS]
        while seq_cell[0] != 0:  # ring full: the receiver is behind
            if time.monotonic() > self._deadline:
                raise TimeoutError("shm-ring: receiver stopped taking chunks")
            time.sleep(20e-6)
        HEADER.pack_into(ring.buf, base + 8, room, aux, time.monotonic_ns(), len(pages), is_last)
        start = base + 8 + HEADER.size
        ring.buf[start:start + pages.nbytes] = pages.view(np.uint8)
        seq_cell[0] = self._seq  # published last (x86 keeps store order; a benchmark, not a product)
        if self._wake_fd >= 0:
            os.eventfd_write(self._wake_fd, 1)

    def close(self) -> None:
        pass


class NullSender:
    """The shm senders' Python work into private memory: the cost floor of any hand-off."""

    def __init__(self, max_pages: int):
        self._buf = memoryview(bytearray(HEADER.size + 8 * max_pages))

    def send(self, room: int, pages: np.ndarray, is_last: bool, aux: int) -> None:
        HEADER.pack_into(self._buf, 0, room, aux, time.monotonic_ns(), len(pages), is_last)
        self._buf[HEADER.size:HEADER.size + pages.nbytes] = pages.view(np.uint8)

    def close(self) -> None:
        pass


# ---------------------------------------------------------------- receivers (transfer side)


class _Checker:
    """Decodes nothing itself: records latency and checks the pages each chunk should carry."""

    def __init__(self):
        self.latencies: list[int] = []
        self.errors = 0
        self.expected_room = 0
        self.sent_total = None

    def chunk(self, room: int, pages: np.ndarray, is_last: bool, aux: int, sent_ns: int) -> None:
        now = time.monotonic_ns()
        if room == END_ROOM:
            self.sent_total = aux
            return
        self.latencies.append(now - sent_ns)
        n = len(pages)
        if (room != self.expected_room or n == 0 or int(pages[0]) != room
                or int(pages[-1]) != room + n - 1 or is_last != (room % 4 == 3)
                or aux != (room % 256 if is_last else -1)):
            self.errors += 1
        self.expected_room = room + 1

    @property
    def done(self) -> bool:
        return self.sent_total is not None and len(self.latencies) >= self.sent_total


def _receive_zmq(address: str, ready, check: _Checker) -> None:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.RCVTIMEO, int(RECEIVER_IDLE_S * 1000))
    sock.bind(address)
    ready.set()
    decode = msgspec.msgpack.Decoder(ChunkHandoff).decode
    try:
        while not check.done:
            msg = decode(sock.recv())
            check.chunk(msg.room, np.frombuffer(msg.pages, np.int64), msg.is_last, msg.aux, msg.sent_ns)
    except zmq.Again:
        pass
    finally:
        sock.close(0)
        ctx.term()


def _receive_seqpacket(address: str, ready, check: _Checker, max_pages: int) -> None:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server.bind(address)
    server.listen(1)
    server.settimeout(RECEIVER_IDLE_S)
    ready.set()
    buf = bytearray(HEADER.size + 8 * max_pages)
    view = memoryview(buf)
    try:
        conn, _ = server.accept()
        conn.settimeout(RECEIVER_IDLE_S)
        while not check.done:
            n = conn.recv_into(buf)
            if n == 0:
                break
            room, aux, sent_ns, npages, is_last = HEADER.unpack_from(buf, 0)
            pages = np.frombuffer(view[HEADER.size:HEADER.size + 8 * npages], np.int64)
            check.chunk(room, pages, bool(is_last), aux, sent_ns)
        conn.close()
    except socket.timeout:
        pass
    finally:
        server.close()


def _receive_shm(shm_name: str, wake_fd: int, poll_s: float, ready, check: _Checker,
                 max_pages: int) -> None:
    import select
    from multiprocessing import shared_memory

    shm = shared_memory.SharedMemory(name=shm_name)
    ring = ShmRing(shm, max_pages)
    ready.set()
    seq = 1
    cell = None
    idle_since = time.monotonic()
    try:
        while not check.done:
            cell = ring.seqs[(seq - 1) % SLOTS]
            if cell[0] != seq:
                if wake_fd >= 0:
                    if not select.select([wake_fd], [], [], RECEIVER_IDLE_S)[0]:
                        break
                    os.eventfd_read(wake_fd)
                else:
                    if time.monotonic() - idle_since > RECEIVER_IDLE_S:
                        break
                    time.sleep(poll_s)
                continue
            idle_since = time.monotonic()
            base = ring.slot(seq) + 8
            room, aux, sent_ns, npages, is_last = HEADER.unpack_from(ring.buf, base)
            start = base + HEADER.size
            pages = np.frombuffer(ring.buf[start:start + 8 * npages], np.int64).copy()
            cell[0] = 0  # slot free again
            check.chunk(room, pages, bool(is_last), aux, sent_ns)
            seq += 1
    finally:
        del ring, cell
        shm.close()


def _receiver_main(transport: str, address: str, wake_fd: int, poll_s: float, max_pages: int, ready,
                   result_conn) -> None:
    check = _Checker()
    cpu0 = time.thread_time_ns()
    try:
        if transport == "zmq":
            _receive_zmq(address, ready, check)
        elif transport == "seqpacket":
            _receive_seqpacket(address, ready, check, max_pages)
        else:
            _receive_shm(address, wake_fd, poll_s, ready, check, max_pages)
    finally:
        result_conn.send({
            "latencies_ns": check.latencies,
            "errors": check.errors,
            "sent_total": check.sent_total,
            "cpu_ns": time.thread_time_ns() - cpu0,
        })
        result_conn.close()


# ---------------------------------------------------------------- one case


def _task_cpu_ns() -> dict[int, int]:
    """CPU ns of every thread of this process (schedstat's first field), by thread id."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                out[int(tid)] = int(f.read().split()[0])
        except (OSError, ValueError):
            pass
    return out


def _pct(values, q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else float("nan")


def run_case(transport: str, pages_per_chunk: int, rate: float, count: int, seconds: float,
             max_pages: int, poll_s: float = 100e-6, spin: bool = False) -> dict:
    """One transport, one chunk size, one rate (0 = as fast as possible)."""
    ctx = mp.get_context("fork")
    ready = ctx.Event()
    parent_conn, child_conn = ctx.Pipe(duplex=False)
    tmp = tempfile.mkdtemp(prefix="handoff-")
    shm = None
    wake_fd = -1
    deadline = time.monotonic() + seconds + 10.0
    if transport == "zmq":
        address = f"ipc://{tmp}/chunks"
    elif transport == "seqpacket":
        address = os.path.join(tmp, "chunks.sock")
    elif transport != "none":
        from multiprocessing import shared_memory

        slot_bytes = (8 + HEADER.size + 8 * max_pages + 63) // 64 * 64
        shm = shared_memory.SharedMemory(create=True, size=SLOTS * slot_bytes)
        shm.buf[:] = bytes(SLOTS * slot_bytes)
        address = shm.name
        if transport == "shm-ring":
            wake_fd = os.eventfd(0, os.EFD_NONBLOCK)
    proc = None
    if transport != "none":
        proc = ctx.Process(target=_receiver_main,
                           args=(transport, address, wake_fd, poll_s, max_pages, ready, child_conn),
                           daemon=True)
        proc.start()
        if not ready.wait(10):
            proc.kill()
            raise RuntimeError(f"{transport}: receiver did not start")
    child_conn.close()
    if transport == "none":
        sender = NullSender(max_pages)
    elif transport == "zmq":
        sender = ZmqSender(address)
    elif transport == "seqpacket":
        for _ in range(200):  # the receiver binds then listens; connect once it does (bounded)
            try:
                sender = SeqpacketSender(address)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                time.sleep(0.01)
        else:
            raise RuntimeError("seqpacket: could not connect")
    else:
        ring = ShmRing(shm, max_pages)
        sender = ShmRingSender(ring, wake_fd, deadline)

    base = np.arange(pages_per_chunk, dtype=np.int64)
    warmup = min(20, count // 10)
    send_cpu, send_wall = [], []
    main_tid = threading.get_native_id()
    tasks0 = None
    t0 = time.monotonic()
    stop_at = t0 + seconds
    sent = 0
    for i in range(count):
        if rate > 0:
            due = t0 + i / rate
            if spin:  # the thread stays on its core between chunks, as a busy scheduler loop does
                while time.monotonic() < due:
                    pass
            else:
                pause = due - time.monotonic()
                if pause > 0:
                    time.sleep(pause)
        if time.monotonic() > stop_at:
            break
        if i == warmup:
            tasks0 = _task_cpu_ns()
            measured_from = time.monotonic()
        pages = base + i  # the chunk's page indices (outside the measured hand-off)
        is_last = i % 4 == 3
        aux = i % 256 if is_last else -1
        c0 = time.thread_time_ns()
        w0 = time.perf_counter_ns()
        sender.send(i, pages, is_last, aux)
        w1 = time.perf_counter_ns()
        c1 = time.thread_time_ns()
        if i >= warmup:
            send_cpu.append(c1 - c0)
            send_wall.append(w1 - w0)
        sent += 1
    tasks1 = _task_cpu_ns()
    elapsed = time.monotonic() - (measured_from if tasks0 else t0)
    if proc is None:
        result = {"latencies_ns": [0] * sent, "errors": 0, "cpu_ns": 0}
    else:
        sender.send(END_ROOM, base[:1], False, sent)
        result = parent_conn.recv() if parent_conn.poll(RECEIVER_IDLE_S + 5) else None
        proc.join(10)
        if proc.is_alive():  # bounded: end the receiver this case started
            proc.kill()
            proc.join(5)
    sender.close()
    shutil.rmtree(tmp, ignore_errors=True)
    if shm is not None:
        del ring, sender
        shm.close()
        shm.unlink()
        if wake_fd >= 0:
            os.close(wake_fd)
    measured = len(send_cpu)
    other_ns = 0
    if tasks0:
        other_ns = sum(tasks1.get(t, 0) - tasks0.get(t, 0) for t in tasks1 if t != main_tid)
    if result is None:
        raise RuntimeError(f"{transport}: receiver sent no result")
    lat = np.array(result["latencies_ns"][warmup:] if proc else [], dtype=np.int64) / 1000.0
    return {
        "transport": transport,
        "pace": "spin" if spin and rate > 0 else ("sleep" if rate > 0 else "none"),
        "pages": pages_per_chunk,
        "rate": rate,
        "sent": sent,
        "received": len(result["latencies_ns"]),
        "errors": result["errors"] + (sent - len(result["latencies_ns"])),
        "chunks_per_s": measured / elapsed if elapsed > 0 else float("nan"),
        "send_cpu_us_p50": _pct(send_cpu, 50) / 1000,
        "send_cpu_us_mean": (sum(send_cpu) / measured / 1000) if measured else float("nan"),
        "send_cpu_us_p99": _pct(send_cpu, 99) / 1000,
        "send_wall_us_p50": _pct(send_wall, 50) / 1000,
        "send_wall_us_p99": _pct(send_wall, 99) / 1000,
        "other_threads_cpu_us_per_chunk": other_ns / measured / 1000 if measured else float("nan"),
        "latency_us_p50": _pct(lat, 50),
        "latency_us_p99": _pct(lat, 99),
        "receiver_cpu_us_per_chunk": result["cpu_ns"] / max(1, len(result["latencies_ns"])) / 1000,
    }


def measure_status_read(reads: int = 200_000) -> float:
    """The scheduler's poll() reading one room's status from a shared-memory table (ns per read)."""
    from multiprocessing import shared_memory

    shm = shared_memory.SharedMemory(create=True, size=4096)
    try:
        table = np.ndarray((4096,), np.int8, shm.buf)
        slot = 1234
        c0 = time.thread_time_ns()
        for _ in range(reads):
            table.item(slot)
        per_read = (time.thread_time_ns() - c0) / reads
        del table
    finally:
        shm.close()
        shm.unlink()
    return per_read


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--transports", default="none,zmq,seqpacket,shm-ring,shm-poll")
    parser.add_argument("--poll-us", type=float, default=100.0, help="shm-poll's idle look interval")
    parser.add_argument("--pages", default="128,512,2048", help="KV pages per chunk (int64 each)")
    parser.add_argument("--rates", default="50,200,0", help="chunks/s; 0 = as fast as possible")
    parser.add_argument("--paced-seconds", type=float, default=3.0, help="length of each paced case")
    parser.add_argument("--max-seconds", type=float, default=1.5, help="length of each unpaced case")
    parser.add_argument("--max-count", type=int, default=20000, help="chunk cap of an unpaced case")
    parser.add_argument("--pace", default="sleep", choices=("sleep", "spin", "both"),
                        help="between paced chunks the sender sleeps (its caches go cold, its core may "
                             "idle) or spins (stays on its core, as a busy scheduler loop); spin costs "
                             "a core for the run")
    parser.add_argument("--json", action="store_true", help="one JSON object per case instead of a table")
    args = parser.parse_args(argv)
    transports = [t for t in args.transports.split(",") if t]
    for t in transports:
        if t not in ("none", "zmq", "seqpacket", "shm-ring", "shm-poll"):
            parser.error(f"unknown transport {t!r}")
    sizes = [int(p) for p in args.pages.split(",")]
    rates = [float(r) for r in args.rates.split(",")]
    max_pages = max(sizes)
    rows = []
    paces = {"sleep": [False], "spin": [True], "both": [False, True]}[args.pace]
    for rate in rates:
        for spin in paces if rate > 0 else [False]:
            for size in sizes:
                for transport in transports:
                    if rate > 0:
                        count = max(20, int(rate * args.paced_seconds))
                        seconds = args.paced_seconds + 1.0
                    else:
                        count, seconds = args.max_count, args.max_seconds
                    row = run_case(transport, size, rate, count, seconds, max_pages,
                                   args.poll_us / 1e6, spin)
                    rows.append(row)
                    if args.json:
                        print(json.dumps(row), flush=True)
    status_ns = measure_status_read()
    if args.json:
        print(json.dumps({"status_read_ns": status_ns}))
        return 0
    print(f"host: {os.uname().nodename}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}, "
          f"python {sys.version.split()[0]}")
    print("| rate (pace) | pages | transport | chunks/s | send CPU us p50 / mean / p99 | send wall us p50 / p99 "
          "| other sender threads us/chunk | hand-off latency us p50 / p99 | receiver CPU us/chunk | errors |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        rate = "max" if r["rate"] == 0 else f"{r['rate']:g}/s ({r['pace']})"
        print(f"| {rate} | {r['pages']} | {r['transport']} | {r['chunks_per_s']:.0f} "
              f"| {r['send_cpu_us_p50']:.1f} / {r['send_cpu_us_mean']:.1f} / {r['send_cpu_us_p99']:.1f} "
              f"| {r['send_wall_us_p50']:.1f} / {r['send_wall_us_p99']:.1f} "
              f"| {r['other_threads_cpu_us_per_chunk']:.1f} "
              f"| {r['latency_us_p50']:.0f} / {r['latency_us_p99']:.0f} "
              f"| {r['receiver_cpu_us_per_chunk']:.1f} | {r['errors']} |")
    print(f"\npoll()'s read of one room status from a shared-memory table: {status_ns:.0f} ns")
    return 0


if __name__ == "__main__":
    sys.exit(main())
