"""The physical KV page layout is part of the registered layout; head slicing cuts each one right.

Byte-exact: the model's KV (and non-MLA SWA state) is built once, sharded by heads for each TP
rank in the page byte order under test, every (prefill rank, decode rank) pair SGLang connects
is planned and applied, and every byte of every decode buffer is checked.
"""

from types import SimpleNamespace

import numpy as np
import pytest

from sglang_mori.planning import (
    KVLayout,
    LayoutMismatchError,
    StateLayout,
    TransferPlanner,
    UnsupportedLayoutError,
    check_compatible,
    decode_ranks_for_prefill_rank,
    rank_heads,
)
from sglang_mori.planning.physical_layout import physical_kv_layout
from harness.plan_ranges import ranges

PAGE = 4
PAGES = 6
HEAD_BYTES = (6, 4)  # K and V head sizes differ (head_dim * dtype size)
LAYERS = 2


class Buffer:
    """One K or V buffer of the model: [pages, heads, page slots, head bytes] in global terms."""

    def __init__(self, heads, head_bytes, seed):
        rng = np.random.default_rng(seed)
        self.heads, self.head_bytes = heads, head_bytes
        self.data = rng.integers(0, 256, (PAGES, heads, PAGE, head_bytes), dtype=np.uint8)

    def shard(self, tp, rank, head_major):
        first, count = rank_heads(tp, rank, self.heads)
        part = self.data[:, first:first + count]  # [pages, heads, slots, bytes]
        if not head_major:  # NHD: [pages, slots, heads, bytes]
            part = part.transpose(0, 2, 1, 3)
        return np.ascontiguousarray(part).reshape(PAGES, -1)


def model(heads):
    return [Buffer(heads, HEAD_BYTES[g], seed=10 * g + layer) for g in range(2) for layer in range(LAYERS)]


def layout(buffers, tp, rank, physical, swa=False):
    heads = rank_heads(tp, rank, buffers[0].heads)[1]
    items = tuple(PAGE * heads * b.head_bytes for b in buffers)
    values = dict(
        is_mla=False, tp_size=tp, tp_rank=rank, page_size=PAGE, kv_cache_dtype="bfloat16",
        kv_head_num=heads, total_kv_head_num=buffers[0].heads, kv_physical_layout=physical,
    )
    if swa:  # full-attention KV is tested elsewhere; here the SWA state component carries the heads
        state = StateLayout(state_type="swa", item_lens=items, data_lens=tuple(i * PAGES for i in items))
        values.update(kv_item_lens=items, kv_data_lens=tuple(i * PAGES for i in items),
                      states=(state,), swa_physical_layout=physical)
    else:
        values.update(kv_item_lens=items, kv_data_lens=tuple(i * PAGES for i in items))
    return KVLayout(**values)


def check_exact(heads, p_tp, d_tp, physical, swa=False):
    head_major = physical != "nhd"
    buffers = model(heads)
    src_pages, dst_pages = [1, 2, 5], [0, 3, 4]
    for r in range(d_tp):
        got = [np.full(PAGES * b.shard(d_tp, r, head_major).shape[1], 0xEE, np.uint8) for b in buffers]
        for p in range(p_tp):
            if r not in decode_ranks_for_prefill_rank(p_tp, p, d_tp):
                continue
            src = [b.shard(p_tp, p, head_major).ravel() for b in buffers]
            planner = TransferPlanner(layout(buffers, p_tp, p, physical, swa),
                                      layout(buffers, d_tp, r, physical, swa))
            plan = planner.plan_state(0, src_pages, dst_pages) if swa else planner.plan_kv(src_pages, dst_pages)
            for t in plan:
                for lo, ro, sz in zip(*ranges(t)):
                    got[t.remote_index][ro:ro + sz] = src[t.local_index][lo:lo + sz]
        for k, b in enumerate(buffers):
            want = np.full((PAGES, b.shard(d_tp, r, head_major).shape[1]), 0xEE, np.uint8)
            want[dst_pages] = b.shard(d_tp, r, head_major)[src_pages]
            assert np.array_equal(got[k].reshape(PAGES, -1), want), (heads, p_tp, d_tp, physical, r, k)


@pytest.mark.parametrize("physical", ["nhd", "vectorized_5d", "hnd"])
@pytest.mark.parametrize("p_tp, d_tp", [(1, 2), (2, 1), (1, 4), (4, 2)])
@pytest.mark.parametrize("heads", [2, 8])
def test_head_sliced_kv_is_byte_exact_in_every_layout(heads, p_tp, d_tp, physical):
    check_exact(heads, p_tp, d_tp, physical)


@pytest.mark.parametrize("physical", ["nhd", "vectorized_5d"])
@pytest.mark.parametrize("p_tp, d_tp", [(1, 2), (2, 1), (1, 4), (4, 2)])
def test_non_mla_swa_state_is_head_sliced_byte_exact(p_tp, d_tp, physical):
    check_exact(4, p_tp, d_tp, physical, swa=True)


def test_head_major_pages_move_one_range_per_page():
    buffers = model(4)
    planner = TransferPlanner(layout(buffers, 1, 0, "vectorized_5d"), layout(buffers, 2, 1, "vectorized_5d"))
    plan = planner.plan_kv([1, 2, 5], [0, 3, 4])
    assert {t.num_ranges for t in plan} == {3}
    nhd = TransferPlanner(layout(buffers, 1, 0, "nhd"), layout(buffers, 2, 1, "nhd")).plan_kv([1, 2, 5], [0, 3, 4])
    assert {t.num_ranges for t in nhd} == {3 * PAGE}


def test_layout_mismatch_is_refused_naming_both_sides():
    buffers = model(2)
    with pytest.raises(LayoutMismatchError, match="kv_physical_layout: prefill=vectorized_5d decode=nhd"):
        check_compatible(layout(buffers, 1, 0, "vectorized_5d"), layout(buffers, 1, 0, "nhd"))
    # Not reported is SGLang's default, NHD.
    check_compatible(layout(buffers, 1, 0, None), layout(buffers, 1, 0, "nhd"))
    with pytest.raises(LayoutMismatchError, match="swa_physical_layout: prefill=nhd decode=vectorized_5d"):
        check_compatible(layout(buffers, 1, 0, "nhd", swa=True),
                         KVLayout(**{**_fields(layout(buffers, 1, 0, "nhd", swa=True)),
                                     "swa_physical_layout": "vectorized_5d"}))
    with pytest.raises(LayoutMismatchError, match="kv_layout: prefill=dsv4_fp8 decode=None"):
        check_compatible(KVLayout(**{**_fields(layout(buffers, 1, 0, None)), "kv_layout": "dsv4_fp8"}),
                         layout(buffers, 1, 0, None))


def test_mla_pages_have_one_layout_whatever_the_environment():
    mla = dict(is_mla=True, tp_size=1, tp_rank=0, page_size=PAGE, kv_cache_dtype="bf16",
               kv_item_lens=(64,), kv_data_lens=(640,))
    check_compatible(KVLayout(**mla), KVLayout(**mla))


def test_layouts_head_slicing_cannot_cut_are_refused_only_when_slicing():
    buffers = model(4)
    same_tp = (layout(buffers, 2, 1, "page_major"), layout(buffers, 2, 1, "page_major"))
    assert TransferPlanner(*same_tp).plan_kv([1], [2]).num_ranges == 2 * LAYERS  # whole pages
    with pytest.raises(UnsupportedLayoutError, match="cannot cut pages of the 'page_major' layout"):
        TransferPlanner(layout(buffers, 1, 0, "page_major"), layout(buffers, 2, 1, "page_major"))


def test_physical_layout_follows_sglang_pool_rule():
    assert physical_kv_layout({}, lambda: True) == "nhd"
    aiter = {"SGLANG_USE_AITER": "1", "SGLANG_AITER_KV_CACHE_LAYOUT": "VECTORIZED_5D"}
    assert physical_kv_layout(aiter, lambda: True) == "vectorized_5d"
    assert physical_kv_layout(aiter, lambda: False) == "nhd"  # AITER layouts exist on ROCm only
    assert physical_kv_layout({**aiter, "SGLANG_USE_HND_KVCACHE": "true"}, lambda: True) == "hnd"
    assert physical_kv_layout({"SGLANG_USE_AITER": "1"}, lambda: True) == "nhd"


def test_from_kv_args_records_both_physical_layouts(monkeypatch):
    monkeypatch.setenv("SGLANG_USE_HND_KVCACHE", "1")
    args = SimpleNamespace(kv_item_lens=[64], kv_data_lens=[640], kv_cache_dtype_str="bf16", page_size=PAGE,
                           swa_kv_cache_layout="nhd")
    layout_ = KVLayout.from_kv_args(args, tp_size=1, tp_rank=0, is_mla=False)
    assert (layout_.kv_physical_layout, layout_.swa_physical_layout) == ("hnd", "nhd")
    assert KVLayout.from_kv_args(args, tp_size=1, tp_rank=0, is_mla=True).kv_physical_layout is None


def _fields(struct):
    return {name: getattr(struct, name) for name in struct.__struct_fields__}
