"""An engine in another process, driven over a pipe, for the engine conformance suite.

The peer process imports the engine module under test (softio, or real `mori.io`), creates one
engine with an RDMA backend, and answers commands. Its memory lives in files on /dev/shm that the
test process maps too, so tests check the bytes that landed directly, without asking the peer.
softio runs as two kinds: "softio-tcp" (every engine forces TCP lanes) and "softio-intrahost"
(engines on this host use intra-host lanes).
"""

from __future__ import annotations

import contextlib
import importlib
import mmap
import multiprocessing as mp
import os
import tempfile
import time
import uuid

import numpy as np

_SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else None


SOFTIO_KINDS = ["softio-tcp", "softio-intrahost"]
FORCE_TCP_ENV = "SGLANG_MORI_SOFTIO_FORCE_TCP"


def engine_module(kind: str):
    """The module whose API is under test: softio, or the real mori.io."""
    return importlib.import_module("sglang_mori.softio" if kind.startswith("softio") else "mori.io")


def kind_env(kind: str) -> dict:
    """Environment an engine of this kind is created with."""
    return {FORCE_TCP_ENV: "1" if kind == "softio-tcp" else "0"} if kind in SOFTIO_KINDS else {}


@contextlib.contextmanager
def engine_env(kind: str):
    """Set the kind's environment around creating a backend in this process (read there)."""
    env = kind_env(kind)
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def expected_path(kind: str) -> str | None:
    return {"softio-tcp": "tcp", "softio-intrahost": "intra-host"}.get(kind)


def check_paths(engine, kind: str) -> None:
    """Every peer this softio engine dialed uses the path its kind stands for (so a silent fall
    back to TCP cannot make the intra-host runs test TCP twice)."""
    want = expected_path(kind)
    core = getattr(engine, "_core", None)
    if want is None or core is None:
        return
    for backend in core.backends.values():
        for peer in backend.peers.all_peers():
            if peer.lanes:
                assert peer.path == want, f"{kind}: peer {peer.key} uses {peer.path} lanes"


def unique_key(role: str) -> str:
    # Keys must be unique per engine incarnation (MORI keys inbound state by them).
    return f"{role}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class SharedBuffer:
    """A file-backed shared mapping: the same bytes in the test process and in a peer."""

    def __init__(self, size: int, path: str | None = None):
        self.size = size
        self.owner = path is None
        if path is None:
            fd, path = tempfile.mkstemp(prefix="softio-test-", dir=_SHM_DIR)
            os.ftruncate(fd, size)
        else:
            fd = os.open(path, os.O_RDWR)
        self.path = path
        self._mm = mmap.mmap(fd, size)
        os.close(fd)
        self.array = np.frombuffer(self._mm, dtype=np.uint8)

    @property
    def addr(self) -> int:
        return self.array.ctypes.data

    def close(self) -> None:
        self.array = None
        try:
            self._mm.close()
        except BufferError:
            pass  # a view is still alive somewhere; the mapping goes with the process
        if self.owner:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


def wait_until(predicate, timeout: float, what: str):
    """Poll a condition until it holds (bounded); the result of the predicate is returned."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.01)


def dropped(sock) -> bool:
    """True once an engine has closed this raw connection (EOF or reset); closes it."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    finally:
        sock.close()


# ---- the peer process ------------------------------------------------------------------------

def _peer_main(conn, kind: str, key: str, host: str, qp: int, notify: bool, env: dict) -> None:
    os.environ.update(env)
    io = engine_module(kind)
    engine = io.IOEngine(key, io.IOEngineConfig(host, 0))
    engine.create_backend(io.BackendType.RDMA,
                          io.RdmaBackendConfig(qp, -1, -1, io.PollCqMode.POLLING, notify))
    buffers, mems = {}, {}
    while True:
        try:
            cmd, args = conn.recv()
        except EOFError:
            return
        try:
            result = _run(io, engine, buffers, mems, cmd, args)
        except Exception as exc:  # reported to the test, which decides
            conn.send(("err", f"{type(exc).__name__}: {exc}"))
            continue
        conn.send(("ok", result))
        if cmd == "exit":
            return


def _run(io, engine, buffers, mems, cmd, args):
    if cmd == "desc":
        return engine.get_engine_desc().pack()
    if cmd == "register":
        path, size = args
        buf = SharedBuffer(size, path)
        mem = engine.register_memory(buf.addr, size, -1, io.MemoryLocationType.CPU)
        buffers[mem.id], mems[mem.id] = buf, mem
        return mem.pack()
    if cmd == "deregister":
        engine.deregister_memory(mems.pop(args))
        return None
    if cmd == "register_remote":
        engine.register_remote_engine(io.EngineDesc.unpack(args))
        return None
    if cmd == "batch_write":  # (local mem id, remote desc blob, local offs, remote offs, sizes)
        mem_id, remote_blob, lo, ro, sz, wait_ms = args
        remote = io.MemoryDesc.unpack(remote_blob)
        st = engine.batch_write([mems[mem_id]], [lo], [remote], [ro], [sz],
                                [engine.allocate_transfer_uid()])[0]
        code = st.WaitFor(wait_ms)
        return int(code), st.Message()
    if cmd == "pop_inbound":
        remote_key, uid = args
        st = engine.pop_inbound_transfer_status(remote_key, uid)
        return None if st is None else int(st.Code())
    if cmd == "pop_peer_failure":
        deadline = time.monotonic() + args
        while True:
            event = engine.pop_peer_failure()
            if event is not None:
                return (event.remote_engine_key, int(event.reason), event.detail)
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.02)
    if cmd == "fault":
        from sglang_mori.softio import faults
        name, kwargs = args
        getattr(faults, name)(engine, **kwargs)
        return None
    if cmd == "write_log":
        from sglang_mori.softio.write_log import get_write_log
        return [tuple(r) for r in get_write_log(engine, args)]
    if cmd == "exit":
        engine.remove_backend(io.BackendType.RDMA)
        return None
    raise ValueError(f"unknown command {cmd}")


# ---- the test side ---------------------------------------------------------------------------

class EnginePeer:
    """Handle on a peer process; every call is bounded by a timeout."""

    def __init__(self, kind: str, qp: int = 2, notify: bool = False, env: dict | None = None,
                 host: str = "127.0.0.1", role: str = "peer"):
        ctx = mp.get_context("spawn")
        self.kind = kind
        self.key = unique_key(role)
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_peer_main,
                                args=(child, kind, self.key, host, qp, notify,
                                      {**kind_env(kind), **(env or {})}),
                                daemon=True)
        self.proc.start()
        child.close()
        self._buffers: list[SharedBuffer] = []
        self.desc_blob = self.call("desc", timeout=60)

    def call(self, cmd: str, args=None, timeout: float = 30.0):
        self._conn.send((cmd, args))
        if not self._conn.poll(timeout):
            raise TimeoutError(f"peer did not answer {cmd!r} within {timeout} s")
        status, result = self._conn.recv()
        if status != "ok":
            raise RuntimeError(f"peer failed {cmd!r}: {result}")
        return result

    def register(self, size: int, fill: int | None = None) -> tuple[SharedBuffer, bytes]:
        """A shared buffer registered in the peer: (local view of it, packed MemoryDesc)."""
        buf = SharedBuffer(size)
        if fill is not None:
            buf.array[:] = fill
        self._buffers.append(buf)
        return buf, self.call("register", (buf.path, size))

    def kill(self) -> None:
        """SIGKILL: the peer dies without closing anything itself, as a crash would."""
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("exit", timeout=10)
            except (TimeoutError, RuntimeError, OSError, EOFError):
                pass
            self.proc.join(10)
            if self.proc.is_alive():
                self.kill()
        self._conn.close()
        for buf in self._buffers:
            buf.close()
