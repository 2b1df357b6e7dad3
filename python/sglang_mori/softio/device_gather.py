"""One kernel launch for a whole batch of device copies (CuPy), instead of one copy-engine
operation per range.

Measured on an H100 (docs/benchmarks.md): cudaMemcpyBatchAsync spends about 5 us of driver time
per range in the submitting thread, so a 16K-token DeepSeek-V3 request scattered over 64-token
pages (61 x 256 ranges) takes ~70 ms just to enqueue, longer than moving its 1.15 GB. A gather
kernel reads the range table from device memory and copies every range in one launch, so the
enqueue cost no longer grows with the ranges. Its grid is small (GRID_BLOCKS blocks striding
over the ranges): it takes a few SMs from the forward, never the GPU, and still copies far faster
than the NIC the path is paced like.

Used when CuPy and its runtime compiler work (SGLANG_MORI_SOFTIO_DEVICE_COPY=kernel, the default
where they do); `memcpy` keeps the copy engines (cuda_runtime.copy).
"""

from __future__ import annotations

import logging
import os

import numpy as np

logger = logging.getLogger("sglang_mori.softio")

COPY_ENV = "SGLANG_MORI_SOFTIO_DEVICE_COPY"
GRID_BLOCKS = 16
THREADS = 256

_SOURCE = r"""
extern "C" __global__ void gather_copy(const unsigned long long* table, long long n) {
    // table: n destinations, then n sources, then n sizes (bytes)
    const unsigned long long* dsts = table;
    const unsigned long long* srcs = table + n;
    const unsigned long long* sizes = table + 2 * n;
    for (long long r = blockIdx.x; r < n; r += gridDim.x) {
        char* dst = (char*)dsts[r];
        const char* src = (const char*)srcs[r];
        unsigned long long size = sizes[r];
        if ((((unsigned long long)dst | (unsigned long long)src | size) & 15) == 0) {
            uint4* d = (uint4*)dst;
            const uint4* s = (const uint4*)src;
            for (unsigned long long i = threadIdx.x; i < size / 16; i += blockDim.x) d[i] = s[i];
        } else {
            for (unsigned long long i = threadIdx.x; i < size; i += blockDim.x) dst[i] = src[i];
        }
    }
}
"""


class GatherCopier:
    """Copies of one engine stream: the range table goes to the device and one kernel copies it."""

    def __init__(self, device: int):
        import cupy

        self.cupy = cupy
        self.device = device
        with cupy.cuda.Device(device):
            self.kernel = cupy.RawKernel(_SOURCE, "gather_copy")
            self.kernel.compile()

    def copy(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: int):
        """Enqueue the copies on `stream`; returns the device table, which must outlive the
        kernel (the caller keeps it until the batch's event fired)."""
        cupy = self.cupy
        host = np.concatenate([dsts, srcs, sizes]).astype(np.uint64)
        with cupy.cuda.Device(self.device):
            s = cupy.cuda.ExternalStream(stream)
            with s:
                table = cupy.asarray(host)
                n = len(sizes)
                self.kernel((min(n, GRID_BLOCKS),), (THREADS,), (table, np.int64(n)))
        return table


def make_copier(device: int):
    """A GatherCopier, or None when the setting or the host says copy engines (logged once)."""
    choice = os.environ.get(COPY_ENV, "kernel").strip().lower()
    if choice == "memcpy":
        return None
    if choice != "kernel":
        raise ValueError(f"{COPY_ENV} must be 'kernel' or 'memcpy', got {choice!r}")
    try:
        return GatherCopier(device)
    except Exception as exc:  # noqa: BLE001 - no CuPy, no NVRTC: the copy engines do it
        logger.warning("softio: device gather kernel unavailable (%s); copying range by range", exc)
        return None
