"""softio's gather kernel copies one table entry per warp; split_ranges cuts long ranges so that a
plan of few long runs (SGLang's page size 1) is shared by many warps. These tests replay both tables
on host memory: the split one must move exactly the bytes the original does."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from types import SimpleNamespace

from sglang_mori.softio.device_gather import MIN_PINNED_BYTES, PIECE_BYTES, GatherCopier, pinned_bytes, split_ranges


def replay(dsts, srcs, sizes, src_buf: bytes, dst_len: int) -> bytes:
    out = bytearray(dst_len)
    for d, s, n in zip(dsts.tolist(), srcs.tolist(), sizes.tolist()):
        out[d:d + n] = src_buf[s:s + n]
    return bytes(out)


def table(ranges):
    cols = np.array(ranges, dtype=np.uint64).reshape(-1, 3)
    return cols[:, 0].copy(), cols[:, 1].copy(), cols[:, 2].copy()


def test_a_long_run_is_cut_into_pieces_in_order():
    mib16 = 16 << 20
    dsts, srcs, sizes = split_ranges(*table([(4096, 0, mib16)]))
    assert len(sizes) == mib16 // PIECE_BYTES
    assert sizes.tolist() == [PIECE_BYTES] * len(sizes)
    assert dsts.tolist() == [4096 + i * PIECE_BYTES for i in range(len(sizes))]
    assert srcs.tolist() == [i * PIECE_BYTES for i in range(len(sizes))]


def test_short_ranges_pass_through_unchanged():
    original = table([(0, 64, 73728), (100000, 0, 4096), (200000, 9, 0)])
    assert all(a is b for a, b in zip(split_ranges(*original)[:2], original[:2]))
    assert split_ranges(*original)[2].tolist() == original[2].tolist()


def test_pieces_of_an_aligned_range_stay_aligned_and_the_tail_is_shorter():
    dsts, srcs, sizes = split_ranges(*table([(16, 32, 2 * PIECE_BYTES + 48)]))
    assert sizes.tolist() == [PIECE_BYTES, PIECE_BYTES, 48]
    assert all(int(x) % 16 == 0 for x in np.concatenate([dsts, srcs, sizes]))


def test_empty_table():
    d, s, n = split_ranges(*table([]))
    assert len(n) == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3 * PIECE_BYTES + 17), st.integers(0, 64)), min_size=1, max_size=6),
       st.sampled_from([16, 4096, PIECE_BYTES]))
def test_the_split_table_moves_exactly_the_same_bytes(spans, piece):
    # disjoint destination and source ranges laid out one after another, some long, some empty
    ranges, d, s = [], 0, 0
    for size, gap in spans:
        ranges.append((d + gap, s + gap, size))
        d, s = d + gap + size, s + 2 * gap + size
    src = np.random.default_rng(len(ranges)).integers(0, 256, s + 1, dtype=np.uint8).tobytes()
    original = table(ranges)
    split = split_ranges(*original, piece=piece)
    assert int(split[2].sum()) == int(original[2].sum())
    assert int(split[2].max()) <= max(piece, 0) or int(original[2].max()) == 0
    assert replay(*split, src, d + 1) == replay(*original, src, d + 1)


def test_mismatched_dtypes_do_not_turn_into_floats():
    dsts, srcs, sizes = split_ranges(np.array([2**40], dtype=np.int64), np.array([2**41], dtype=np.int64),
                                     np.array([3 * PIECE_BYTES], dtype=np.int64))
    assert dsts.dtype == srcs.dtype == sizes.dtype == np.uint64
    assert dsts.tolist() == [2**40 + i * PIECE_BYTES for i in range(3)]


if __name__ == "__main__":
    pytest.main([__file__])


@given(st.integers(0, 1 << 34))
def test_a_pinned_class_holds_the_table_in_at_most_twice_its_bytes(nbytes):
    size = pinned_bytes(nbytes)
    assert size >= nbytes and size & (size - 1) == 0 and size >= MIN_PINNED_BYTES
    assert size < 2 * max(nbytes, MIN_PINNED_BYTES)


def _recording_copier(asked: list):
    def alloc_pinned_memory(nbytes):
        asked.append(nbytes)
        return bytearray(nbytes)

    copier = object.__new__(GatherCopier)
    copier.cupy = SimpleNamespace(cuda=SimpleNamespace(alloc_pinned_memory=alloc_pinned_memory))
    copier.kernel, copier.shared_kernel, copier.bytes_kernel = "flat", "shared", "bytes"
    copier.variant = "ranges"  # these tests check the split tables of the warp-per-range kernels
    copier._free = {}
    copier._launch = lambda kernel, staging, words, ranges, args, stream, to_peer: (
        kernel, staging.host[:words].copy(), ranges, args)
    return copier


def test_tables_of_nearby_lengths_ask_the_pinned_pool_for_one_size():
    """CuPy's pool reuses a freed pinned buffer only for the same request size: tables whose
    lengths differ by a few ranges must ask for the same one."""
    asked = []
    copier = _recording_copier(asked)
    for n in (7320, 7503, 7808):  # a 61-layer chunk of 128 pages, its runs merged differently
        ranges = np.arange(n, dtype=np.uint64) * np.uint64(1 << 20)
        kernel, host, count, args = copier.copy(ranges, ranges + np.uint64(7), ranges * 0 + np.uint64(4096), 0)
        assert kernel == "flat" and count == n and len(host) == 3 * n
    assert len(set(asked)) == 1 and asked[0] >= 3 * 8 * 7808


def test_a_shared_batch_launches_the_shared_kernel_on_its_compact_table():
    copier = _recording_copier([])
    base = np.arange(61, dtype=np.uint64) << np.uint64(32)
    offsets = np.arange(128, dtype=np.uint64) * np.uint64(73728)
    kernel, host, count, args = copier.copy_shared(base, base + np.uint64(7), offsets, offsets + np.uint64(8),
                                                   offsets * 0 + np.uint64(73728), 0)
    assert kernel == "shared" and count == 61 * 128 and [int(a) for a in args] == [61, 128]
    assert len(host) == 2 * 61 + 3 * 128  # not 3 x 61 x 128
    assert host[:61].tolist() == base.tolist() and host[61:122].tolist() == (base + np.uint64(7)).tolist()
    assert host[122:250].tolist() == offsets.tolist() and host[250:378].tolist() == (offsets + np.uint64(8)).tolist()


def test_a_shared_batch_splits_its_long_ranges_once_for_every_pair():
    copier = _recording_copier([])
    kernel, host, count, args = copier.copy_shared(u64([0, 1 << 40]), u64([1 << 41, 1 << 42]), u64([0]), u64([64]),
                                                   u64([PIECE_BYTES * 2 + 16]), 0)
    assert [int(a) for a in args] == [2, 3] and count == 6
    per = host[4:]
    assert per[:3].tolist() == [0, PIECE_BYTES, 2 * PIECE_BYTES]
    assert per[3:6].tolist() == [64, 64 + PIECE_BYTES, 64 + 2 * PIECE_BYTES]
    assert per[6:].tolist() == [PIECE_BYTES, PIECE_BYTES, 16]


def u64(values):
    return np.array(values, dtype=np.uint64)
