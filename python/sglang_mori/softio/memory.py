"""Registered local memory: raw host pointers turned into writable memoryviews.

Every region is viewed through one memoryview built once at registration, so the data path can
slice it (no copy) and hand the slice straight to sendmsg/recv_into. GPU-typed registrations are
accepted because SGLang registers its KV pools as GPU memory, and on a CPU-only host the pointer is
host memory. Where a CUDA runtime is loaded and a GPU-typed pointer really is device memory, the
region is a device region: exported with an IPC handle in its descriptor and written only through
softio's device path (device_path.py); host frames into it are refused.
"""

from __future__ import annotations

import ctypes
import logging
import threading

from . import cuda_runtime
from .descriptors import MemoryDesc
from .enums import MemoryLocationType

logger = logging.getLogger(__name__)


class Region:
    __slots__ = ("id", "ptr", "size", "view", "loc", "device")

    def __init__(self, mem_id: int, ptr: int, size: int, loc: MemoryLocationType, device: int | None = None):
        self.id = mem_id
        self.ptr = ptr
        self.size = size
        self.loc = loc
        self.device = device  # CUDA device of a device region; None for host memory
        buffer = (ctypes.c_ubyte * size).from_address(ptr)
        self.view = memoryview(buffer).cast("B")


class LocalMemory:
    """The engine's memory pool: ids come from a per-engine counter starting at 0, like MORI."""

    def __init__(self, engine_key: str):
        self._engine_key = engine_key
        self._next_id = 0
        self._lock = threading.Lock()
        self._regions: dict[int, Region] = {}

    def register(self, ptr: int, size: int, device_id: int, mem_loc) -> MemoryDesc:
        ptr, size, device_id = int(ptr), int(size), int(device_id)
        if size < 0 or ptr < 0:
            raise TypeError("register_memory: ptr and size must be non-negative integers")
        if size == 0:
            # ibv_reg_mr aborts on a zero-length region; fail loudly instead.
            raise RuntimeError("register_memory: size 0 cannot be registered")
        if ptr == 0:
            raise RuntimeError("register_memory: null pointer")
        loc = MemoryLocationType(mem_loc)
        device, handle, offset = None, None, 0
        if loc is MemoryLocationType.GPU:
            runtime = cuda_runtime.load()
            device = runtime.device_of(ptr) if runtime is not None else None
            if device is not None:
                if device_id >= 0 and device != device_id:
                    # A pool on one GPU registered under another's id (a wrong gpu_id): the copies
                    # would be posted from the wrong device's stream. Fail at start-up, by name.
                    raise RuntimeError(f"register_memory: memory at {ptr:#x} is on GPU {device} but was "
                                       f"registered as device {device_id}")
                try:
                    handle, offset = runtime.export(ptr, device)
                except cuda_runtime.CudaError as exc:
                    # Memory this process imported (a transfer process maps the scheduler's pool
                    # with CUDA IPC) may not be exportable again. It is only ever the local side
                    # of our writes, so it is registered without a handle: a peer cannot open it.
                    # Expected there (one line per pool at every child start: debug); anywhere
                    # else a peer that needs to open this memory will fail, so it warns.
                    level = logging.DEBUG if runtime.imported(ptr) else logging.WARNING
                    logger.log(level, "softio: GPU memory at %#x registered without an IPC handle: %s", ptr, exc)
                    handle = None
        with self._lock:
            mem_id = self._next_id
            self._next_id = (self._next_id + 1) & 0xFFFFFFFF
            self._regions[mem_id] = Region(mem_id, ptr, size, loc, device)
        desc = MemoryDesc._make(self._engine_key, mem_id, device_id, ptr, size, loc)
        if handle is not None:
            desc._ipc_handle, desc._ipc_offset = handle, offset
        return desc

    def deregister(self, desc: MemoryDesc) -> None:
        with self._lock:
            self._regions.pop(desc.id, None)

    def get(self, mem_id: int) -> Region | None:
        return self._regions.get(mem_id)

    def require(self, desc: MemoryDesc) -> Region:
        """The local side of a transfer must be a live registration of this engine."""
        region = self._regions.get(desc._id)
        if region is None or desc._engine_key != self._engine_key:
            raise _LocalRegionError(f"local memory {desc._id} is not registered with this engine")
        return region


class _LocalRegionError(Exception):
    """Raised inside submit; turned into a failed status, never seen by callers."""
