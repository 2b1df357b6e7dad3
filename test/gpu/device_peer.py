"""A softio engine in another process whose registered memory is a GPU tensor (the target of the
device-path tests). Driven over a pipe: `bytes` returns the tensor's bytes, `fill` rewrites it."""

from __future__ import annotations

import multiprocessing as mp
import uuid

WAIT_S = 60.0


def _serve(conn, size: int, fill: int, paths: list) -> None:
    import faulthandler
    import sys

    faulthandler.enable()
    sys.path[:0] = paths
    import torch

    import sglang_mori.softio as io

    torch.cuda.set_device(0)
    buf = torch.full((size,), fill, dtype=torch.uint8, device="cuda")
    engine = io.IOEngine(f"gpu-peer-{uuid.uuid4().hex[:8]}", io.IOEngineConfig("127.0.0.1", 0))
    engine.create_backend(io.BackendType.RDMA, io.RdmaBackendConfig())
    mem = engine.register_memory(buf.data_ptr(), size, 0, io.MemoryLocationType.GPU)
    conn.send((engine.get_engine_desc().pack(), mem.pack()))
    while True:
        cmd, arg = conn.recv()
        if cmd == "stop":
            break
        if cmd == "bytes":
            torch.cuda.synchronize()
            conn.send(buf.cpu().numpy())
        elif cmd == "fill":
            buf.copy_(torch.as_tensor(arg, device="cuda"))
            torch.cuda.synchronize()
            conn.send(None)
    engine.deregister_memory(mem)


class DevicePeer:
    def __init__(self, size: int, fill: int, paths: list):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, size, fill, paths), daemon=True)
        self.proc.start()
        self.desc_blob, self.mem_blob = self._recv(120)

    def _recv(self, timeout: float = WAIT_S):
        if not self.conn.poll(timeout):
            raise TimeoutError(f"device peer did not answer in {timeout} s")
        return self.conn.recv()

    def bytes(self):
        self.conn.send(("bytes", None))
        return self._recv()

    def fill(self, array) -> None:
        self.conn.send(("fill", array))
        self._recv()

    def close(self) -> None:
        if self.proc.is_alive():
            self.conn.send(("stop", None))
            self.proc.join(timeout=20)
            if self.proc.is_alive():
                self.proc.kill()
