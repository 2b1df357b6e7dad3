"""softio's gather-kernel source (device_gather._SOURCE) built for the CPU, for the unit tests: the
kernels use no shared memory, no barrier and no warp intrinsic, so running every thread of the grid
one after another does what the GPU does in parallel (each thread's loads and stores are its own).
A small prelude stands in for CUDA's built-ins; the kernels themselves are compiled unchanged.
Needs a C++ compiler (g++ or c++); `build()` returns None without one."""

from __future__ import annotations

import ctypes
import hashlib
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from sglang_mori.softio import device_gather

_PRELUDE = r"""
#include <cstdint>
#include <cstddef>
#include <vector>
#define __global__
#define __device__
#define __forceinline__ inline
struct uint4 { unsigned x, y, z, w; };
struct dim3h { unsigned x; };
static dim3h threadIdx, blockIdx, blockDim, gridDim;
static unsigned long long atomicAdd(unsigned long long* a, unsigned long long v) { auto o = *a; *a += v; return o; }
// Threads run one after another, lane 0 of a warp first: a warp's other lanes get what lane 0 had
// at the same call (a log kept per warp), as the GPU's __shfl_sync(.., 0) gives every lane at once.
static std::vector<unsigned long long> shfl_log;
static std::size_t shfl_at;
static unsigned long long __shfl_sync(unsigned mask, unsigned long long v, int src) {
    if ((threadIdx.x & 31) == 0) { shfl_log.push_back(v); return v; }
    return shfl_log[shfl_at++];
}
"""

# one entry point per kernel: runs the whole grid, thread by thread
_DRIVER = r"""
extern "C" void run_bytes(unsigned grid, unsigned block, const u64* table, long long pairs, long long per,
                          u64 share) {
    gridDim.x = grid; blockDim.x = block;
    for (unsigned b = 0; b < grid; b++) for (unsigned t = 0; t < block; t++) {
        blockIdx.x = b; threadIdx.x = t; gather_bytes(table, pairs, per, share);
    }
}
extern "C" void run_dynamic(unsigned grid, unsigned block, u64* table, long long pairs, long long per,
                            u64 share) {
    gridDim.x = grid; blockDim.x = block;
    for (unsigned b = 0; b < grid; b++) for (unsigned t = 0; t < block; t++) {
        blockIdx.x = b; threadIdx.x = t;
        if ((t & 31) == 0) shfl_log.clear();
        shfl_at = 0;
        gather_bytes_dynamic(table, pairs, per, share);
    }
}
extern "C" void run_ranges(unsigned grid, unsigned block, const u64* table, long long n) {
    gridDim.x = grid; blockDim.x = block;
    for (unsigned b = 0; b < grid; b++) for (unsigned t = 0; t < block; t++) {
        blockIdx.x = b; threadIdx.x = t; gather_copy(table, n);
    }
}
extern "C" void run_shared(unsigned grid, unsigned block, const u64* table, long long pairs, long long per) {
    gridDim.x = grid; blockDim.x = block;
    for (unsigned b = 0; b < grid; b++) for (unsigned t = 0; t < block; t++) {
        blockIdx.x = b; threadIdx.x = t; gather_copy_shared(table, pairs, per);
    }
}
"""


def build(unroll: int = device_gather.UNROLL):
    """The kernels as a CPU library (ctypes.CDLL), or None where no C++ compiler is installed."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        return None
    text = f"#define UNROLL {unroll}\n" + _PRELUDE + device_gather._SOURCE.replace('extern "C" ', "") + _DRIVER
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    lib = Path(tempfile.gettempdir()) / f"sglang_mori_gather_host_{digest}.so"
    if not lib.exists():
        src = lib.with_suffix(".cpp")
        src.write_text(text)
        tmp = lib.with_suffix(f".{digest}.tmp.so")
        subprocess.run([cxx, "-O1", "-shared", "-fPIC", "-w", "-o", str(tmp), str(src)], check=True)
        tmp.replace(lib)
    dll = ctypes.CDLL(str(lib))
    u, ll, p = ctypes.c_uint, ctypes.c_longlong, ctypes.c_void_p
    dll.run_bytes.argtypes = [u, u, p, ll, ll, ctypes.c_ulonglong]
    dll.run_dynamic.argtypes = [u, u, p, ll, ll, ctypes.c_ulonglong]
    dll.run_ranges.argtypes = [u, u, p, ll]
    dll.run_shared.argtypes = [u, u, p, ll, ll]
    return dll


def table_ptr(host: np.ndarray) -> int:
    return host.ctypes.data
