"""Session 22's byte-balanced gather kernel (`gather_bytes`): warps take equal shares of a batch's
bytes instead of one range each. Checked on the CPU: the kernel source itself, built for the host
(gather_host.py: the grid run thread by thread) and launched through GatherCopier's own table fill
and launch geometry (a stand-in CuPy whose upload copies the pinned words and whose launch runs the
host build), must copy exactly the bytes of random tables of odd, unaligned, empty and long ranges,
through both table forms, at grids from one block to many; its share arithmetic (warp_pieces,
the kernel's loop in Python) covers every byte once with no piece past its range's end."""

import ctypes
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gather_host  # noqa: E402
from sglang_mori.softio import device_gather  # noqa: E402
from sglang_mori.softio.device_gather import (  # noqa: E402
    SHARE_ALIGN, GatherCopier, even_share, fill_bytes_table, gather_setting, warp_pieces)

LIB = gather_host.build()
needs_cxx = pytest.mark.skipif(LIB is None, reason="no C++ compiler to build the kernel source for the CPU")


class HostCupy:
    """What GatherCopier calls of CuPy: device arrays are host arrays, the upload a memmove of the
    pinned words, a launch the kernel source run on the CPU over its whole grid."""

    def __init__(self):
        self.launches = []
        outer = self

        class Ctx:
            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

        class Mem:
            def __init__(self, arr):
                self.arr = arr

            def copy_from_host_async(self, mem, size, stream=None):
                ctypes.memmove(self.arr.ctypes.data, mem.value, size)

        class DeviceArray:
            def __init__(self, n, dtype=None):
                self.arr = np.full(n, 0xDEAD, dtype=np.uint64)  # stale words beyond the upload
                self.data = Mem(self.arr)

        self.uint64 = np.uint64
        self.empty = DeviceArray
        self.cuda = SimpleNamespace(Device=lambda d: Ctx(), ExternalStream=lambda s: Ctx(),
                                    alloc_pinned_memory=lambda n: bytearray(n))

        def kernel_of(run):
            def launch(grid, block, args):
                outer.launches.append((run, grid[0], block[0], [int(a) for a in args[1:]]))
                getattr(LIB, run)(grid[0], block[0], args[0].arr.ctypes.data, *(int(a) for a in args[1:]))
            return launch

        self.kernels = {k: kernel_of(k) for k in ("run_ranges", "run_shared", "run_bytes", "run_dynamic")}


def host_copier(variant="bytes", blocks=3, threads=64, share=0):
    cupy = HostCupy()
    c = object.__new__(GatherCopier)
    c.__dict__.update(cupy=cupy, device=0, threads=threads, blocks=blocks, peer_blocks=blocks, _streams={},
                      _free={}, variant=variant, unroll=8, share=share, kernel=cupy.kernels["run_ranges"],
                      shared_kernel=cupy.kernels["run_shared"], bytes_kernel=cupy.kernels["run_bytes"],
                      dynamic_kernel=cupy.kernels["run_dynamic"])
    return c, cupy


def buffers(ranges, pairs):
    """Source filled with random bytes and a zeroed destination for `pairs` copies of `ranges`
    ((dst, src, size) offsets), and the destination the copies must leave."""
    dst_len = max([d + n for d, _, n in ranges] + [1]) + 40
    src_len = max([s + n for _, s, n in ranges] + [1]) + 40
    rng = np.random.default_rng(len(ranges) * 7 + pairs)
    src = rng.integers(0, 256, pairs * src_len, dtype=np.uint8)
    dst = np.zeros(pairs * dst_len, dtype=np.uint8)
    want = np.zeros_like(dst)
    for p in range(pairs):
        for d, s, n in ranges:
            want[p * dst_len + d:p * dst_len + d + n] = src[p * src_len + s:p * src_len + s + n]
    return src, dst, want, src_len, dst_len


def disjoint(spans):
    """(dst, src, size) ranges from (size, dst gap, src gap) spans: destinations laid out in reverse
    order, so the table is not sorted by destination; gaps of any byte count (unaligned offsets)."""
    out, s = [], 0
    for size, _, sgap in spans:
        out.append([0, s + sgap, size])
        s += sgap + size
    d = 0
    for r, (size, dgap, _) in zip(reversed(out), reversed(spans)):
        r[0] = d + dgap
        d += dgap + size
    return [tuple(r) for r in out]


def u64(values):
    return np.array(values, dtype=np.uint64)


def run_copy(copier, ranges, pairs, shared, base_shift=0):
    src, dst, want, src_len, dst_len = buffers(ranges, pairs)
    d_off = u64([r[0] for r in ranges])
    s_off = u64([r[1] for r in ranges])
    sizes = u64([r[2] for r in ranges])
    db = u64([dst.ctypes.data + p * dst_len for p in range(pairs)])
    sb = u64([src.ctypes.data + p * src_len + base_shift for p in range(pairs)])
    if base_shift:
        want = np.zeros_like(dst)
        for p in range(pairs):
            for d, s, n in ranges:
                o = p * src_len + base_shift + s
                want[p * dst_len + d:p * dst_len + d + n] = src[o:o + n]
    if shared:
        copier.copy_shared(db, sb, d_off, s_off, sizes, 0, True)
    else:
        for p in range(pairs):
            copier.copy(db[p] + d_off, sb[p] + s_off, sizes, 0, True)
    return dst, want


SPANS = st.lists(st.tuples(st.one_of(st.integers(0, 70), st.integers(0, 3000), st.sampled_from([0, 16, 4096, 73728])),
                           st.integers(0, 40), st.integers(0, 40)), min_size=1, max_size=7)


@needs_cxx
@settings(max_examples=40, deadline=None)
@given(SPANS, st.integers(1, 3), st.booleans(), st.sampled_from([(1, 32), (3, 64), (8, 128)]),
       st.sampled_from([0, 512, 1024]), st.integers(0, 1))
def test_the_bytes_kernel_copies_exactly_the_tables_bytes(spans, pairs, shared, grid, share, shift):
    copier, cupy = host_copier("bytes", blocks=grid[0], threads=grid[1], share=share)
    dst, want = run_copy(copier, disjoint(spans), pairs, shared, base_shift=shift)
    assert np.array_equal(dst, want)
    assert {launch[0] for launch in cupy.launches} <= {"run_bytes"}


@needs_cxx
@settings(max_examples=25, deadline=None)
@given(SPANS, st.integers(1, 3), st.booleans(), st.sampled_from([(1, 32), (3, 64)]), st.sampled_from([0, 512, 1024]))
def test_the_dynamic_kernel_copies_exactly_the_tables_bytes(spans, pairs, shared, grid, share):
    copier, cupy = host_copier("dynamic", blocks=grid[0], threads=grid[1], share=share)
    dst, want = run_copy(copier, disjoint(spans), pairs, shared, base_shift=1)
    assert np.array_equal(dst, want)
    assert {launch[0] for launch in cupy.launches} <= {"run_dynamic"}


@needs_cxx
@settings(max_examples=15, deadline=None)
@given(SPANS, st.integers(1, 3), st.booleans())
def test_the_ranges_kernels_copy_the_same_bytes(spans, pairs, shared):
    copier, _ = host_copier("ranges", blocks=2, threads=64)
    dst, want = run_copy(copier, disjoint(spans), pairs, shared)
    assert np.array_equal(dst, want)


@needs_cxx
@pytest.mark.parametrize("shared", [False, True])
def test_a_long_range_is_shared_by_many_warps_byte_exact(shared):
    # 300 KB and 1 MiB + 3: one range cut into shares of many warps (no host split any more)
    copier, cupy = host_copier("bytes", blocks=4, threads=128)
    ranges = [(5, 3, 300_000), (300_016, 400_000, (1 << 20) + 3)]
    dst, want = run_copy(copier, ranges, 2, shared)
    assert np.array_equal(dst, want)
    run, blocks, threads, args = cupy.launches[0]
    if shared:
        assert args[:2] == [2, 2]  # two pairs, the two ranges uncut: the table did not grow
    assert args[-1] % SHARE_ALIGN == 0 and blocks == 4


@needs_cxx
def test_an_mla_page_table_fills_every_warp_once():
    """MLA 8K's 61 x 128 pages of 72 KiB at 132 blocks of 512 threads: one even share a warp, no
    warp left with a second round (the ragged 4th round of a warp per range)."""
    copier, cupy = host_copier("bytes", blocks=132, threads=512)
    base = np.arange(61, dtype=np.uint64) << np.uint64(40)
    off = np.arange(128, dtype=np.uint64) * np.uint64(73728)
    copier._launch = lambda kernel, staging, words, ranges, args, stream, to_peer: (words, ranges, args)
    words, shares, args = copier.copy_shared(base, base + np.uint64(1 << 39), off, off, np.full(128, 73728), 0, True)
    total = 61 * 128 * 73728
    share = int(args[2])
    assert words == 2 * 61 + 4 * 128 and shares == -(-total // share) <= 132 * 16
    assert share % SHARE_ALIGN == 0 and share * 132 * 16 - total < 132 * 16 * SHARE_ALIGN


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, 5000), min_size=1, max_size=9), st.integers(1, 4), st.integers(1, 40),
       st.sampled_from([512, 1024, 4096]))
def test_warp_shares_cover_every_byte_once_within_ranges(sizes, pairs, warps, share):
    ends = np.cumsum(sizes)
    seen = {}
    for w in range(warps):
        for p, j, off, n in warp_pieces(ends, pairs, share, warps, w):
            assert 0 < n and off + n <= sizes[j]  # never past the range's end
            for b in range(off, off + n):
                key = (p, j, b)
                assert key not in seen
                seen[key] = w
    assert len(seen) == pairs * sum(sizes)


@given(st.integers(0, 1 << 36), st.integers(1, 5000))
def test_even_shares_are_aligned_and_need_no_more_warps_than_given(total, warps):
    share = even_share(total, warps)
    assert share % SHARE_ALIGN == 0 and share >= SHARE_ALIGN
    assert -(-total // share) <= warps


def test_the_bytes_table_appends_each_ranges_running_end():
    host = np.zeros(2 * 2 + 4 * 3, dtype=np.uint64)
    pair_bytes = fill_bytes_table(host, u64([1, 2]), u64([3, 4]), u64([0, 100, 50]), u64([7, 8, 9]),
                                  np.array([10, 0, 5], dtype=np.int64))
    assert pair_bytes == 15
    assert host.tolist() == [1, 2, 3, 4, 0, 100, 50, 7, 8, 9, 10, 0, 5, 10, 10, 15]


def test_settings_come_from_the_environment_and_bad_ones_are_refused(monkeypatch):
    s = gather_setting()
    assert (s.kernel, s.unroll, s.threads, s.share) == ("dynamic", device_gather.UNROLL, device_gather.THREADS, 0)
    monkeypatch.setenv(device_gather.KERNEL_ENV, "ranges")
    monkeypatch.setenv(device_gather.UNROLL_ENV, "16")
    monkeypatch.setenv(device_gather.THREADS_ENV, "256")
    monkeypatch.setenv(device_gather.SHARE_ENV, "32768")
    s = gather_setting()
    assert (s.kernel, s.unroll, s.threads, s.share) == ("ranges", 16, 256, 32768)
    monkeypatch.setenv(device_gather.KERNEL_ENV, "bytes")
    assert gather_setting().kernel == "bytes"
    for env, bad in ((device_gather.KERNEL_ENV, "warp"), (device_gather.UNROLL_ENV, "0"),
                     (device_gather.THREADS_ENV, "100"), (device_gather.SHARE_ENV, "1000")):
        monkeypatch.setenv(env, bad)
        with pytest.raises(ValueError, match=env):
            gather_setting()
        monkeypatch.delenv(env)


@needs_cxx
def test_a_batch_of_no_ranges_or_no_bytes_copies_nothing():
    copier, cupy = host_copier("bytes", blocks=2, threads=64)
    dst, want = run_copy(copier, [(0, 0, 0), (16, 8, 0)], 2, True)
    assert np.array_equal(dst, want) and not dst.any()
    copier.copy_shared(u64([dst.ctypes.data]), u64([dst.ctypes.data]), u64([]), u64([]), u64([]), 0, True)
    assert cupy.launches[-1][3][:2] == [1, 0]  # launched on an empty table: the kernel returns at once
