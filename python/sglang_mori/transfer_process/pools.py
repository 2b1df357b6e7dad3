"""What the transfer process needs to map the scheduler's KV pools, and the mapping itself.

The manager knows the pools only as SGLang's `kv_args` pointers and lengths. The least invasive
import works from those alone, with no change to SGLang:
- device memory: a CUDA IPC handle of the allocation holding the pointer, plus the offset in it
  (softio's cuda_runtime, the calls torch's CUDA IPC makes; on ROCm the same pair of HIP calls);
- host memory: the file backing the mapping that holds the pointer, when it is a shared-memory
  file under /dev/shm (found in /proc/self/maps), mapped again in the child at the same offset.
Anything else (private host memory, a pool spanning two mappings) cannot be imported: `describe`
raises PoolNotImportable naming the buffer, and the manager refuses the switch at start-up.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from dataclasses import dataclass
from typing import List, Sequence

SHM_DIR = "/dev/shm/"


class PoolNotImportable(RuntimeError):
    """A KV buffer the transfer process could not map."""


@dataclass(frozen=True)
class PoolImport:
    kind: str  # "shm", "cuda" or "hip"
    size: int
    path: str = ""  # shm: the backing file
    file_offset: int = 0  # shm: the pointer's offset in that file
    handle: bytes = b""  # cuda, hip: IPC handle of the allocation
    offset: int = 0  # cuda, hip: the pointer's offset in the allocation
    device: int = -1


def _mapping_of(ptr: int, size: int, maps_text: str):
    """(path, file offset of ptr) of the /proc/self/maps line holding [ptr, ptr + size), or None."""
    for line in maps_text.splitlines():
        fields = line.split(None, 5)
        start, end = (int(x, 16) for x in fields[0].split("-"))
        if start <= ptr < end:
            if ptr + size > end:
                return None
            path = fields[5].strip() if len(fields) > 5 else ""
            return path, int(fields[2], 16) + (ptr - start)
    return None


def describe(ptrs: Sequence[int], sizes: Sequence[int], on_gpu: bool, device: int,
             what: str = "KV buffer") -> List[PoolImport]:
    """How the child maps each buffer; PoolNotImportable for the first that cannot be."""
    if on_gpu:
        from sglang_mori.softio import cuda_runtime
        from sglang_mori.transfer_process import device_runtime

        kind, runtime = "cuda", cuda_runtime.load()
        if runtime is None:  # ROCm: the same calls under HIP's names (MORI-IO's XGMI does the same)
            hip = device_runtime.load()
            kind, runtime = ("hip", hip) if hip is not None and hip.flavour == "hip" else (kind, None)
        if runtime is None:
            raise PoolNotImportable(f"{what}s are GPU memory but no CUDA or HIP runtime is loaded to export them")
        out = []
        handles = {}  # allocation base -> the first handle exported for it
        for i, (ptr, size) in enumerate(zip(ptrs, sizes)):
            try:
                handle, offset = runtime.export(int(ptr), device)
            except Exception as exc:  # e.g. a virtual-memory allocation (expandable segments)
                raise PoolNotImportable(f"{what} {i} at {int(ptr):#x}: no {kind.upper()} IPC handle ({exc})") from None
            # Pools in one allocation (SGLang's MHA K and V of a layer; tensors the caching allocator
            # placed in one segment) carry the same handle bytes, so that the child maps it once.
            handle = handles.setdefault(int(ptr) - offset, handle)
            out.append(PoolImport(kind, int(size), handle=handle, offset=offset, device=device))
        return out
    with open("/proc/self/maps") as f:
        maps_text = f.read()
    out = []
    for i, (ptr, size) in enumerate(zip(ptrs, sizes)):
        found = _mapping_of(int(ptr), int(size), maps_text)
        if found is None or not found[0].startswith(SHM_DIR) or found[0].endswith("(deleted)"):
            where = "in no single mapping" if found is None else f"in {found[0] or 'anonymous memory'}"
            raise PoolNotImportable(
                f"{what} {i} at {int(ptr):#x} ({int(size)} bytes) is private host memory ({where}): "
                "the transfer process can map only shared-memory files under /dev/shm")
        out.append(PoolImport("shm", int(size), path=found[0], file_offset=found[1]))
    return out


class ImportedPools:
    """The child's mappings of the scheduler's buffers; `ptrs` line up with the descriptions."""

    def __init__(self, imports: Sequence[PoolImport]):
        self._maps: list = []
        self._cuda: list = []
        self._hip: list = []
        self._hip_bases: dict = {}  # (handle, device) -> base of its one mapping
        # the GPU runtime's own calls (device_runtime.py), for the start-up proof and HIP imports
        self.runtime = None
        if any(p.kind in ("cuda", "hip") for p in imports):
            from sglang_mori.transfer_process import device_runtime

            self.runtime = device_runtime.load()
            if self.runtime is None:
                raise PoolNotImportable("the transfer process has no CUDA or HIP runtime to open the pools")
        self.ptrs: List[int] = [self._map(p) for p in imports]

    def _map(self, p: PoolImport) -> int:
        if p.kind == "hip":  # written for MORI-IO on AMD (test/manual/test_transfer_process_amd.py); not run yet
            # One mapping per allocation: SGLang's MHA pool keeps a layer's K and V in one allocation
            # (and the caching allocator puts several tensors in one segment), while a handle can be
            # opened once per process; each pool is its offset in the shared mapping.
            key = (p.handle, p.device)
            if key not in self._hip_bases:
                self._hip_bases[key] = self.runtime.open(p.handle, p.device)
                self._hip.append((self._hip_bases[key], p.device))
            return self._hip_bases[key] + p.offset
        if p.kind == "cuda":  # softio's runtime maps a handle once and counts its holders (K and V share one)
            from sglang_mori.softio import cuda_runtime

            runtime = cuda_runtime.load()
            if runtime is None:
                raise PoolNotImportable("the transfer process has no CUDA runtime to open the pools")
            base = runtime.open(p.handle, p.device)
            self._cuda.append((runtime, p.handle, p.device))
            runtime.note_imported(base + p.offset, p.size)  # softio registers it without re-exporting
            return base + p.offset
        page = mmap.ALLOCATIONGRANULARITY
        aligned = p.file_offset - p.file_offset % page
        fd = os.open(p.path, os.O_RDWR)
        try:
            m = mmap.mmap(fd, p.size + (p.file_offset - aligned), offset=aligned)
        finally:
            os.close(fd)
        self._maps.append(m)
        return ctypes.addressof(ctypes.c_char.from_buffer(m)) + (p.file_offset - aligned)

    def close(self) -> None:
        for runtime, handle, device in self._cuda:
            runtime.close(handle, device)
        self._cuda.clear()
        for base, device in self._hip:
            self.runtime.close(base, device)
        self._hip.clear()
        self._hip_bases.clear()
        # A mapping with a live ctypes export cannot close; the process exit unmaps it.
        for m in self._maps:
            try:
                m.close()
            except BufferError:
                pass
        self._maps.clear()

