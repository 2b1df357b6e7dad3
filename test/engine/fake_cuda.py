"""A stand-in for libcudart under softio's CudaRuntime, for CPU hosts: "device memory" is host
memory the test declares, copies queue on a stream and run (memmove) only when their event is
synchronized, and that synchronize waits while the test holds the gate, so a copy can be kept in
flight for as long as a test needs.

Every IPC open and close and every synchronize is logged in order, and a close of a mapping while a
copy through it is still queued is recorded as a violation (and refused), which is the
use-after-free the engine must never commit.
"""

from __future__ import annotations

import ctypes
import itertools
import threading

from sglang_mori.softio import cuda_runtime

GATE_WAIT_S = 30.0  # a test that forgets to let go fails instead of hanging
_ERR_INVALID = 1


class FakeCudaLib:
    def __init__(self):
        self.log: list = []  # ("open", handle, device, base) / ("close", base) / ("sync", event, ranges)
        self.violations: list = []
        self.fail_open_on: set = set()  # devices whose cudaIpcOpenMemHandle fails (second context)
        self.fail_copy_at: int | None = None  # the cudaMemcpyAsync call (0-based) that fails
        self._copy_calls = 0
        self._device_ranges: list = []  # (start, size, device) of memory that counts as device memory
        self._exportable: dict = {}  # base -> handle this process exports for it
        self._importable: dict = {}  # handle -> (address, size) of a peer's allocation
        self._streams: dict = {}  # stream -> [ops, done]
        self._events: dict = {}  # event -> (stream, mark)
        self._ids = itertools.count(0x1000)
        self._lock = threading.Lock()
        self._gate = threading.Event()
        self._gate.set()
        self._current = threading.local()  # the device cudaSetDevice chose, per thread
        self.cudaGetErrorString = lambda rc: b"fake CUDA error"

    # ---- what the test declares ----------------------------------------------------------------
    def device_memory(self, address: int, size: int, device: int, handle: bytes | None = None) -> None:
        self._device_ranges.append((address, size, device))
        if handle is not None:
            self._exportable[address] = handle

    def peer_allocation(self, handle: bytes, address: int, size: int, device: int) -> None:
        """A peer process's allocation: its handle maps to `address` (host memory here)."""
        self._importable[handle] = (address, size)
        self._device_ranges.append((address, size, device))

    def hold(self) -> None:
        """Copies stay queued (their events unsignalled) until let_go()."""
        self._gate.clear()

    def let_go(self) -> None:
        self._gate.set()

    def entries(self, kind: str) -> list:
        with self._lock:
            return [e for e in self.log if e[0] == kind]

    def queued(self) -> int:
        with self._lock:
            return sum(len(ops) - done for ops, done in self._streams.values())

    # ---- the runtime calls softio makes ----------------------------------------------------------
    def cudaRuntimeGetVersion(self, out):
        out._obj.value = 12040
        return 0

    def cudaSetDevice(self, device):
        self._current.device = device.value
        return 0

    def cudaGetLastError(self):
        return 0

    def cudaPointerGetAttributes(self, attrs, ptr):
        for start, size, device in self._device_ranges:
            if start <= ptr.value < start + size:
                attrs._obj.type, attrs._obj.device = 2, device
                return 0
        return _ERR_INVALID

    def cudaIpcGetMemHandle(self, buf, base):
        buf.raw = self._exportable[base.value].ljust(cuda_runtime.IPC_HANDLE_BYTES, b"\0")
        return 0

    def cudaIpcOpenMemHandle(self, out, value, flags):
        handle = bytes(value).rstrip(b"\0")
        device = getattr(self._current, "device", 0)
        with self._lock:
            if handle not in self._importable or device in self.fail_open_on:
                return _ERR_INVALID
            base = self._importable[handle][0]
            out._obj.value = base
            self.log.append(("open", handle, device, base))
        return 0

    def cudaIpcCloseMemHandle(self, base):
        with self._lock:
            size = next(s for a, s in self._importable.values() if a == base.value)
            pending = [op for ops, done in self._streams.values() for op in ops[done:]
                       if _overlaps(op, base.value, size)]
            if pending:
                self.violations.append(("close under a queued copy", base.value, pending))
                return _ERR_INVALID
            self.log.append(("close", base.value))
        return 0

    def cudaDeviceEnablePeerAccess(self, peer, flags):
        return 0

    def cudaStreamCreateWithFlags(self, out, flags):
        with self._lock:
            out._obj.value = next(self._ids)
            self._streams[out._obj.value] = [[], 0]
        return 0

    def cudaEventCreateWithFlags(self, out, flags):
        out._obj.value = next(self._ids)
        return 0

    def cudaMemcpyAsync(self, dst, src, size, kind, stream):
        with self._lock:
            call, self._copy_calls = self._copy_calls, self._copy_calls + 1
            if call == self.fail_copy_at:
                return _ERR_INVALID
            self._streams[stream.value][0].append((dst.value, src.value, size.value))
        return 0

    def cudaEventRecord(self, event, stream):
        with self._lock:
            self._events[event.value] = (stream.value, len(self._streams[stream.value][0]))
        return 0

    def cudaEventSynchronize(self, event):
        if not self._gate.wait(GATE_WAIT_S):
            return _ERR_INVALID
        with self._lock:
            stream, mark = self._events[event.value]
            state = self._streams[stream]
            ops, done = state
            ran = ops[done:mark]
            for dst, src, n in ran:
                ctypes.memmove(dst, src, n)
            state[1] = max(done, mark)
            self.log.append(("sync", event.value, ran))
        return 0


class FakeDriver:
    """libcuda's cuMemGetAddressRange: each declared device range is one allocation."""

    def __init__(self, lib: FakeCudaLib):
        self._lib = lib

    def cuMemGetAddressRange_v2(self, base, size, ptr):
        for start, length, _ in self._lib._device_ranges:
            if start <= ptr.value < start + length:
                base._obj.value, size._obj.value = start, length
                return 0
        return _ERR_INVALID


def _overlaps(op, base: int, size: int) -> bool:
    dst, src, n = op
    return any(base <= p < base + size or p <= base < p + n for p in (dst, src))


def install(monkeypatch) -> FakeCudaLib:
    """Make cuda_runtime.load() return a CudaRuntime over a fresh fake (undone after the test)."""
    lib = FakeCudaLib()
    monkeypatch.setenv("SGLANG_MORI_SOFTIO_DEVICE_COPY", "memcpy")  # no CuPy kernel on the fake
    monkeypatch.setattr(cuda_runtime, "_RUNTIME", cuda_runtime.CudaRuntime(lib))
    monkeypatch.setattr(cuda_runtime, "_LOADED", True)
    monkeypatch.setattr(cuda_runtime, "_DRIVER", FakeDriver(lib))
    return lib
