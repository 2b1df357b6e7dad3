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

Kernels (SGLANG_MORI_SOFTIO_GATHER_KERNEL): `dynamic`, the default since session 22, cuts the batch's
bytes into shares of 16 KiB that warps take from a counter, each copied as the pieces of the ranges
it overlaps (`bytes`: the same shares, each warp its own, by index; the session-22 sweep measured
`dynamic` 0.934-0.936x of a plain copy, `bytes` 0.930-0.934x, at 16 KiB shares): with a
warp per range (`ranges`, before), MLA 8K's 7,808 pages of 72 KiB over 2,112 warps (3.7 a warp)
left the last of 4 rounds 30 % idle, and the copy at 0.84-0.87x of a plain copy on 2x H200.

Grid: one warp per range (or share), GRID_BLOCKS blocks of THREADS threads for a copy within one GPU (the
forward keeps the rest of the SMs); PEER_BLOCKS_PER_SM blocks per SM for a batch that writes to
another GPU, whose link (NVLink here, XGMI on AMD) needs stores from every SM to come near a plain
copy's speed (docs/benchmarks.md, "Two GPUs" and "Issue 28": with the table resident, block- or
warp-per-range and 1-4 blocks per SM all copied at 0.91-0.96x of a plain copy on 2x H200; warp
per range keeps a small range from idling most of a block). Such a batch holds every SM of the
source GPU while it runs. SGLANG_MORI_SOFTIO_GATHER_BLOCKS sets one grid for both.

Ranges of at least SGLANG_MORI_SOFTIO_CE_MIN_BYTES (default 1 MiB) are not the kernel's: they go to
the copy engines (cudaMemcpyAsync), which copy them at the link's full speed without holding any SM.
SGLang's page size 1 makes plans of few such long runs (an 8K-token prompt's K of one layer is one
16 MiB range on a fresh pool): with the kernel, a peer batch of them held every SM of the prefill's
GPU beside its forward. A long range costs the copy engines a few microseconds of driver time to
enqueue, small beside the bytes it moves, and MORI-IO's XGMI route uses the DMA engines too.

The range table travels through pinned host memory (in size classes CuPy's pool can reuse) and an
asynchronous copy on the engine's stream, so posting never waits for the batches still copying
ahead of it on that stream. A batch whose pairs all copy the same ranges of their own regions (the
backend's plans: one offset array per chunk for every layer's buffer) travels as the pairs' bases
and the ranges once, and `gather_copy_shared` adds them up per range: the table no longer grows
with pairs x ranges (3 MB at 32K GQA tokens, built and uploaded before the copy could start).
"""

from __future__ import annotations

import ctypes
import logging
import os

import numpy as np

logger = logging.getLogger("sglang_mori.softio")

COPY_ENV = "SGLANG_MORI_SOFTIO_DEVICE_COPY"
BLOCKS_ENV = "SGLANG_MORI_SOFTIO_GATHER_BLOCKS"
GRID_BLOCKS = 16
# To another GPU: one block per SM, as before session 13. Two per SM copied no faster with the table
# resident (0.91-0.96x of a plain copy for 1-4 blocks per SM, link28's sweep) and hold twice the SM
# threads beside a forward; going back to one did not change the 8K TTFT run (docs/benchmarks.md).
PEER_BLOCKS_PER_SM = 1
THREADS = 512
# `ranges` only (`bytes` cuts long ranges into its shares on the device): one warp copies one table
# entry, so a range longer than this is split into pieces of this size first: SGLang's page size 1
# makes the backend's plans few long runs (an 8K-token prompt's K of one layer is one 16 MiB range
# on a fresh pool), which one warp each copied at a fraction of the link
# (last layer group: 4.3 ms from post to event on 2x H200 against 0.7 ms with a block per range).
# 128 KiB keeps the paged shapes' pages (MLA page 64: 72 KiB) whole and is a multiple of 16 bytes,
# so aligned ranges stay aligned piece by piece.
PIECE_BYTES = 128 << 10
# gather_bytes: a warp's share of the batch is a multiple of its 32 lanes' 16-byte words
SHARE_ALIGN = 512
# gather_bytes_dynamic's share where SGLANG_MORI_SOFTIO_GATHER_SHARE is 0: the session-22 sweep's best
# (16 KiB: 0.934-0.936x of a plain copy on 2x H200 over MLA/GQA 8K/32K; `bytes` at 16 KiB 0.930-0.934x)
DYNAMIC_SHARE = 16 << 10
UNROLL = 8  # 16-byte loads in flight per thread (the kernel's -DUNROLL)
KERNEL_ENV = "SGLANG_MORI_SOFTIO_GATHER_KERNEL"
UNROLL_ENV = "SGLANG_MORI_SOFTIO_GATHER_UNROLL"
THREADS_ENV = "SGLANG_MORI_SOFTIO_GATHER_THREADS"
SHARE_ENV = "SGLANG_MORI_SOFTIO_GATHER_SHARE"
_ZERO = np.zeros(1, dtype=np.uint64)  # the flat table's one pair of bases
MIN_PINNED_BYTES = 64 << 10  # the smallest staging buffer class (pinned_bytes)
CE_MIN_ENV = "SGLANG_MORI_SOFTIO_CE_MIN_BYTES"
CE_MIN_BYTES = 1 << 20
_umax = np.maximum.reduce  # ndarray.max without its Python wrapper (on the way to a launch)
_accumulate = np.add.accumulate  # np.cumsum without its Python wrappers

_SOURCE = r"""
#ifndef UNROLL
#define UNROLL 8
#endif
typedef unsigned long long u64;

// One warp copies one range. A block per range left most threads idle on small ranges (a 4 KB
// GQA page is 256 16-byte words for 512 threads) and paid the table's latency once per range per
// block.
__device__ __forceinline__ void copy_range(char* dst, const char* src, u64 size, u64 lane) {
    if ((((u64)dst | (u64)src | size) & 15) == 0) {
        uint4* d = (uint4*)dst;
        const uint4* s = (const uint4*)src;
        u64 m = size / 16;
        u64 i = lane;
        // UNROLL loads in flight per thread before their stores: a store to another GPU's
        // memory is slow to retire, and one load/store pair per thread leaves the link idle
        for (; i + (UNROLL - 1) * 32 < m; i += UNROLL * 32) {
            uint4 v[UNROLL];
#pragma unroll
            for (int k = 0; k < UNROLL; k++) v[k] = s[i + k * 32];
#pragma unroll
            for (int k = 0; k < UNROLL; k++) d[i + k * 32] = v[k];
        }
        for (; i < m; i += 32) d[i] = s[i];
    } else {
        for (u64 i = lane; i < size; i += 32) dst[i] = src[i];
    }
}

// copy_range for any piece: where destination and source share their offset within 16 bytes, the
// bytes before the first 16-byte boundary and after the last one go one by one and the middle as
// 16-byte words (a piece of a byte share starts wherever the share does).
__device__ __forceinline__ void copy_piece(char* dst, const char* src, u64 size, u64 lane) {
    if ((((u64)dst ^ (u64)src) & 15) == 0) {
        u64 head = (16 - ((u64)dst & 15)) & 15;
        if (head > size) head = size;
        if (lane < head) dst[lane] = src[lane];
        u64 body = (size - head) & ~(u64)15;
        copy_range(dst + head, src + head, body, lane);
        u64 done = head + body;
        if (lane < size - done) dst[done + lane] = src[done + lane];
    } else {
        for (u64 i = lane; i < size; i += 32) dst[i] = src[i];
    }
}

extern "C" __global__ void gather_copy(const u64* table, long long n) {
    // table: n destinations, then n sources, then n sizes (bytes)
    const u64* dsts = table;
    const u64* srcs = table + n;
    const u64* sizes = table + 2 * n;
    const long long warps = ((long long)gridDim.x * blockDim.x) >> 5;
    const u64 lane = threadIdx.x & 31;
    for (long long r = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < n; r += warps) {
        copy_range((char*)dsts[r], (const char*)srcs[r], sizes[r], lane);
    }
}

extern "C" __global__ void gather_copy_shared(const u64* table, long long pairs, long long per) {
    // pairs that copy the same ranges of their own regions (the backend's plans): table holds
    // `pairs` destination bases, `pairs` source bases, then `per` destination offsets, `per`
    // source offsets and `per` sizes. Range r is pair r / per's range r % per, pair by pair as in
    // the flat table, which this table replaces at a fraction of its size.
    const u64* dst_base = table;
    const u64* src_base = table + pairs;
    const u64* dst_off = table + 2 * pairs;
    const u64* src_off = dst_off + per;
    const u64* sizes = src_off + per;
    const long long n = pairs * per;
    const long long warps = ((long long)gridDim.x * blockDim.x) >> 5;
    const u64 lane = threadIdx.x & 31;
    for (long long r = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < n; r += warps) {
        const long long p = r / per;
        const long long j = r - p * per;
        copy_range((char*)(dst_base[p] + dst_off[j]), (const char*)(src_base[p] + src_off[j]), sizes[j], lane);
    }
}

// Bytes [start, start + left) of the batch (pair by pair, range by range), copied by one warp as
// the pieces of the ranges they overlap. table: gather_copy_shared's, then `per` ends
// (ends[j] = sizes[0] + ... + sizes[j]: where range j ends within a pair's bytes).
__device__ __forceinline__ void copy_share(const u64* table, long long pairs, long long per, u64 pair_bytes,
                                           u64 start, u64 left, u64 lane) {
    const u64* dst_base = table;
    const u64* src_base = table + pairs;
    const u64* dst_off = table + 2 * pairs;
    const u64* src_off = dst_off + per;
    const u64* sizes = src_off + per;
    const u64* ends = sizes + per;
    u64 p = start / pair_bytes;
    u64 q = start - p * pair_bytes;  // where the share starts within pair p's bytes
    long long lo = 0, hi = per - 1;  // the first range ending after q
    while (lo < hi) {
        const long long mid = (lo + hi) >> 1;
        if (ends[mid] > q) hi = mid; else lo = mid + 1;
    }
    long long j = lo;
    while (left) {
        const u64 end = ends[j];
        const u64 off = q - (end - sizes[j]);
        const u64 len = end - q < left ? end - q : left;
        copy_piece((char*)(dst_base[p] + dst_off[j] + off), (const char*)(src_base[p] + src_off[j] + off), len,
                   lane);
        left -= len;
        q += len;
        if (q == end) {  // range j done (or empty): the next one, or the next pair's first
            if (++j == per) { j = 0; p++; q = 0; }
        }
    }
}

extern "C" __global__ void gather_bytes(const u64* table, long long pairs, long long per, u64 share) {
    // Balanced by bytes, not ranges: the batch's bytes are cut into shares of `share` bytes (a
    // multiple of 512); warp w copies shares w, w + warps, ... A warp per range left the last round
    // ragged (7,808 ranges of MLA 8K over 2,112 warps: 3.7 a warp, so the copy lasted 4 rounds).
    // The flat table is the shared one of one pair of bases 0 (pairs = 1).
    if (per <= 0) return;  // no range: no end to read
    const u64 pair_bytes = table[2 * pairs + 4 * per - 1];
    if (pair_bytes == 0) return;
    const u64 total = pair_bytes * (u64)pairs;
    const u64 warps = ((u64)gridDim.x * blockDim.x) >> 5;
    const u64 lane = threadIdx.x & 31;
    for (u64 start = (((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5) * share; start < total;
         start += warps * share) {
        copy_share(table, pairs, per, pair_bytes, start, total - start < share ? total - start : share, lane);
    }
}

extern "C" __global__ void gather_bytes_dynamic(unsigned long long* table, long long pairs, long long per,
                                                u64 share) {
    // gather_bytes with shares taken in turn: each warp takes the next share from a counter (the
    // table's last word, uploaded as 0) until none is left, so a warp whose stores retire slower
    // (an SM farther from the link) takes fewer shares instead of finishing last.
    if (per <= 0) return;
    const u64 pair_bytes = table[2 * pairs + 4 * per - 1];
    if (pair_bytes == 0) return;
    const u64 total = pair_bytes * (u64)pairs;
    unsigned long long* counter = table + 2 * pairs + 4 * per;
    const u64 lane = threadIdx.x & 31;
    for (;;) {
        unsigned long long next = 0;
        if (lane == 0) next = atomicAdd(counter, 1ULL);
        next = __shfl_sync(0xffffffffu, next, 0);  // the whole warp copies the share lane 0 took
        const u64 start = next * share;
        if (start >= total) return;
        copy_share(table, pairs, per, pair_bytes, start, total - start < share ? total - start : share, lane);
    }
}
"""


class GatherCopier:
    """Copies of one engine stream: the range table goes to the device and one kernel copies it.
    `variant` "dynamic" (the default, `gather_bytes_dynamic`: warps take shares of the batch's bytes
    from a counter until none is left), "bytes" (`gather_bytes`: each warp its equal shares) or "ranges" (a warp per range, `gather_copy` / `gather_copy_shared`, before session 22);
    `unroll`, `threads` and `share` (bytes a warp takes at a time; 0: the batch's bytes over the
    grid's warps, one share each) as GatherSetting says. Unset arguments: the environment's."""

    def __init__(self, device: int, variant: str = "", unroll: int = 0, threads: int = 0, share: int = -1):
        import cupy

        setting = gather_setting()
        self.variant = variant or setting.kernel
        self.unroll = unroll or setting.unroll
        self.threads = threads or setting.threads
        self.share = setting.share if share < 0 else share
        self.cupy = cupy
        self.device = device
        options = (f"-DUNROLL={self.unroll}",)
        with cupy.cuda.Device(device) as dev:
            self.kernel = cupy.RawKernel(_SOURCE, "gather_copy", options=options)
            self.kernel.compile()
            self.shared_kernel = cupy.RawKernel(_SOURCE, "gather_copy_shared", options=options)
            self.shared_kernel.compile()
            self.bytes_kernel = cupy.RawKernel(_SOURCE, "gather_bytes", options=options)
            self.bytes_kernel.compile()
            self.dynamic_kernel = cupy.RawKernel(_SOURCE, "gather_bytes_dynamic", options=options)
            self.dynamic_kernel.compile()
            sms = int(dev.attributes["MultiProcessorCount"])
        chosen = grid_blocks()
        self.blocks = chosen or GRID_BLOCKS  # within one GPU
        self.peer_blocks = chosen or PEER_BLOCKS_PER_SM * sms  # to another GPU
        self._streams: dict = {}  # stream handle -> its cupy ExternalStream (made once)
        self._free: dict = {}  # words of a size class -> [Staging] whose batch finished

    def copy(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: int, to_peer: bool = False):
        """Enqueue the copies on `stream`; returns what must outlive them (the table on the
        device and its pinned host copy), which the caller keeps until the batch's event fired."""
        if self.variant != "ranges":  # the flat table is the shared one of one pair at bases 0
            return self._copy_bytes(_ZERO, _ZERO, dsts, srcs, sizes, stream, to_peer)
        dsts, srcs, sizes = split_ranges(dsts, srcs, sizes)
        n = len(sizes)
        staging = self._staging(3 * n)
        host = staging.host[:3 * n]
        host[:n], host[n:2 * n], host[2 * n:] = dsts, srcs, sizes
        return self._launch(self.kernel, staging, 3 * n, n, (np.int64(n),), stream, to_peer)

    def copy_shared(self, dst_base: np.ndarray, src_base: np.ndarray, dst_off: np.ndarray, src_off: np.ndarray,
                    sizes: np.ndarray, stream: int, to_peer: bool = False):
        """`copy` of every pair i's ranges j: src_base[i] + src_off[j] -> dst_base[i] + dst_off[j],
        sizes[j] bytes (uint64 arrays), by `gather_copy_shared` from a table of the bases and the
        shared ranges (2 x pairs + 3 x ranges words, where the flat table is 3 x pairs x ranges:
        64 KB against 3 MB at 32K GQA tokens, built and uploaded on the way to the launch), or by
        `gather_bytes` from that table and the ranges' ends (2 x pairs + 4 x ranges words)."""
        if self.variant != "ranges":
            return self._copy_bytes(dst_base, src_base, dst_off, src_off, sizes, stream, to_peer)
        dst_off, src_off, sizes = split_ranges(dst_off, src_off, sizes)
        pairs, per = len(dst_base), len(sizes)
        words = 2 * pairs + 3 * per
        staging = self._staging(words)
        fill_compact_table(staging.host[:words], dst_base, src_base, dst_off, src_off, sizes)
        return self._launch(self.shared_kernel, staging, words, pairs * per, (np.int64(pairs), np.int64(per)),
                            stream, to_peer)

    def _copy_bytes(self, dst_base, src_base, dst_off, src_off, sizes, stream: int, to_peer: bool):
        """`gather_bytes` over the pairs' shared ranges: no range is split on the host (the shares
        cut them on the device); the launch needs as many warps as the batch has shares."""
        pairs, per = len(dst_base), len(sizes)
        words = 2 * pairs + 4 * per
        dynamic = self.variant == "dynamic"
        staging = self._staging(words + dynamic)  # dynamic: and the share counter, uploaded as 0
        pair_bytes = fill_bytes_table(staging.host[:words], dst_base, src_base, dst_off, src_off, sizes)
        if dynamic:
            staging.host[words] = 0
        total = pair_bytes * pairs
        share = self.share
        if not share:
            if dynamic:
                share = DYNAMIC_SHARE
            else:  # even_share, inline (a Python call less on the way to the launch)
                share = -(-total // ((self.peer_blocks if to_peer else self.blocks) * (self.threads // 32)))
                share = max(SHARE_ALIGN, -(-share // SHARE_ALIGN) * SHARE_ALIGN)
        shares = -(-total // share) or 1
        return self._launch(self.dynamic_kernel if dynamic else self.bytes_kernel, staging, words + dynamic, shares,
                            (np.int64(pairs), np.int64(per), np.uint64(share)), stream, to_peer)

    def _staging(self, words: int) -> "Staging":
        """A table's buffers for at least `words` uint64: one a finished batch gave back
        (`give_back`), else new ones of the size class (pinned_bytes), from CuPy's pools."""
        size = pinned_bytes(words * 8) // 8
        free = self._free.get(size)
        if free:
            try:
                return free.pop()
            except IndexError:  # emptied meanwhile (only give_back appends elsewhere): a new one
                pass
        pinned = self.cupy.cuda.alloc_pinned_memory(size * 8)
        return Staging(pinned, np.frombuffer(pinned, np.uint64, size))

    def give_back(self, staging) -> None:
        """`staging`'s batch finished (its event fired: no kernel or upload reads it any more):
        the next table of its class reuses its pinned and device buffers (issue 28: no pool
        allocation on the way to a launch). At most _FREE_PER_CLASS kept per class."""
        if type(staging) is not Staging:
            return
        free = self._free.setdefault(len(staging.host), [])
        if len(free) < _FREE_PER_CLASS:
            free.append(staging)

    def _launch(self, kernel, staging: "Staging", words: int, ranges: int, args: tuple, stream: int,
                to_peer: bool) -> "Staging":
        cupy = self.cupy
        blocks = self.peer_blocks if to_peer else self.blocks
        # one warp per range (or byte share): no idle block
        blocks = min(blocks, -(-ranges // (self.threads // 32)))
        with cupy.cuda.Device(self.device):
            s = self._streams.get(stream)
            if s is None:
                s = self._streams[stream] = cupy.cuda.ExternalStream(stream)
            with s:  # the kernel is launched on the current stream
                table = staging.table
                if table is None:  # the class's device buffer, made once per Staging
                    table = staging.table = cupy.empty(len(staging.host), dtype=cupy.uint64)
                # the table's words only, from pinned memory: asynchronous, ordered before the kernel
                table.data.copy_from_host_async(staging.host_ptr, words * 8, s)
                kernel((blocks,), (self.threads,), (table, *args))
        return staging


# Stagings kept per size class for reuse: a lone request needs one; a burst of requests in flight
# on one stream a few (a class with none free makes new buffers, as before).
_FREE_PER_CLASS = 8


class Staging:
    """A range table's pinned host buffer (`host`, uint64, a size class of pinned_bytes) and its
    device copy (`table`, made at the first launch), kept together so a later batch of the class
    reuses both, once the batch that used them finished (`GatherCopier.give_back`): what the
    kernel or the upload may still read is never handed out."""

    __slots__ = ("pinned", "host", "host_ptr", "table")

    def __init__(self, pinned, host: np.ndarray):
        self.pinned = pinned  # owns the pinned memory `host` views
        self.host = host
        self.host_ptr = ctypes.c_void_p(host.ctypes.data)  # what CuPy's copy_from_host_async takes
        self.table = None


def fill_compact_table(host: np.ndarray, dst_base: np.ndarray, src_base: np.ndarray, dst_off: np.ndarray,
                       src_off: np.ndarray, sizes: np.ndarray) -> None:
    """`gather_copy_shared`'s table in `host` (uint64, 2 x pairs + 3 x ranges words): the pairs'
    destination and source bases, then the ranges' destination offsets, source offsets, sizes."""
    pairs, per = len(dst_base), len(sizes)
    host[:pairs] = dst_base
    host[pairs:2 * pairs] = src_base
    rest = host[2 * pairs:]
    rest[:per], rest[per:2 * per], rest[2 * per:] = dst_off, src_off, sizes


def fill_bytes_table(host: np.ndarray, dst_base: np.ndarray, src_base: np.ndarray, dst_off: np.ndarray,
                     src_off: np.ndarray, sizes: np.ndarray) -> int:
    """`gather_bytes`'s table in `host` (uint64, 2 x pairs + 4 x ranges words): the compact table,
    then the ranges' running ends within a pair; returns a pair's bytes."""
    pairs, per = len(dst_base), len(sizes)
    host[:pairs] = dst_base
    host[pairs:2 * pairs] = src_base
    rest = host[2 * pairs:]
    rest[:per], rest[per:2 * per], rest[2 * per:3 * per] = dst_off, src_off, sizes
    if per == 0:
        return 0
    ends = rest[3 * per:4 * per]
    _accumulate(rest[2 * per:3 * per], out=ends)
    return int(ends[-1])


def even_share(total: int, warps: int) -> int:
    """Bytes each of `warps` warps takes of a batch of `total` bytes for one share each: rounded up
    to SHARE_ALIGN (a warp's 32 lanes x 16 bytes), at least that."""
    share = -(-total // max(1, warps))
    return max(SHARE_ALIGN, -(-share // SHARE_ALIGN) * SHARE_ALIGN)


def warp_pieces(ends: np.ndarray, pairs: int, share: int, warps: int, warp: int):
    """The pieces (pair, range, offset in the range, bytes) warp `warp` of `warps` copies in
    `gather_bytes`, in its order: the kernel's loop in Python, for the tests of its arithmetic
    (every byte once, no piece past its range's end)."""
    ends = [int(e) for e in ends]
    per = len(ends)
    pair_bytes = ends[-1] if per else 0
    total = pair_bytes * pairs
    out = []
    if pair_bytes == 0:
        return out
    start = warp * share
    while start < total:
        left = min(share, total - start)
        p, q = divmod(start, pair_bytes)
        j = next(i for i, e in enumerate(ends) if e > q)  # the kernel's binary search
        while left:
            end = ends[j]
            size = end - (ends[j - 1] if j else 0)
            off = q - (end - size)
            n = min(end - q, left)
            if n:
                out.append((p, j, off, n))
            left -= n
            q += n
            if q == end:
                j += 1
                if j == per:
                    j, p, q = 0, p + 1, 0
        start += warps * share
    return out


def pinned_bytes(nbytes: int) -> int:
    """The pinned staging buffer asked for a table of `nbytes`: the next power of two, at least
    MIN_PINNED_BYTES. CuPy's pinned pool gives a freed buffer back only for a request of its exact
    (512-byte rounded) size, and a plan's table length follows its pages' runs, so asking for the
    table's own size made a table of a length not seen before pay a fresh cudaHostAlloc (page
    locking, far slower than the table's copy) on the way to its launch; with classes, a handful of
    buffers serve every length, at most twice the bytes each."""
    return max(MIN_PINNED_BYTES, 1 << max(0, nbytes - 1).bit_length())


def split_ranges(dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, piece: int = PIECE_BYTES):
    """The same copies as (dsts, srcs, sizes), with every range longer than `piece` bytes cut into
    consecutive pieces of `piece` bytes (the last one shorter), in the original order. Unchanged
    (the same arrays) when no range is longer."""
    sizes = np.asarray(sizes, dtype=np.uint64)
    if len(sizes) == 0 or int(_umax(sizes)) <= piece:
        return dsts, srcs, sizes
    step = np.uint64(piece)
    counts = np.maximum((sizes + step - np.uint64(1)) // step, np.uint64(1)).astype(np.int64)
    owner = np.repeat(np.arange(len(sizes)), counts)
    first = np.cumsum(counts) - counts
    offset = (np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(first, counts)).astype(np.uint64) * step
    dsts = np.asarray(dsts, dtype=np.uint64)[owner] + offset
    srcs = np.asarray(srcs, dtype=np.uint64)[owner] + offset
    return dsts, srcs, np.minimum(sizes[owner] - offset, step)


def split_long(dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, threshold: int):
    """(long, short): the ranges of at least `threshold` bytes and the others, each as
    (dsts, srcs, sizes) uint64 arrays in their original order. threshold 0: none is long."""
    sizes = np.asarray(sizes, dtype=np.uint64)
    dsts = np.asarray(dsts, dtype=np.uint64)
    srcs = np.asarray(srcs, dtype=np.uint64)
    empty = np.empty(0, dtype=np.uint64)
    if threshold <= 0 or len(sizes) == 0 or int(sizes.max()) < threshold:
        return (empty, empty, empty), (dsts, srcs, sizes)
    is_long = sizes >= np.uint64(threshold)
    if is_long.all():
        return (dsts, srcs, sizes), (empty, empty, empty)
    short = ~is_long
    return (dsts[is_long], srcs[is_long], sizes[is_long]), (dsts[short], srcs[short], sizes[short])


def ce_min_bytes() -> int:
    """The smallest range the copy engines take instead of the kernel (SGLANG_MORI_SOFTIO_CE_MIN_BYTES;
    0: the kernel takes every range)."""
    raw = os.environ.get(CE_MIN_ENV, "").strip()
    if not raw:
        return CE_MIN_BYTES
    if not raw.isdigit():
        raise ValueError(f"{CE_MIN_ENV} must be a number of bytes (0: never), got {raw!r}")
    return int(raw)


class GatherSetting:
    """The gather kernel's knobs (GATHER_ENVS; docs/configuration.md): which kernel, its loads in
    flight per thread (UNROLL), threads per block, bytes a warp takes at a time (0: even shares)."""

    __slots__ = ("kernel", "unroll", "threads", "share")

    def __init__(self, kernel: str = "dynamic", unroll: int = UNROLL, threads: int = THREADS, share: int = 0):
        self.kernel, self.unroll, self.threads, self.share = kernel, unroll, threads, share


def gather_setting() -> GatherSetting:
    """GatherSetting from SGLANG_MORI_SOFTIO_GATHER_{KERNEL,UNROLL,THREADS,SHARE} (unset: defaults)."""
    kernel = os.environ.get(KERNEL_ENV, "").strip().lower() or "dynamic"
    if kernel not in ("bytes", "ranges", "dynamic"):
        raise ValueError(f"{KERNEL_ENV} must be 'bytes', 'dynamic' or 'ranges', got {kernel!r}")
    unroll = _env_int(UNROLL_ENV, UNROLL, lambda v: 1 <= v <= 32, "from 1 to 32")
    threads = _env_int(THREADS_ENV, THREADS, lambda v: v % 32 == 0 and 32 <= v <= 1024,
                       "a multiple of 32 from 32 to 1024")
    share = _env_int(SHARE_ENV, 0, lambda v: v == 0 or v % SHARE_ALIGN == 0, f"0 or a multiple of {SHARE_ALIGN}")
    return GatherSetting(kernel, unroll, threads, share)


def _env_int(name: str, default: int, ok, what: str) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    if not raw.isdigit() or not ok(int(raw)):
        raise ValueError(f"{name} must be {what}, got {raw!r}")
    return int(raw)


def grid_blocks() -> int:
    """The grid SGLANG_MORI_SOFTIO_GATHER_BLOCKS sets, or 0 (the defaults)."""
    raw = os.environ.get(BLOCKS_ENV, "").strip()
    if not raw:
        return 0
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{BLOCKS_ENV} must be a positive number of thread blocks, got {raw!r}")
    return int(raw)


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
