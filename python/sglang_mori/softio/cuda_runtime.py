"""The few CUDA runtime calls softio's device path needs, through ctypes.

ctypes releases the GIL for every foreign call, so a blocking call here (an event wait) never holds
up the Python threads of the process, and posting a whole batch of copies is ONE foreign call when
the runtime has `cudaMemcpyBatchAsync` (CUDA 12.8+). No CUDA Python package is needed: the runtime
library is the one the process already loaded (PyTorch's), found in /proc/self/maps, else the first
of the usual sonames that loads. On a host without a GPU `load()` returns None and softio keeps to
host memory.

HIP has the same calls under `hip*` names; MORI-IO's XGMI path (what this stands in for) uses
them from C++.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading

import numpy as np

logger = logging.getLogger("sglang_mori.softio")

DISABLE_ENV = "SGLANG_MORI_SOFTIO_DEVICE"  # "0": never treat a registration as device memory
IPC_HANDLE_BYTES = 64
_SONAMES = ("libcudart.so.13", "libcudart.so.12", "libcudart.so")
_MEMORY_TYPE_DEVICE = 2  # cudaMemoryTypeDevice
_IPC_LAZY_ENABLE_PEER_ACCESS = 1
_PEER_ACCESS_ALREADY_ENABLED = 704  # cudaErrorPeerAccessAlreadyEnabled
_EVENT_DISABLE_TIMING = 2
_STREAM_NON_BLOCKING = 1
_SRC_ACCESS_ORDER_STREAM = 1
_LOCATION_DEVICE = 1
_FLAG_PREFER_OVERLAP_WITH_COMPUTE = 1
_ONE = ctypes.c_size_t(1)  # numAttrs of cudaMemcpyBatchAsync: one set for every copy


class CudaError(RuntimeError):
    pass


class _PointerAttributes(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("device", ctypes.c_int),
                ("devicePointer", ctypes.c_void_p), ("hostPointer", ctypes.c_void_p),
                ("reserved", ctypes.c_long * 16)]  # room for fields a newer runtime may add


class _IpcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_BYTES)]  # cudaIpcMemHandle_t, passed by value


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", _MemLocation),
                ("dstLocHint", _MemLocation), ("flags", ctypes.c_uint)]


def _loaded_runtime_path() -> str | None:
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rsplit(None, 1)[-1]
                if "/libcudart.so" in path:
                    return path
    except OSError:
        pass
    return None


def _open_library():
    candidates = [p for p in (_loaded_runtime_path(),) if p] + list(_SONAMES)
    for name in candidates:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


class CudaRuntime:
    """One process's handle on the CUDA runtime. Thread-safe: every call names its device."""

    def __init__(self, lib):
        self.lib = lib
        version = ctypes.c_int(0)
        self._check(lib.cudaRuntimeGetVersion(ctypes.byref(version)), "cudaRuntimeGetVersion")
        self.version = version.value
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        self._batch = getattr(lib, "cudaMemcpyBatchAsync", None)
        self._batch_attrs: dict = {}  # device -> (its copy attributes, attrsIdxs), by reference
        self.batch_calls = self._batch is not None  # confirmed or withdrawn by the first batch
        self._device_of_thread = threading.local()
        # (handle, device asking) -> (base address, device whose context mapped it)
        self._opened: dict[tuple[bytes, int], tuple[int, int]] = {}
        # (handle, device whose context mapped it) -> holders of that mapping: one open() each,
        # unmapped when the last one close()s (a peer's pool would otherwise stay allocated on its
        # GPU for as long as this process lives, whatever became of the peer).
        self._holders: dict[tuple[bytes, int], int] = {}
        self._exported: dict[bytes, tuple[int, int]] = {}  # handles of this process's own allocations
        self._peers: set[tuple[int, int]] = set()
        # [start, end) ranges another process's memory was imported at (a transfer process's pools)
        self._imported: list[tuple[int, int]] = []
        self._lock = threading.Lock()
        self._ipc_lock = threading.Lock()  # one open or close of a mapping at a time (rare calls)

    # ---- errors and devices --------------------------------------------------------------------
    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            try:
                text = self.lib.cudaGetErrorString(rc).decode()
            except Exception:  # noqa: BLE001 - only the message is at stake
                text = "?"
            raise CudaError(f"{what} failed: CUDA error {rc} ({text})")

    def use_device(self, device: int) -> None:
        if getattr(self._device_of_thread, "device", None) != device:
            self._check(self.lib.cudaSetDevice(ctypes.c_int(device)), "cudaSetDevice")
            self._device_of_thread.device = device

    def device_of(self, ptr: int) -> int | None:
        """The device a pointer's memory lives on, or None for host (or unknown) memory."""
        attrs = _PointerAttributes()
        rc = self.lib.cudaPointerGetAttributes(ctypes.byref(attrs), ctypes.c_void_p(ptr))
        if rc != 0:
            self.lib.cudaGetLastError()  # clear the sticky-free error so later calls are clean
            return None
        return attrs.device if attrs.type == _MEMORY_TYPE_DEVICE else None

    # ---- IPC -------------------------------------------------------------------------------------
    def export(self, ptr: int, device: int) -> tuple[bytes, int]:
        """(IPC handle of the allocation holding ptr, ptr's offset in it)."""
        self.use_device(device)
        base = ctypes.c_void_p()
        size = ctypes.c_size_t()
        driver = _driver()
        rc = driver.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr))
        if rc != 0:
            raise CudaError(f"cuMemGetAddressRange failed: CUDA driver error {rc}")
        handle = ctypes.create_string_buffer(IPC_HANDLE_BYTES)
        self._check(self.lib.cudaIpcGetMemHandle(handle, ctypes.c_void_p(base.value)), "cudaIpcGetMemHandle")
        raw = handle.raw
        with self._lock:
            self._exported[raw] = (base.value, device)
        return raw, ptr - base.value

    def open(self, handle: bytes, device: int) -> int:
        """The base address of a peer's exported allocation, usable by kernels on `device`.

        Mapped once per (handle, device): prefill TP ranks of one process, each on its GPU, each
        map decode's memory into their own device's context. Where CUDA refuses a second mapping
        of a handle in one process, the rank reaches the first one through peer access to the
        device that mapped it. An allocation of this very process needs no mapping (peer access
        where it lives on another device).

        Every open() of a peer's handle is one hold on its mapping, to be given back with
        close(handle, device) once no copy into or out of it can still run."""
        with self._ipc_lock:
            with self._lock:
                own = self._exported.get(handle)
                mine = self._opened.get((handle, device))
                other = next((v for (h, _), v in self._opened.items() if h == handle), None)
            if own is not None:
                base, where = own
                if where != device:
                    self.enable_peer_access(device, where)
                return base
            if mine is not None:
                base, where = mine
                if where != device:
                    self.enable_peer_access(device, where)
                self._holders[(handle, where)] += 1
                return base
            self.use_device(device)
            out = ctypes.c_void_p()
            value = _IpcMemHandle.from_buffer_copy(handle)
            rc = self.lib.cudaIpcOpenMemHandle(ctypes.byref(out), value,
                                               ctypes.c_uint(_IPC_LAZY_ENABLE_PEER_ACCESS))
            if rc != 0 and other is not None:
                self.lib.cudaGetLastError()
                base, where = other
                self.enable_peer_access(device, where)
            else:
                self._check(rc, "cudaIpcOpenMemHandle")
                base, where = out.value, device
            with self._lock:
                self._opened[(handle, device)] = (base, where)
            self._holders[(handle, where)] = self._holders.get((handle, where), 0) + 1
            return base

    def close(self, handle: bytes, device: int) -> None:
        """Give back one open(handle, device). The last hold on a mapping unmaps it
        (cudaIpcCloseMemHandle), which frees the peer's memory once the peer has freed it too.
        The caller guarantees no copy into or out of the mapping is still queued on a stream."""
        with self._ipc_lock:
            with self._lock:
                if handle in self._exported:
                    return  # this process's own memory: nothing was mapped
                view = self._opened.get((handle, device))
            if view is None:
                raise CudaError(f"close of a handle never opened on device {device}")
            base, where = view
            left = self._holders[(handle, where)] - 1
            if left > 0:
                self._holders[(handle, where)] = left
                return
            del self._holders[(handle, where)]
            with self._lock:
                for key in [k for k, v in self._opened.items() if k[0] == handle and v == view]:
                    del self._opened[key]  # every device that reached it through this mapping
            self.use_device(where)
            self._check(self.lib.cudaIpcCloseMemHandle(ctypes.c_void_p(base)), "cudaIpcCloseMemHandle")

    def note_imported(self, ptr: int, size: int) -> None:
        """[ptr, ptr + size) is memory this process imported by IPC handle (the transfer process's
        view of the scheduler's pool): it cannot be exported again, and `imported` says so."""
        with self._lock:
            self._imported.append((int(ptr), int(ptr) + int(size)))

    def imported(self, ptr: int) -> bool:
        with self._lock:
            return any(start <= ptr < end for start, end in self._imported)

    def mapped(self) -> dict:
        """{(handle, device that mapped it): holders} of the peers' allocations mapped now."""
        with self._ipc_lock:
            return dict(self._holders)

    def enable_peer_access(self, device: int, peer: int) -> None:
        """Let kernels on `device` reach memory of `peer`'s context (once per pair)."""
        with self._lock:
            if (device, peer) in self._peers:
                return
        self.use_device(device)
        rc = self.lib.cudaDeviceEnablePeerAccess(ctypes.c_int(peer), ctypes.c_uint(0))
        if rc == _PEER_ACCESS_ALREADY_ENABLED:
            self.lib.cudaGetLastError()
        else:
            self._check(rc, f"cudaDeviceEnablePeerAccess({device} -> {peer})")
        with self._lock:
            self._peers.add((device, peer))

    # ---- streams, events, copies -----------------------------------------------------------------
    def stream(self, device: int) -> int:
        self.use_device(device)
        s = ctypes.c_void_p()
        self._check(self.lib.cudaStreamCreateWithFlags(ctypes.byref(s), ctypes.c_uint(_STREAM_NON_BLOCKING)),
                    "cudaStreamCreateWithFlags")
        return s.value

    def event(self, device: int) -> int:
        self.use_device(device)
        e = ctypes.c_void_p()
        self._check(self.lib.cudaEventCreateWithFlags(ctypes.byref(e), ctypes.c_uint(_EVENT_DISABLE_TIMING)),
                    "cudaEventCreateWithFlags")
        return e.value

    def record(self, event: int, stream: int) -> None:
        self._check(self.lib.cudaEventRecord(ctypes.c_void_p(event), ctypes.c_void_p(stream)), "cudaEventRecord")

    def synchronize(self, event: int) -> None:
        """Blocks without the GIL until the event's work is done."""
        self._check(self.lib.cudaEventSynchronize(ctypes.c_void_p(event)), "cudaEventSynchronize")

    def copy(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: int, device: int) -> None:
        """Enqueue len(sizes) device-to-device copies on `stream`: one foreign call when the
        runtime batches copies, else one per range (arrays of uint64)."""
        self.use_device(device)
        count = len(sizes)
        if self.batch_calls:
            try:
                self._copy_batch(dsts, srcs, sizes, count, stream, device)
                return
            except CudaError as exc:
                # Not this runtime's batch signature or attributes: copy range by range from now on.
                logger.warning("softio: cudaMemcpyBatchAsync unusable (%s); copying range by range", exc)
                self.lib.cudaGetLastError()
                self.batch_calls = False
        memcpy = self.lib.cudaMemcpyAsync
        s = ctypes.c_void_p(stream)
        for i in range(count):
            self._check(memcpy(ctypes.c_void_p(int(dsts[i])), ctypes.c_void_p(int(srcs[i])),
                               ctypes.c_size_t(int(sizes[i])), ctypes.c_int(3), s), "cudaMemcpyAsync")

    def _copy_batch(self, dsts, srcs, sizes, count, stream, device) -> None:
        attrs = self._batch_attrs.get(device)
        if attrs is None:
            # The same for every batch of a device (read by the call, never written): built
            # once, not per submit (issue 28: softio's Python around a lone request's copy).
            attrs = self._batch_attrs[device] = (
                ctypes.byref(_MemcpyAttributes(_SRC_ACCESS_ORDER_STREAM, _MemLocation(_LOCATION_DEVICE, device),
                                               _MemLocation(_LOCATION_DEVICE, device),
                                               _FLAG_PREFER_OVERLAP_WITH_COMPUTE)),
                ctypes.byref(ctypes.c_size_t(0)))  # attrsIdxs: every copy uses attributes 0
        args = [ctypes.c_void_p(dsts.ctypes.data), ctypes.c_void_p(srcs.ctypes.data),
                ctypes.c_void_p(sizes.ctypes.data), ctypes.c_size_t(count), attrs[0], attrs[1], _ONE]
        if self.version < 13000:
            args.append(ctypes.byref(ctypes.c_size_t(0)))  # failIdx (written by the call), dropped in CUDA 13
        args.append(ctypes.c_void_p(stream))
        self._check(self._batch(*args), "cudaMemcpyBatchAsync")


_DRIVER = None


def _driver():
    global _DRIVER
    if _DRIVER is None:
        _DRIVER = ctypes.CDLL("libcuda.so.1")
    return _DRIVER


_RUNTIME: CudaRuntime | None = None
_LOADED = False
_LOAD_LOCK = threading.Lock()


def load() -> CudaRuntime | None:
    """The process's CUDA runtime, or None where there is none (or SGLANG_MORI_SOFTIO_DEVICE=0)."""
    global _RUNTIME, _LOADED
    if _LOADED:
        return _RUNTIME
    with _LOAD_LOCK:
        if not _LOADED:
            if os.environ.get(DISABLE_ENV, "") != "0":
                lib = _open_library()
                if lib is not None:
                    try:
                        runtime = CudaRuntime(lib)
                        count = ctypes.c_int(0)
                        if lib.cudaGetDeviceCount(ctypes.byref(count)) == 0 and count.value > 0:
                            _RUNTIME = runtime
                        else:
                            lib.cudaGetLastError()
                    except (CudaError, AttributeError) as exc:
                        logger.info("softio: CUDA runtime present but unusable: %s", exc)
            _LOADED = True
    return _RUNTIME
