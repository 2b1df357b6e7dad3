"""TransferPlanner.plan_kv_columns: the columns of one engine call over every KV buffer pair.

Each case applies the columns to real byte buffers and compares with a page-by-page copy, so a
wrong offset, a pair in the wrong order or a range that spills into the next page shows up as
wrong bytes. Edge cases: several buffers of different item lengths (GQA's K and V, MLA's layers),
an empty chunk, a single page, the last page of a buffer, runs of neighbouring pages merged,
indices out of range or unpaired, and the arrays' read-only sharing across pairs.
"""

import numpy as np
import pytest

from sglang_mori.planning import KVLayout, PlanError, TransferPlanner

PAGES = 12


def layout(item_lens, is_mla=True, page_size=16):
    return KVLayout(is_mla=is_mla, tp_size=1, tp_rank=0, page_size=page_size, kv_cache_dtype="bfloat16",
                    kv_item_lens=tuple(item_lens), kv_data_lens=tuple(PAGES * i for i in item_lens),
                    kv_head_num=0 if is_mla else 2, total_kv_head_num=0 if is_mla else 2)


def buffers(item_lens, seed=None):
    rng = np.random.default_rng(seed)
    if seed is None:
        return [np.zeros(PAGES * i, dtype=np.uint8) for i in item_lens]
    return [rng.integers(1, 255, PAGES * i, dtype=np.uint8) for i in item_lens]


def apply_columns(planner, columns, src, dst):
    local, remote, sizes, total = columns
    assert len(local) == len(remote) == len(sizes) == len(planner.kv_pairs)
    moved = 0
    for (i, j), lo, ro, sz in zip(planner.kv_pairs, local, remote, sizes):
        for a, b, n in zip(lo.tolist(), ro.tolist(), sz.tolist()):
            assert a + n <= src[i].size and b + n <= dst[j].size
            dst[j][b:b + n] = src[i][a:a + n]
            moved += n
    assert moved == total


def expected(src, item_lens, src_pages, dst_pages):
    out = buffers(item_lens)
    for buf, item, exp in zip(src, item_lens, out):
        for s, d in zip(src_pages, dst_pages):
            exp[d * item:(d + 1) * item] = buf[s * item:(s + 1) * item]
    return out


CASES = {
    "mla, 3 layers": ([576 * 2 * 16] * 3, True),
    "gqa, K and V of 2 layers": ([2 * 128 * 2 * 16] * 4, False),
    "several buffers, unequal items": ([64, 96, 64, 32], True),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("src_pages,dst_pages", [
    ([3], [7]),  # one page
    ([0, 1, 2, 3], [4, 5, 6, 7]),  # one run: one range per pair
    ([5, 2, 9, 0], [1, 8, 3, 11]),  # every page its own range
    ([0, 1, 7, 8, 9, 4], [2, 3, 5, 6, 7, 0]),  # runs and singles mixed
    ([PAGES - 1, 0], [PAGES - 1, 0]),  # the last page of every buffer, no spill past its end
])
def test_columns_copy_exactly_the_pages(name, src_pages, dst_pages):
    item_lens, is_mla = CASES[name]
    planner = TransferPlanner(layout(item_lens, is_mla), layout(item_lens, is_mla))
    src, dst = buffers(item_lens, seed=1), buffers(item_lens)
    columns = planner.plan_kv_columns(np.array(src_pages), np.array(dst_pages))
    apply_columns(planner, columns, src, dst)
    for got, want in zip(dst, expected(src, item_lens, src_pages, dst_pages)):
        assert np.array_equal(got, want)


def test_runs_become_one_range_per_pair():
    item_lens = [64, 64]
    planner = TransferPlanner(layout(item_lens), layout(item_lens))
    local, remote, sizes, total = planner.plan_kv_columns([2, 3, 4, 9], [0, 1, 2, 5])
    assert sizes[0].tolist() == [3 * 64, 64] and local[0].tolist() == [2 * 64, 9 * 64]
    assert remote[0].tolist() == [0, 5 * 64] and total == 2 * 4 * 64


def test_empty_chunk_plans_nothing():
    planner = TransferPlanner(layout([64, 64]), layout([64, 64]))
    assert planner.plan_kv_columns(np.array([], dtype=np.int64), np.array([], dtype=np.int64)) is None
    assert planner.plan_kv_columns([], []) is None


def test_equal_geometries_share_one_read_only_array_per_column():
    planner = TransferPlanner(layout([64] * 4), layout([64] * 4))
    local, remote, sizes, _ = planner.plan_kv_columns(np.array([1, 5]), np.array([2, 0]))
    assert all(a is local[0] for a in local) and all(a is sizes[0] for a in sizes)
    for column in (local[0], remote[0], sizes[0]):
        assert column.dtype == np.int64 and not column.flags.writeable


def test_caller_arrays_stay_writeable_and_unchanged():
    planner = TransferPlanner(layout([64, 64]), layout([64, 64]))
    src, dst = np.array([4, 5, 6], dtype=np.int64), np.array([0, 1, 2], dtype=np.int64)
    planner.plan_kv_columns(src, dst)
    assert src.flags.writeable and dst.flags.writeable
    assert src.tolist() == [4, 5, 6] and dst.tolist() == [0, 1, 2]


@pytest.mark.parametrize("dtype", [np.int32, np.uint16, np.int64])
def test_any_integer_index_dtype_plans_the_same(dtype):
    planner = TransferPlanner(layout([64, 32]), layout([64, 32]))
    base = planner.plan_kv_columns(np.array([1, 2, 7], dtype=np.int64), np.array([0, 1, 3], dtype=np.int64))
    other = planner.plan_kv_columns(np.array([1, 2, 7], dtype=dtype), np.array([0, 1, 3], dtype=dtype))
    for a, b in zip(base[:3], other[:3]):
        assert [x.tolist() for x in a] == [x.tolist() for x in b]
    assert base[3] == other[3]


@pytest.mark.parametrize("src,dst,match", [
    ([0, PAGES], [0, 1], "prefill KV buffer"),
    ([0, 1], [-1, 1], "negative"),
    ([0, 1], [0, PAGES], "decode KV buffer"),
    ([0, 1, 2], [0, 1], "equal length"),
    ([0.0, 1.0], [0, 1], "integers"),
    ([[0, 1]], [[0, 1]], "1-D"),
])
def test_bad_indices_fail_the_chunk_with_a_reason(src, dst, match):
    planner = TransferPlanner(layout([64, 64]), layout([64, 64]))
    with pytest.raises(PlanError, match=match):
        planner.plan_kv_columns(np.array(src), np.array(dst))


def test_smaller_decode_buffer_bounds_the_indices():
    # Decode's second buffer holds fewer pages than the first: its limit names it.
    remote = KVLayout(is_mla=True, tp_size=1, tp_rank=0, page_size=16, kv_cache_dtype="bfloat16",
                      kv_item_lens=(64, 64), kv_data_lens=(PAGES * 64, 4 * 64))
    planner = TransferPlanner(layout([64, 64]), remote)
    assert planner.plan_kv_columns([0, 1], [2, 3]) is not None
    with pytest.raises(PlanError, match="decode KV buffer 1"):
        planner.plan_kv_columns([0, 1], [3, 4])


def test_chunks_of_single_pages_share_sizes_and_stay_exact_as_lengths_change():
    # Chunks of single-page runs share one sizes array per item length (grown for a longer
    # chunk): every chunk, shorter or longer than the last, still moves exactly its pages, and
    # what an earlier chunk was handed is never changed by a later one.
    item_lens = [64, 96]
    planner = TransferPlanner(layout(item_lens, False), layout(item_lens, False))
    earlier = []
    for src_pages, dst_pages in ([[5, 2], [1, 8]], [[9, 0, 4, 11, 2, 7], [3, 10, 0, 6, 1, 9]], [[3], [2]],
                                 [[1, 3, 5, 7, 9, 11, 0], [0, 2, 4, 6, 8, 10, 11]]):
        src, dst = buffers(item_lens, seed=len(src_pages)), buffers(item_lens)
        columns = planner.plan_kv_columns(np.array(src_pages), np.array(dst_pages))
        apply_columns(planner, columns, src, dst)
        for got, want in zip(dst, expected(src, item_lens, src_pages, dst_pages)):
            assert np.array_equal(got, want)
        for sizes, item in zip(columns[2], item_lens):
            assert sizes.tolist() == [item] * len(src_pages) and not sizes.flags.writeable
        earlier.append((columns[2], len(src_pages)))
    for sizes, n in earlier:
        assert [s.tolist() for s in sizes] == [[item] * n for item in item_lens]


@pytest.mark.parametrize("dst", [[-1, 1], [1, -(2 ** 62)], [0, np.iinfo(np.int64).min]])
def test_any_negative_index_fails_the_chunk_on_either_side(dst):
    planner = TransferPlanner(layout([64, 64]), layout([64, 64]))
    with pytest.raises(PlanError, match="negative"):
        planner.plan_kv_columns(np.array([0, 1]), np.array(dst, dtype=np.int64))
    with pytest.raises(PlanError, match="negative"):
        planner.plan_kv_columns(np.array(dst, dtype=np.int64), np.array([0, 1]))


# --- the send path's shortcuts (issue 28: send() to the engine call) ---------------------------

def _mha(tp_size, tp_rank, heads, item_lens):
    return KVLayout(is_mla=False, tp_size=tp_size, tp_rank=tp_rank, page_size=16, kv_cache_dtype="bfloat16",
                    kv_item_lens=tuple(item_lens), kv_data_lens=tuple(PAGES * i for i in item_lens),
                    kv_head_num=heads, total_kv_head_num=2)


@pytest.mark.parametrize("planner", [
    TransferPlanner(layout([64, 96, 64]), layout([64, 96, 64])),  # two item lengths
    TransferPlanner(_mha(1, 0, 2, [256] * 2), _mha(2, 1, 1, [128] * 2)),  # a head slice (summed)
], ids=["item lengths", "head slice"])
def test_total_bytes_equal_the_ranges_sizes_for_any_chunk(planner):
    rng = np.random.default_rng(7)
    for n in (1, 2, 5, PAGES):
        for _ in range(20):
            src, dst = rng.permutation(PAGES)[:n], rng.permutation(PAGES)[:n]
            if rng.random() < 0.5:  # runs too
                src, dst = np.sort(src), np.sort(dst)
            local, remote, sizes, total = planner.plan_kv_columns(src, dst)
            assert total == sum(int(s.sum()) for s in sizes)


def test_large_ranges_split_keep_the_total():
    item = 600 << 20  # a run of two pages is over MAX_RANGE_BYTES (1 GiB): cut in pieces
    planner = TransferPlanner(layout([item, item]), layout([item, item]))
    local, remote, sizes, total = planner.plan_kv_columns([0, 1, 2, 7], [3, 4, 5, 0])
    assert sizes[0].size > 2 and total == 2 * 4 * item == sum(int(s.sum()) for s in sizes)


def test_a_checked_destination_skips_only_decodes_bound_check():
    planner = TransferPlanner(layout([64, 64]), layout([64, 64]))
    good = planner.plan_kv_columns([1, 2, 5], [0, 4, 9])
    vouched = planner.plan_kv_columns([1, 2, 5], [0, 4, 9], dst_checked=True)
    for a, b in zip(good[:3], vouched[:3]):
        assert [x.tolist() for x in a] == [x.tolist() for x in b]
    assert good[3] == vouched[3]
    with pytest.raises(PlanError, match="decode KV buffer"):
        planner.plan_kv_columns([0, 1], [0, PAGES])
    # Prefill's indices are still checked, and so are the pairing and the types.
    with pytest.raises(PlanError, match="prefill KV buffer"):
        planner.plan_kv_columns([0, PAGES], [0, 1], dst_checked=True)
    with pytest.raises(PlanError, match="equal length"):
        planner.plan_kv_columns([0, 1, 2], [0, 1], dst_checked=True)


def test_run_cuts_match_flatnonzero():
    from sglang_mori.planning.ranges import run_cuts
    rng = np.random.default_rng(3)
    for n in (1, 2, 3, 50):
        for _ in range(30):
            src = rng.integers(0, 8, n).cumsum()
            dst = rng.integers(0, 3, n).cumsum()
            want = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1))
            got = run_cuts(src, dst)
            assert got.dtype == want.dtype and got.tolist() == want.tolist()
