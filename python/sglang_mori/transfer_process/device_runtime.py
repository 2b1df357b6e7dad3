"""The few GPU runtime calls the transfer process makes itself, for CUDA or HIP, through ctypes.

softio's cuda_runtime covers the device path on NVIDIA; on AMD the child has no softio device path
(MORI-IO is the engine) but still maps the scheduler's pools and proves their registration, so the
calls here come in either flavour: the runtime library the process already loaded (torch's), found
in /proc/self/maps, HIP's names being CUDA's with `hip` for `cuda`. `load()` returns None on a host
without either.

Waiting: CUDA's default scheduling (cudaDeviceScheduleAuto) spins the waiting thread on its core
while the GPU works when the process has fewer contexts than the host has CPUs, which is always
here. The transfer process's completion thread waits in cudaEventSynchronize on every batch's
event, so it would keep a core busy whenever a copy is queued behind the forward's kernels. The
child asks for blocking waits before anything creates its context (`block_on_waits`).
"""

from __future__ import annotations

import ctypes
import logging
from typing import Optional

logger = logging.getLogger(__name__)

IPC_HANDLE_BYTES = 64
_SCHEDULE_BLOCKING_SYNC = 4  # cudaDeviceScheduleBlockingSync / hipDeviceScheduleBlockingSync / CU_CTX_SCHED_BLOCKING_SYNC
_IPC_LAZY_ENABLE_PEER_ACCESS = 1
_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault / hipMemcpyDefault (unified addressing picks the direction)
_LIBRARIES = (("hip", "/libamdhip64.so"), ("cuda", "/libcudart.so"))
_SONAMES = (("cuda", "libcudart.so.13"), ("cuda", "libcudart.so.12"), ("hip", "libamdhip64.so"),
            ("hip", "libamdhip64.so.6"))


class DeviceRuntimeError(RuntimeError):
    pass


class _IpcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_BYTES)]  # passed by value


def _loaded_library() -> Optional[tuple]:
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rsplit(None, 1)[-1]
                for flavour, marker in _LIBRARIES:
                    if marker in path:
                        return flavour, path
    except OSError:
        pass
    return None


class DeviceRuntime:
    def __init__(self, flavour: str, lib):
        self.flavour = flavour  # "cuda" or "hip"
        self.lib = lib
        self._error_string = self._fn("GetErrorString")
        self._error_string.restype = ctypes.c_char_p

    def _fn(self, name: str):
        return getattr(self.lib, self.flavour + name)

    def _call(self, name: str, *args) -> None:
        rc = self._fn(name)(*args)
        if rc != 0:
            try:
                text = self._error_string(rc).decode()
            except Exception:  # noqa: BLE001 - only the message is at stake
                text = "?"
            raise DeviceRuntimeError(f"{self.flavour}{name} failed: error {rc} ({text})")

    def use_device(self, device: int) -> None:
        self._call("SetDevice", ctypes.c_int(device))

    def block_on_waits(self, device: int) -> None:
        """Make every wait on `device` in this process block in the kernel instead of spinning."""
        if self.flavour == "cuda":
            # The driver's primary-context flags: process-wide, where cudaSetDeviceFlags is
            # documented per calling thread (the completion thread is not the one calling this).
            # Called before anything in the child creates the context.
            driver = ctypes.CDLL("libcuda.so.1")
            handle = ctypes.c_int()
            for what, rc in (("cuInit", lambda: driver.cuInit(0)),
                             ("cuDeviceGet", lambda: driver.cuDeviceGet(ctypes.byref(handle), ctypes.c_int(device))),
                             ("cuDevicePrimaryCtxSetFlags", lambda: driver.cuDevicePrimaryCtxSetFlags_v2(
                                 handle, ctypes.c_uint(_SCHEDULE_BLOCKING_SYNC)))):
                code = rc()
                if code != 0:
                    raise DeviceRuntimeError(f"{what} failed: CUDA driver error {code}")
            return
        self.use_device(device)
        self._call("SetDeviceFlags", ctypes.c_uint(_SCHEDULE_BLOCKING_SYNC))

    # --- pools from another process -------------------------------------------------------------
    def export(self, ptr: int, device: int) -> tuple:
        """(IPC handle of the allocation holding ptr, ptr's offset in it). HIP only: on CUDA the
        pools go through softio's cuda_runtime, which the child's softio device path shares."""
        self.use_device(device)
        base, size = ctypes.c_void_p(), ctypes.c_size_t()
        self._call("MemGetAddressRange", ctypes.byref(base), ctypes.byref(size), ctypes.c_void_p(ptr))
        handle = ctypes.create_string_buffer(IPC_HANDLE_BYTES)
        self._call("IpcGetMemHandle", handle, ctypes.c_void_p(base.value))
        return handle.raw, ptr - base.value

    def open(self, handle: bytes, device: int) -> int:
        self.use_device(device)
        out = ctypes.c_void_p()
        self._call("IpcOpenMemHandle", ctypes.byref(out), _IpcMemHandle.from_buffer_copy(handle),
                   ctypes.c_uint(_IPC_LAZY_ENABLE_PEER_ACCESS))
        return out.value

    def close(self, base: int, device: int) -> None:
        self.use_device(device)
        self._call("IpcCloseMemHandle", ctypes.c_void_p(base))

    # --- the start-up proof's buffer ------------------------------------------------------------
    def alloc(self, size: int, device: int) -> int:
        self.use_device(device)
        out = ctypes.c_void_p()
        self._call("Malloc", ctypes.byref(out), ctypes.c_size_t(size))
        return out.value

    def free(self, ptr: int, device: int) -> None:
        self.use_device(device)
        self._call("Free", ctypes.c_void_p(ptr))

    def read(self, ptr: int, size: int, device: int) -> bytes:
        """`size` bytes of device memory, copied to the host (synchronous)."""
        self.use_device(device)
        out = ctypes.create_string_buffer(size)
        self._call("Memcpy", out, ctypes.c_void_p(ptr), ctypes.c_size_t(size), ctypes.c_int(_MEMCPY_DEFAULT))
        return out.raw


def load() -> Optional[DeviceRuntime]:
    """The GPU runtime this process loaded (else the first usual soname that loads), or None."""
    found = _loaded_library()
    candidates = [found] if found else list(_SONAMES)
    for flavour, name in candidates:
        try:
            return DeviceRuntime(flavour, ctypes.CDLL(name))
        except (OSError, AttributeError):
            continue
    return None
