"""Vectorised range building blocks: runs, merging, splitting, bounds."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from sglang_mori.planning import (
    BufferTransfer,
    PlanError,
    TransferPlan,
    contiguous_item_ranges,
    index_runs,
    merge_adjacent_ranges,
    split_large_ranges,
)
from sglang_mori.planning.ranges import as_index_array, check_in_range
from harness.plan_ranges import ranges

FAST = settings(max_examples=60, deadline=None)


def count_runs_by_hand(src, dst):
    """Reference: walk the pairs, start a new run whenever either side does not step by one."""
    runs = 0
    for k in range(len(src)):
        if k == 0 or src[k] != src[k - 1] + 1 or dst[k] != dst[k - 1] + 1:
            runs += 1
    return runs


def apply(local_offsets, remote_offsets, sizes, src_bytes, dst_bytes):
    for lo, ro, sz in zip(local_offsets.tolist(), remote_offsets.tolist(), sizes.tolist()):
        dst_bytes[ro : ro + sz] = src_bytes[lo : lo + sz]


page_pairs = st.integers(0, 40).flatmap(
    lambda n: st.tuples(
        st.lists(st.integers(0, 63), min_size=n, max_size=n, unique=True),
        st.lists(st.integers(0, 63), min_size=n, max_size=n, unique=True),
    )
)


@FAST
@given(pairs=page_pairs, item_len=st.sampled_from([1, 3, 16, 96]), seed=st.integers(0, 2**32 - 1))
def test_item_ranges_copy_exact_bytes_with_one_range_per_maximal_run(pairs, item_len, seed):
    src_pages, dst_pages = (np.array(p, dtype=np.int64) for p in pairs)
    rng = np.random.default_rng(seed)
    src_bytes = rng.integers(0, 256, 64 * item_len, dtype=np.uint8)
    dst_bytes = np.zeros(64 * item_len, dtype=np.uint8)
    expected = np.zeros_like(dst_bytes)
    for s, d in zip(pairs[0], pairs[1]):  # reference: one item at a time
        expected[d * item_len : (d + 1) * item_len] = src_bytes[s * item_len : (s + 1) * item_len]

    lo, ro, sz = contiguous_item_ranges(src_pages, dst_pages, item_len)
    apply(lo, ro, sz, src_bytes, dst_bytes)

    assert np.array_equal(dst_bytes, expected)
    assert sz.size == count_runs_by_hand(pairs[0], pairs[1])
    assert int(sz.sum()) == len(pairs[0]) * item_len


def test_runs_need_both_sides_contiguous():
    src = np.array([4, 5, 6, 7, 9])
    dst = np.array([0, 1, 5, 6, 7])
    starts_src, starts_dst, lengths = index_runs(src, dst)
    assert starts_src.tolist() == [4, 6, 9]
    assert starts_dst.tolist() == [0, 5, 7]
    assert lengths.tolist() == [2, 2, 1]


def test_descending_pages_are_not_merged():
    lo, ro, sz = contiguous_item_ranges(np.array([3, 2, 1]), np.array([3, 2, 1]), 10)
    assert sz.tolist() == [10, 10, 10]


def test_merge_adjacent_ranges_merges_only_when_both_sides_continue():
    local = np.array([0, 10, 30, 40])
    remote = np.array([100, 110, 120, 200])
    sizes = np.array([10, 10, 10, 10])
    lo, ro, sz = merge_adjacent_ranges(local, remote, sizes)
    assert lo.tolist() == [0, 30, 40]
    assert ro.tolist() == [100, 120, 200]
    assert sz.tolist() == [20, 10, 10]


@FAST
@given(
    sizes=st.lists(st.integers(1, 5000), min_size=1, max_size=20),
    max_bytes=st.integers(1, 1000),
    unit=st.sampled_from([1, 7, 64, 2000]),
)
def test_split_large_ranges_covers_the_same_bytes(sizes, max_bytes, unit):
    sizes = np.array(sizes, dtype=np.int64)
    local = np.cumsum(np.concatenate(([0], sizes[:-1]))) * 3  # gaps between ranges
    remote = local + 11
    lo, ro, sz = split_large_ranges(local, remote, sizes, unit=unit, max_bytes=max_bytes)
    assert int(sz.max()) <= max_bytes
    assert (sz > 0).all()
    covered_local = np.concatenate([np.arange(a, a + n) for a, n in zip(lo, sz)])
    expected_local = np.concatenate([np.arange(a, a + n) for a, n in zip(local, sizes)])
    assert np.array_equal(covered_local, expected_local)
    assert np.array_equal(ro - lo, np.full(lo.size, 11))
    if unit <= max_bytes:  # whole units per piece, except a range's tail
        cut_pieces = sz[:-1][(lo[1:] == lo[:-1] + sz[:-1])]
        assert (cut_pieces % unit == 0).all()


def test_item_ranges_split_above_the_range_cap():
    lo, ro, sz = split_large_ranges(
        np.array([0]), np.array([0]), np.array([10 * 96]), unit=96, max_bytes=300
    )
    assert sz.tolist() == [288, 288, 288, 96]
    assert lo.tolist() == [0, 288, 576, 864]


def test_check_in_range_names_buffer_index_and_limit():
    with pytest.raises(PlanError, match=r"decode KV buffer 7: page index 12 out of range \(limit 12"):
        check_in_range(np.array([0, 12]), [20, 12], ["decode KV buffer 3", "decode KV buffer 7"], "page")
    with pytest.raises(PlanError, match="index -1 is negative"):
        check_in_range(np.array([-1, 2]), [20], ["prefill KV buffer 0"], "page")
    check_in_range(np.array([0, 11]), [12, 20], ["a", "b"], "page")  # in range: no error


def test_index_arrays_are_validated():
    with pytest.raises(PlanError, match="must be integers"):
        as_index_array(np.array([1.0, 2.0]), "pages")
    with pytest.raises(PlanError, match="1-D"):
        as_index_array(np.zeros((2, 2), dtype=np.int32), "pages")
    assert as_index_array(np.array([1, 2], dtype=np.int32), "pages").dtype == np.int64
    assert as_index_array([], "pages").size == 0


def test_transfer_plan_totals_skip_empty_and_share_converted_lists():
    shared = np.array([0, 100], dtype=np.int64)
    sizes = np.array([10, 20], dtype=np.int64)
    plan = TransferPlan(
        "kv",
        (
            BufferTransfer(0, 0, shared, shared, sizes),
            BufferTransfer(1, 5, shared, shared + 1, sizes),
            BufferTransfer(2, 2, np.zeros(0), np.zeros(0), np.zeros(0)),
        ),
    )
    assert len(plan) == 2 and plan.num_ranges == 4 and plan.total_bytes == 60
    args = plan.as_batch_args()
    assert args.local_indices == [0, 1] and args.remote_indices == [0, 5]
    assert args.remote_offsets == [[0, 100], [1, 101]]
    assert args.local_offsets[0] is args.local_offsets[1]  # one conversion for a shared array
    assert ranges(plan.transfers[0]) == ([0, 100], [0, 100], [10, 20])
    with pytest.raises(ValueError):
        plan.transfers[0].sizes[0] = 1  # plans are read-only: arrays are shared between layers
    assert shared.flags.writeable  # ...without freezing the caller's own array
    assert TransferPlan("kv").empty
