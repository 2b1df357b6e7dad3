"""Gather-kernel variants for the link diagnostic (test/gpu/link_profile.py): the same range
table (n destinations, n sources, n sizes) copied by one block per range (softio's kernel before
issue 28) or one warp per range, with UNROLL 16-byte loads in flight per thread. Compiled with
CuPy; each variant is checked byte for byte on random, partly unaligned ranges before it is timed."""

from __future__ import annotations

SOURCE = r"""
#ifndef UNROLL
#define UNROLL 4
#endif
__device__ __forceinline__ void copy_range(char* dst, const char* src, unsigned long long size,
                                           unsigned long long lane, unsigned long long step) {
    if ((((unsigned long long)dst | (unsigned long long)src | size) & 15) == 0) {
        uint4* d = (uint4*)dst;
        const uint4* s = (const uint4*)src;
        unsigned long long m = size / 16;
        unsigned long long i = lane;
        for (; i + (UNROLL - 1) * step < m; i += UNROLL * step) {
            uint4 v[UNROLL];
#pragma unroll
            for (int k = 0; k < UNROLL; k++) v[k] = s[i + k * step];
#pragma unroll
            for (int k = 0; k < UNROLL; k++) d[i + k * step] = v[k];
        }
        for (; i < m; i += step) d[i] = s[i];
    } else {
        for (unsigned long long i = lane; i < size; i += step) dst[i] = src[i];
    }
}

extern "C" __global__ void block_per_range(const unsigned long long* table, long long n) {
    for (long long r = blockIdx.x; r < n; r += gridDim.x)
        copy_range((char*)table[r], (const char*)table[n + r], table[2 * n + r], threadIdx.x, blockDim.x);
}

extern "C" __global__ void warp_per_range(const unsigned long long* table, long long n) {
    const long long warps = ((long long)gridDim.x * blockDim.x) >> 5;
    const long long first = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    for (long long r = first; r < n; r += warps)
        copy_range((char*)table[r], (const char*)table[n + r], table[2 * n + r], threadIdx.x & 31, 32);
}
"""

# (label, kernel name, UNROLL, blocks per SM, threads)
VARIANTS = [
    ("block u4 1/SM x512", "block_per_range", 4, 1, 512),
    ("block u8 1/SM x512", "block_per_range", 8, 1, 512),
    ("block u4 2/SM x512", "block_per_range", 4, 2, 512),
    ("warp u4 1/SM x512", "warp_per_range", 4, 1, 512),
    ("warp u4 2/SM x512", "warp_per_range", 4, 2, 512),
    ("warp u8 1/SM x512", "warp_per_range", 8, 1, 512),
    ("warp u8 2/SM x512", "warp_per_range", 8, 2, 512),
    ("warp u8 4/SM x256", "warp_per_range", 8, 4, 256),
]


def compile_variant(cupy, name: str, unroll: int):
    kernel = cupy.RawKernel(SOURCE, name, options=(f"-DUNROLL={unroll}",))
    kernel.compile()
    return kernel
