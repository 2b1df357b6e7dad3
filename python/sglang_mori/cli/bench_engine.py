"""`sglang-mori bench engine`: softio batch writes against raw Python socket loopback.

Two processes. The target process registers a buffer with a softio engine and also runs a plain
socket receiver into the same kind of buffer; the initiator writes batches of equal-sized,
non-contiguous entries (nothing merges) of 4 KiB to 64 MiB with `IOEngine.batch_write`, and the
same bytes with a minimal framed sendmsg/recv_into loop. The two alternate batch by batch in one
run and the median batch time counts, so load on a shared machine hits both alike; the landed
bytes are checked against the source after each size. One batch is outstanding at a time, as in
MORI's own benchmark.
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import socket
import statistics
import struct
import threading
import time

import numpy as np

KIB, MIB = 1024, 1024 * 1024
DEFAULT_SIZES = [4 * KIB, 16 * KIB, 64 * KIB, 256 * KIB, 1 * MIB, 4 * MIB, 16 * MIB, 64 * MIB]
_RAW = struct.Struct("<QQ")  # offset, size; size == 2**64-1 ends a batch


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", type=str, default=None,
                        help="comma list of entry sizes in bytes (default 4KiB..64MiB)")
    parser.add_argument("--batch-bytes", type=int, default=16 * MIB,
                        help="bytes per batch; entries per batch = batch_bytes / size, "
                             "between 1 and --max-entries")
    parser.add_argument("--max-entries", type=int, default=1024)
    parser.add_argument("--qp", type=int, default=2, help="softio qp_per_transfer (lanes)")
    parser.add_argument("--iters", type=int, default=30, help="max timed batches per size")
    parser.add_argument("--seconds", type=float, default=2.0,
                        help="max timed seconds per size (both sides together)")
    parser.add_argument("--host", default="127.0.0.1")


def _layout(size: int, args) -> tuple[int, list]:
    entries = max(1, min(args.max_entries, args.batch_bytes // size))
    # Stride 2*size on both sides so that no two entries are contiguous (nothing merges).
    offsets = [i * 2 * size for i in range(entries)]
    return entries, offsets


# ---- target process ------------------------------------------------------------------------------

def _target_main(conn, host: str, qp: int, buffer_bytes: int) -> None:
    from sglang_mori import softio

    dst = np.zeros(buffer_bytes, dtype=np.uint8)
    raw_dst = np.zeros(buffer_bytes, dtype=np.uint8)
    engine = softio.IOEngine(f"bench-target-{id(dst)}", softio.IOEngineConfig(host, 0))
    engine.create_backend(softio.BackendType.RDMA,
                          softio.RdmaBackendConfig(qp, -1, -1, softio.PollCqMode.POLLING, False))
    mem = engine.register_memory(dst.ctypes.data, dst.nbytes, -1, softio.MemoryLocationType.CPU)
    listener = socket.create_server((host, 0))
    threading.Thread(target=_raw_receiver, args=(listener, raw_dst), daemon=True).start()
    conn.send((engine.get_engine_desc().pack(), mem.pack(), listener.getsockname()[1]))
    while True:
        msg = conn.recv()
        if msg is None:
            break
        which, offsets, size = msg
        buf = dst if which == "softio" else raw_dst
        digest = hashlib.sha256()
        for off in offsets:
            digest.update(buf[off:off + size])
        conn.send(digest.hexdigest())


def _raw_receiver(listener: socket.socket, dst: np.ndarray) -> None:
    sock, _ = listener.accept()
    _tune(sock)
    view = memoryview(dst).cast("B")
    header = bytearray(_RAW.size)
    hview = memoryview(header)
    end_marker = (1 << 64) - 1
    try:
        while True:
            got = 0
            while got < _RAW.size:
                n = sock.recv_into(hview[got:])
                if n == 0:
                    return
                got += n
            offset, size = _RAW.unpack(header)
            if size == end_marker:
                sock.sendall(b"k")
                continue
            got = 0
            target = view[offset:offset + size]
            while got < size:
                n = sock.recv_into(target[got:])
                if n == 0:
                    return
                got += n
    except OSError:
        return


def _tune(sock: socket.socket) -> None:
    """The raw baseline gets the same socket options as softio's lanes."""
    from sglang_mori.softio.backend import DEFAULT_SOCKET_BUFFER
    from sglang_mori.softio.wire import tune_socket

    tune_socket(sock, DEFAULT_SOCKET_BUFFER)


# ---- initiator ----------------------------------------------------------------------------------

def _time_pair(first, second, iters: int, seconds: float) -> tuple[float, float]:
    """Median seconds per batch of two loops, interleaved batch by batch (after a warm-up of
    each), so that load changes on a shared machine hit both sides alike."""
    first()
    second()
    times_a, times_b = [], []
    start = time.perf_counter()
    while len(times_a) < iters and (not times_a or time.perf_counter() - start < seconds):
        for fn, out in ((first, times_a), (second, times_b)):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return statistics.median(times_a), statistics.median(times_b)


def run(args) -> int:
    from sglang_mori import softio

    sizes = [int(s, 0) for s in args.sizes.split(",")] if args.sizes else DEFAULT_SIZES
    buffer_bytes = max(2 * _layout(s, args)[0] * s for s in sizes)
    src = np.random.default_rng(0).integers(0, 256, buffer_bytes, dtype=np.uint8)

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_target_main, args=(child, args.host, args.qp, buffer_bytes),
                       daemon=True)
    proc.start()
    try:
        if not parent.poll(60):
            raise RuntimeError("bench target did not start within 60 s")
        desc_blob, mem_blob, raw_port = parent.recv()
        engine = softio.IOEngine(f"bench-initiator-{id(src)}", softio.IOEngineConfig(args.host, 0))
        engine.create_backend(softio.BackendType.RDMA, softio.RdmaBackendConfig(
            args.qp, -1, -1, softio.PollCqMode.POLLING, False))
        engine.register_remote_engine(softio.EngineDesc.unpack(desc_blob))
        local = engine.register_memory(src.ctypes.data, src.nbytes, -1,
                                       softio.MemoryLocationType.CPU)
        remote = softio.MemoryDesc.unpack(mem_blob)
        raw = socket.create_connection((args.host, raw_port))
        _tune(raw)
        src_view = memoryview(src).cast("B")

        print(f"softio qp_per_transfer={args.qp}; batch of non-contiguous entries, one batch in "
              f"flight; median of interleaved batches; GB/s = 1e9 bytes/s")
        print(f"{'entry':>8} {'entries':>7} {'softio GB/s':>12} {'raw GB/s':>9} {'ratio':>6}")
        worst_large = None
        for size in sizes:
            entries, offsets = _layout(size, args)
            sizes_list = [size] * entries

            def softio_batch():
                uid = engine.allocate_transfer_uid()
                statuses = engine.batch_write([local], [offsets], [remote], [offsets],
                                              [sizes_list], [uid])
                rc = engine.wait_all(statuses, 60_000)
                if rc != softio.StatusCode.SUCCESS:
                    raise RuntimeError(f"softio batch failed: {rc} {statuses[0].Message()}")

            def raw_batch():
                for off in offsets:
                    raw.sendmsg([_RAW.pack(off, size), src_view[off:off + size]])
                raw.sendall(_RAW.pack(0, (1 << 64) - 1))
                if raw.recv(1) != b"k":
                    raise RuntimeError("raw receiver closed")

            t_soft, t_raw = _time_pair(softio_batch, raw_batch, args.iters, args.seconds)
            expected = hashlib.sha256()
            for off in offsets:
                expected.update(src_view[off:off + size])
            for which in ("softio", "raw"):
                parent.send((which, offsets, size))
                if parent.recv() != expected.hexdigest():
                    raise RuntimeError(f"{which}: landed bytes differ from the source "
                                       f"at entry size {size}")
            gb = entries * size / 1e9
            ratio = t_raw / t_soft
            if size >= MIB:
                worst_large = ratio if worst_large is None else min(worst_large, ratio)
            print(f"{_fmt(size):>8} {entries:>7} {gb / t_soft:>12.2f} {gb / t_raw:>9.2f} "
                  f"{ratio:>6.2f}", flush=True)
        raw.close()
        engine.remove_backend(softio.BackendType.RDMA)  # close lanes before the target exits
        if worst_large is not None:
            verdict = "meets" if worst_large >= 0.7 else "misses"
            print(f"lowest softio/raw ratio for entries >= 1 MiB: {worst_large:.2f} "
                  f"({verdict} the 0.7 goal)")
        return 0
    finally:
        try:
            parent.send(None)
        except OSError:
            pass
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(5)


def _fmt(size: int) -> str:
    return f"{size // MIB}MiB" if size >= MIB else f"{size // KIB}KiB"
