"""The transfer process proves, before it serves anything, that its engine can post from every
imported KV pool.

Registering memory another process exported is the unproven step of the design (docs/design.md,
"Registering memory that a second process imported"): on MORI-IO's RDMA backend `register_memory`
only records the region, and the verbs registration happens when a session first pairs it, that
is at the first transfer; ROCr's dma-buf route for an IPC-imported pointer dereferences a null
region there, and a crash then would fail live requests. So the child forces that step at
start-up: a second engine in the same process registers a small probe buffer (GPU memory for GPU
pools), and the child's engine writes the first PROBE_BYTES of every pool into it, waits for every
status and compares the bytes. A raise here, a failed status or wrong bytes become the child's
start-up failure with the reason; a crash here ends the child before the scheduler hands it
anything. Either way the scheduler keeps its transfers in-process (client.py, startup.py).
"""

from __future__ import annotations

import ctypes
import time
from typing import List, Optional, Sequence

import numpy as np

from sglang_mori.engine import WriteState
from sglang_mori.engine.transfer_engine import WritePair

PROBE_BYTES = 64
PROOF_TIMEOUT_S = 30.0


class RegistrationNotProven(RuntimeError):
    """The child's engine could not post from an imported pool."""


class _ProbeBuffer:
    """Where the probes land: host memory, or device memory for GPU pools."""

    def __init__(self, size: int, on_gpu: bool, device: int, runtime):
        self.size, self.on_gpu, self.device, self.runtime = size, on_gpu, device, runtime
        if on_gpu:
            self.ptr = runtime.alloc(size, device)
        else:
            self.host = np.zeros(size, np.uint8)
            self.ptr = self.host.ctypes.data

    def bytes_at(self, offset: int, n: int) -> bytes:
        if self.on_gpu:
            return self.runtime.read(self.ptr + offset, n, self.device)
        return self.host[offset:offset + n].tobytes()

    def close(self) -> None:
        if self.on_gpu and self.ptr:
            self.runtime.free(self.ptr, self.device)
            self.ptr = 0


def _pool_bytes(ptr: int, n: int, on_gpu: bool, device: int, runtime) -> bytes:
    return runtime.read(ptr, n, device) if on_gpu else ctypes.string_at(ptr, n)


def prove(engine, make_engine, pool_descs: Sequence, pool_ptrs: Sequence[int], pool_sizes: Sequence[int],
          on_gpu: bool, device: int, runtime=None, timeout_s: float = PROOF_TIMEOUT_S) -> None:
    """Raise RegistrationNotProven unless `engine` wrote the first bytes of every pool, exactly,
    into a buffer of a second engine (`make_engine()`) of this process."""
    probes: List[int] = [min(PROBE_BYTES, int(s)) for s in pool_sizes]
    target_engine = make_engine()
    buffer: Optional[_ProbeBuffer] = None
    peer = None
    try:
        buffer = _ProbeBuffer(max(1, sum(probes)), on_gpu, device, runtime)
        target = target_engine.register(buffer.ptr, buffer.size, device, on_gpu)
        peer = engine.add_peer(target_engine.packed_desc)
        pairs, offset = [], 0
        for i, (desc, n) in enumerate(zip(pool_descs, probes)):
            if desc is None or n == 0:
                continue
            try:
                engine.connect(desc, target)  # MORI's RDMA backend registers the pool here
            except Exception as exc:
                raise RegistrationNotProven(f"KV buffer {i}: no session from the imported pool "
                                            f"({type(exc).__name__}: {exc})") from None
            pairs.append((i, WritePair(desc, target, [0], [offset], [n]), offset, n))
            offset += n
        deadline = time.monotonic() + timeout_s
        handle = engine.write(peer, [p[1] for p in pairs], deadline=deadline, retry_max=0)
        while handle.state() is WriteState.RUNNING and time.monotonic() < deadline:
            handle.wait_running(100)
        state = handle.state()
        if state is not WriteState.SUCCEEDED:
            why = "timed out" if state is WriteState.RUNNING else handle.failure_message()
            raise RegistrationNotProven(f"the probe write from the imported KV pools failed: {why}")
        for i, _, at, n in pairs:
            sent = _pool_bytes(pool_ptrs[i], n, on_gpu, device, runtime)
            if buffer.bytes_at(at, n) != sent:
                raise RegistrationNotProven(f"KV buffer {i}: the probe write reported success but the bytes "
                                            "that arrived differ from the pool's")
    finally:
        if peer is not None:
            engine.ignore_failures_of(peer)  # closing it below breaks our connections to it
            engine.remove_peer(peer)
        target_engine.close()
        if buffer is not None:
            buffer.close()
