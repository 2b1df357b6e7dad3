"""Byte checks of softio's gather kernels on a GPU (CuPy), shared by test_gather_kernel.py and the
session-22 sweep (gather_sweep.py): random tables of odd sizes, unaligned and long ranges and empty
ones, through both table forms (`copy`, `copy_shared`), and the rig's paged shapes (pages shuffled
on both sides); every destination byte is compared, those no range covers included (still zero)."""

from __future__ import annotations

import numpy as np


def enable_peer(cupy, src: int, dst: int) -> None:
    if src == dst:
        return
    with cupy.cuda.Device(src):
        try:
            cupy.cuda.runtime.deviceEnablePeerAccess(dst)
        except cupy.cuda.runtime.CUDARuntimeError:
            pass  # already enabled


def odd_ranges(rng, count: int, long_bytes: int = 3 * (1 << 20) + 5):
    """(dst offsets, src offsets, sizes, dst bytes, src bytes): `count` disjoint ranges laid out
    one after another in random gaps; sizes odd, multiples of 16, empty, or long (> 1 piece)."""
    kinds = rng.integers(0, 5, count)
    sizes = np.where(kinds == 0, rng.integers(1, 200, count),
                     np.where(kinds == 1, 16 * rng.integers(1, 6000, count),
                              np.where(kinds == 2, 0, np.where(kinds == 3, rng.integers(1, 90000, count),
                                                               long_bytes))))
    # gaps: some keep both sides at the same offset within 16 bytes (the 16-byte path), some not
    dgap = 16 * rng.integers(0, 40, count) + rng.integers(0, 16, count) * (rng.random(count) < 0.3)
    sgap = 16 * rng.integers(0, 40, count) + rng.integers(0, 16, count) * (rng.random(count) < 0.3)
    order = rng.permutation(count)  # destinations in another order than the sources
    dst_off = np.zeros(count, dtype=np.int64)
    d = 0
    for i in order:
        d += int(dgap[i])
        dst_off[i] = d
        d += int(sizes[i])
    src_off = np.cumsum(sgap + sizes) - sizes
    return (dst_off.astype(np.uint64), src_off.astype(np.uint64), sizes.astype(np.uint64), d + 64,
            int(src_off[-1] + sizes[-1]) + 64)


def expected(src_host: np.ndarray, dst_len: int, dst_off, src_off, sizes) -> np.ndarray:
    out = np.zeros(dst_len, dtype=np.uint8)
    for d, s, n in zip(dst_off.tolist(), src_off.tolist(), sizes.tolist()):
        out[d:d + n] = src_host[s:s + n]
    return out


def check_odd(cupy, copier, src_dev: int, dst_dev: int, seed: int, shared: bool, pairs: int = 3,
              count: int = 40) -> None:
    """Random odd ranges copied src_dev -> dst_dev by `copier` (flat: `copy` of every pair's
    ranges; shared: one `copy_shared`); raises AssertionError on the first wrong byte."""
    rng = np.random.default_rng(seed)
    dst_off, src_off, sizes, dst_len, src_len = odd_ranges(rng, count)
    with cupy.cuda.Device(src_dev):
        src = cupy.asarray(rng.integers(0, 256, pairs * src_len, dtype=np.uint8))
        stream = cupy.cuda.Stream(non_blocking=True)
        # CuPy uploads through pinned memory, asynchronously on the legacy stream, which a
        # non-blocking stream does not wait for: without this the kernel could read the source
        # before its bytes arrived (the first device call's "wrong bytes" in every kernel, main's too)
        cupy.cuda.Device(src_dev).synchronize()
    with cupy.cuda.Device(dst_dev):
        dst = cupy.zeros(pairs * dst_len, dtype=cupy.uint8)
        cupy.cuda.Device(dst_dev).synchronize()
    # bases: pair i at i x len, shifted by a few bytes so that a pair's base is not 16-aligned either
    shift = np.uint64(1) if seed % 2 else np.uint64(0)
    db = np.arange(pairs, dtype=np.uint64) * np.uint64(dst_len) + np.uint64(dst.data.ptr)
    sb = np.arange(pairs, dtype=np.uint64) * np.uint64(src_len) + np.uint64(src.data.ptr) + shift
    with cupy.cuda.Device(src_dev):
        if shared:
            keep = [copier.copy_shared(db, sb, dst_off, src_off, sizes, stream.ptr, src_dev != dst_dev)]
        else:
            keep = [copier.copy(db[i] + dst_off, sb[i] + src_off, sizes, stream.ptr, src_dev != dst_dev)
                    for i in range(pairs)]
        stream.synchronize()
    del keep
    src_host = cupy.asnumpy(src)
    want = np.concatenate([expected(src_host[i * src_len + int(shift):], dst_len, dst_off, src_off, sizes)
                           for i in range(pairs)])
    got = cupy.asnumpy(dst)
    if not np.array_equal(got, want):
        bad = np.flatnonzero(got != want)
        raise AssertionError(f"{'shared' if shared else 'flat'} seed {seed}: {len(bad)} wrong bytes, first at {bad[0]}")


class PagedShape:
    """A paged KV transfer as the link rig makes it: `pairs` buffers (layers), `pages` pages of
    `item` bytes each, taken from pools of `pool` pages in shuffled order on both sides."""

    def __init__(self, cupy, name: str, pairs: int, pages: int, item: int, src_dev: int, dst_dev: int, seed=0):
        self.cupy, self.name, self.pairs, self.pages, self.item = cupy, name, pairs, pages, item
        self.src_dev, self.dst_dev = src_dev, dst_dev
        rng = np.random.default_rng(seed)
        self.pool = pages + 16
        self.src_pages = rng.permutation(self.pool)[:pages]
        self.dst_pages = rng.permutation(self.pool)[:pages]
        with cupy.cuda.Device(src_dev):
            self.src = cupy.random.randint(0, 256, pairs * self.pool * item, dtype=cupy.uint8)
            self.stream = cupy.cuda.Stream(non_blocking=True)
            cupy.cuda.Device(src_dev).synchronize()  # the source written before any copy reads it
        with cupy.cuda.Device(dst_dev):
            self.dst = cupy.zeros(pairs * self.pool * item, dtype=cupy.uint8)
        region = np.uint64(self.pool * item)
        self.dst_base = np.arange(pairs, dtype=np.uint64) * region + np.uint64(self.dst.data.ptr)
        self.src_base = np.arange(pairs, dtype=np.uint64) * region + np.uint64(self.src.data.ptr)
        self.dst_off = self.dst_pages.astype(np.uint64) * np.uint64(item)
        self.src_off = self.src_pages.astype(np.uint64) * np.uint64(item)
        self.sizes = np.full(pages, item, dtype=np.uint64)
        self.nbytes = pairs * pages * item

    def post(self, copier):
        return copier.copy_shared(self.dst_base, self.src_base, self.dst_off, self.src_off, self.sizes,
                                  self.stream.ptr, self.src_dev != self.dst_dev)

    def check(self, copier) -> None:
        """Zero the destination, copy once, compare every destination byte on the destination GPU."""
        cupy = self.cupy
        with cupy.cuda.Device(self.dst_dev):
            self.dst.fill(0)
            cupy.cuda.Device(self.dst_dev).synchronize()
        with cupy.cuda.Device(self.src_dev):
            keep = self.post(copier)
            self.stream.synchronize()
            moved = self.src.reshape(self.pairs, self.pool, self.item)[:, cupy.asarray(self.src_pages)]
        with cupy.cuda.Device(self.dst_dev):
            want = cupy.zeros((self.pairs, self.pool, self.item), dtype=cupy.uint8)
            want[:, cupy.asarray(self.dst_pages)] = moved.copy()  # copy(): onto this GPU
            ok = bool(cupy.array_equal(self.dst.reshape(want.shape), want))
            del want
        del keep, moved
        if not ok:
            raise AssertionError(f"{self.name}: destination bytes differ")

    def free(self):
        self.src = self.dst = None
