"""`sglang-mori bench engine`: softio batch writes on each path against the baseline of its wire.

Two processes. The target process registers one buffer per softio path with a softio engine and
also runs a plain socket receiver into a buffer of its own; the initiator writes batches of
equal-sized, non-contiguous entries (nothing merges) of 4 KiB to 64 MiB with
`IOEngine.batch_write`:

- over softio's TCP lanes (an engine created with SGLANG_MORI_SOFTIO_FORCE_TCP=1), against the
  same bytes sent with a minimal framed sendmsg/recv_into loop ("raw");
- over softio's intra-host path (cross-memory attach), against a local numpy copy of the same
  entries in the initiator process ("memcpy").

All contenders alternate batch by batch in one run and the median batch time counts, so load on
a shared machine hits them alike; the landed bytes are checked against the source after each
size. One batch is outstanding at a time, as in MORI's own benchmark.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import multiprocessing as mp
import os
import socket
import statistics
import struct
import threading
import time

import numpy as np

KIB, MIB = 1024, 1024 * 1024
DEFAULT_SIZES = [4 * KIB, 16 * KIB, 64 * KIB, 256 * KIB, 1 * MIB, 4 * MIB, 16 * MIB, 64 * MIB]
PATHS = ("tcp", "intrahost")
# Goals for entries >= 1 MiB: softio-tcp / raw sockets, and softio-intrahost / memcpy.
GOALS = {"tcp": 0.7, "intrahost": 0.5}
_RAW = struct.Struct("<QQ")  # offset, size; size == 2**64-1 ends a batch


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", type=str, default=None,
                        help="comma list of entry sizes in bytes (default 4KiB..64MiB)")
    parser.add_argument("--paths", type=str, default=",".join(PATHS),
                        help="softio paths to measure: tcp, intrahost or both (comma list); "
                             "tcp is compared with raw sockets, intrahost with memcpy")
    parser.add_argument("--batch-bytes", type=int, default=16 * MIB,
                        help="bytes per batch; entries per batch = batch_bytes / size, "
                             "between 1 and --max-entries")
    parser.add_argument("--max-entries", type=int, default=1024)
    parser.add_argument("--qp", type=int, default=2, help="softio qp_per_transfer (lanes)")
    parser.add_argument("--iters", type=int, default=30, help="max timed batches per size")
    parser.add_argument("--seconds", type=float, default=2.0,
                        help="max timed seconds per size (all contenders together)")
    parser.add_argument("--host", default="127.0.0.1")


def _layout(size: int, args) -> tuple[int, list]:
    entries = max(1, min(args.max_entries, args.batch_bytes // size))
    # Stride 2*size on both sides so that no two entries are contiguous (nothing merges).
    offsets = [i * 2 * size for i in range(entries)]
    return entries, offsets


@contextlib.contextmanager
def _force_tcp(value: bool):
    """softio reads its FORCE_TCP switch when a backend is created."""
    from sglang_mori.softio.config import FORCE_TCP_ENV

    saved = os.environ.get(FORCE_TCP_ENV)
    os.environ[FORCE_TCP_ENV] = "1" if value else "0"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(FORCE_TCP_ENV, None)
        else:
            os.environ[FORCE_TCP_ENV] = saved


def _engine(softio, key: str, host: str, qp: int, force_tcp: bool):
    engine = softio.IOEngine(key, softio.IOEngineConfig(host, 0))
    with _force_tcp(force_tcp):
        engine.create_backend(softio.BackendType.RDMA, softio.RdmaBackendConfig(
            qp, -1, -1, softio.PollCqMode.POLLING, False))
    return engine


# ---- target process ------------------------------------------------------------------------------

def _target_main(conn, host: str, qp: int, buffer_bytes: int) -> None:
    from sglang_mori import softio

    bufs = {name: np.zeros(buffer_bytes, dtype=np.uint8) for name in PATHS + ("raw",)}
    engine = _engine(softio, f"bench-target-{os.getpid()}", host, qp, force_tcp=False)
    mems = {path: engine.register_memory(bufs[path].ctypes.data, buffer_bytes, -1,
                                         softio.MemoryLocationType.CPU).pack() for path in PATHS}
    listener = socket.create_server((host, 0))
    threading.Thread(target=_raw_receiver, args=(listener, bufs["raw"]), daemon=True).start()
    conn.send((engine.get_engine_desc().pack(), mems, listener.getsockname()[1]))
    while True:
        msg = conn.recv()
        if msg is None:
            break
        which, offsets, size = msg
        digest = hashlib.sha256()
        for off in offsets:
            digest.update(bufs[which][off:off + size])
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

def _time_interleaved(fns: list, iters: int, seconds: float) -> list:
    """Median seconds per batch of each loop, interleaved batch by batch (after a warm-up of
    each), so that load changes on a shared machine hit all of them alike."""
    for fn in fns:
        fn()
    times = [[] for _ in fns]
    start = time.perf_counter()
    while len(times[0]) < iters and (not times[0] or time.perf_counter() - start < seconds):
        for fn, out in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def _softio_batch(softio, engine, local, remote, offsets, sizes_list):
    def batch():
        statuses = engine.batch_write([local], [offsets], [remote], [offsets], [sizes_list],
                                      [engine.allocate_transfer_uid()])
        rc = engine.wait_all(statuses, 60_000)
        if rc != softio.StatusCode.SUCCESS:
            raise RuntimeError(f"softio batch failed: {rc} {statuses[0].Message()}")
    return batch


def _raw_batch(raw, src_view, offsets, size):
    def batch():
        for off in offsets:
            raw.sendmsg([_RAW.pack(off, size), src_view[off:off + size]])
        raw.sendall(_RAW.pack(0, (1 << 64) - 1))
        if raw.recv(1) != b"k":
            raise RuntimeError("raw receiver closed")
    return batch


def _memcpy_batch(src, dst, offsets, size):
    def batch():
        for off in offsets:
            np.copyto(dst[off:off + size], src[off:off + size])
    return batch


def run(args) -> int:
    from sglang_mori import softio
    from sglang_mori.softio.intrahost import peer_path

    sizes = [int(s, 0) for s in args.sizes.split(",")] if args.sizes else DEFAULT_SIZES
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    if not paths or any(p not in PATHS for p in paths):
        raise SystemExit(f"--paths takes a comma list of {', '.join(PATHS)}")
    buffer_bytes = max(2 * _layout(s, args)[0] * s for s in sizes)
    src = np.random.default_rng(0).integers(0, 256, buffer_bytes, dtype=np.uint8)
    copy_dst = np.zeros(buffer_bytes, dtype=np.uint8) if "intrahost" in paths else None

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_target_main, args=(child, args.host, args.qp, buffer_bytes),
                       daemon=True)
    proc.start()
    engines, raw = {}, None
    try:
        if not parent.poll(60):
            raise RuntimeError("bench target did not start within 60 s")
        desc_blob, mem_blobs, raw_port = parent.recv()
        target_desc = softio.EngineDesc.unpack(desc_blob)
        locals_ = {}
        for path in paths:
            engine = _engine(softio, f"bench-{path}-{os.getpid()}", args.host, args.qp,
                             force_tcp=(path == "tcp"))
            engine.register_remote_engine(target_desc)
            locals_[path] = engine.register_memory(src.ctypes.data, src.nbytes, -1,
                                                   softio.MemoryLocationType.CPU)
            engines[path] = engine
        remotes = {path: softio.MemoryDesc.unpack(mem_blobs[path]) for path in paths}
        if "tcp" in paths:
            raw = socket.create_connection((args.host, raw_port))
            _tune(raw)
        src_view = memoryview(src).cast("B")

        # Contenders: (column, batch function, the landed bytes to check: target buffer or None)
        def contenders(offsets, size):
            out = []
            for path in paths:
                sizes_list = [size] * len(offsets)
                out.append((path, _softio_batch(softio, engines[path], locals_[path],
                                                remotes[path], offsets, sizes_list)))
                if path == "tcp":
                    out.append(("raw", _raw_batch(raw, src_view, offsets, size)))
                else:
                    out.append(("memcpy", _memcpy_batch(src, copy_dst, offsets, size)))
            return out

        print(f"softio qp_per_transfer={args.qp}; batch of non-contiguous entries, one batch in "
              f"flight; median of interleaved batches; GB/s = 1e9 bytes/s")
        columns = [name for name, _ in contenders([0], KIB)]
        ratios = [("tcp", "raw"), ("intrahost", "memcpy")]
        ratios = [(a, b) for a, b in ratios if a in paths]
        print(f"{'entry':>8} {'entries':>7} " + " ".join(f"{c + ' GB/s':>14}" for c in columns)
              + " " + " ".join(f"{a + '/' + b:>16}" for a, b in ratios), flush=True)
        worst = {}
        for size in sizes:
            entries, offsets = _layout(size, args)
            named = contenders(offsets, size)
            medians = dict(zip([n for n, _ in named],
                               _time_interleaved([fn for _, fn in named], args.iters,
                                                 args.seconds)))
            _check(parent, src, copy_dst, src_view, offsets, size, columns)
            if size == sizes[0]:
                _check_paths(engines, target_desc.key, peer_path)
            gb = entries * size / 1e9
            row = [f"{_fmt(size):>8} {entries:>7}"]
            row += [f"{gb / medians[c]:>14.2f}" for c in columns]
            for a, b in ratios:
                ratio = medians[b] / medians[a]
                row.append(f"{ratio:>16.2f}")
                if size >= MIB:
                    worst[a] = min(worst.get(a, ratio), ratio)
            print(" ".join(row), flush=True)
        for path, baseline in ratios:
            if path in worst:
                verdict = "meets" if worst[path] >= GOALS[path] else "misses"
                print(f"lowest softio-{path}/{baseline} ratio for entries >= 1 MiB: "
                      f"{worst[path]:.2f} ({verdict} the {GOALS[path]} goal)")
        return 0
    finally:
        if raw is not None:
            raw.close()
        for engine in engines.values():
            engine.remove_backend(softio.BackendType.RDMA)  # close lanes before the target exits
        try:
            parent.send(None)
        except OSError:
            pass
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(5)


def _check(parent, src, copy_dst, src_view, offsets, size, columns) -> None:
    """The bytes every contender moved equal the source (the target hashes its buffers)."""
    expected = hashlib.sha256()
    for off in offsets:
        expected.update(src_view[off:off + size])
    for which in columns:
        if which == "memcpy":
            ok = all(np.array_equal(copy_dst[o:o + size], src[o:o + size]) for o in offsets)
        else:
            parent.send((which, offsets, size))
            ok = parent.recv() == expected.hexdigest()
        if not ok:
            raise RuntimeError(f"{which}: landed bytes differ from the source at entry size {size}")


def _check_paths(engines: dict, target_key: str, peer_path) -> None:
    """Say which path each engine really took (a refused intra-host hello means TCP lanes)."""
    for path, engine in engines.items():
        actual = peer_path(engine, target_key)
        note = "" if actual == {"tcp": "tcp", "intrahost": "intra-host"}[path] else \
            "  <-- NOT the path asked for (see the target's log)"
        print(f"# softio-{path} engine uses {actual} lanes{note}", flush=True)


def _fmt(size: int) -> str:
    return f"{size // MIB}MiB" if size >= MIB else f"{size // KIB}KiB"
