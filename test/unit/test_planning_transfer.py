"""End to end: plans applied to real byte buffers give exactly the bytes a per-token copy gives.

A random "model KV" G[buffer][token slot, global head, head bytes] is laid out the way SGLang's
pools lay it out on each prefill rank (its heads only, per slot [heads, head_dim]); decode
buffers start zeroed. Every decode rank receives from every prefill rank SGLang pairs it with,
through TransferPlanner plans applied with plain slicing. The expectation is computed
independently, one token and one head at a time.
"""

from harness.plan_ranges import ranges
from dataclasses import dataclass
from typing import List

import numpy as np
from hypothesis import given, settings, strategies as st

from sglang_mori.planning import (
    KVLayout,
    TransferPlanner,
    decode_ranks_for_prefill_rank,
    rank_heads,
)

CAPACITY_PAGES = 10


@dataclass
class Case:
    is_mla: bool
    page_size: int
    layers: int
    head_bytes: List[int]  # per buffer (MHA: K layers then V layers; MLA: latent per layer)
    total_heads: int  # MLA: 1 latent "head" on every rank
    prefill_tp: int
    decode_tp: int
    src_pages: List[int]
    dst_pages: List[int]
    chunk_cuts: List[int]
    decode_reports_heads: bool
    seed: int


def splittable(tp, heads):
    return heads % tp == 0 if heads >= tp else tp % heads == 0


@st.composite
def cases(draw):
    is_mla = draw(st.booleans())
    page_size = draw(st.sampled_from([1, 16, 64]))
    layers = draw(st.integers(1, 2))
    dtype_size = draw(st.sampled_from([1, 2, 4]))
    k_dim = draw(st.sampled_from([1, 2, 4]))
    prefill_tp = draw(st.sampled_from([1, 2, 4]))
    decode_tp = draw(st.sampled_from([1, 2, 4]))
    if is_mla:
        total_heads = 1
        head_bytes = [k_dim * dtype_size * 3] * layers  # latent + rope, one per token
    else:
        valid = [h for h in (1, 2, 4, 8) if splittable(prefill_tp, h) and splittable(decode_tp, h)]
        # Half the time the fewest heads, so GQA replication (heads < TP) comes up often.
        total_heads = draw(st.one_of(st.just(valid[0]), st.sampled_from(valid)))
        v_dim = draw(st.sampled_from([k_dim, 2 * k_dim]))  # V may have its own head_dim
        head_bytes = [k_dim * dtype_size] * layers + [v_dim * dtype_size] * layers
    max_pages = 4 if page_size == 64 else 8
    n = draw(st.integers(0, max_pages))
    src = draw(st.lists(st.integers(0, CAPACITY_PAGES - 1), min_size=n, max_size=n, unique=True))
    dst = draw(st.lists(st.integers(0, CAPACITY_PAGES - 1), min_size=n, max_size=n, unique=True))
    # Real allocations are mostly ascending; sorting makes long both-side runs likely.
    if draw(st.booleans()):
        src.sort()
    if draw(st.booleans()):
        dst.sort()
    cuts = sorted(draw(st.lists(st.integers(0, n), max_size=3)))
    return Case(is_mla, page_size, layers, head_bytes, total_heads, prefill_tp, decode_tp, src, dst,
                cuts, draw(st.booleans()), draw(st.integers(0, 2**32 - 1)))


def heads_of(case, tp, rank):
    return (0, 1) if case.is_mla else rank_heads(tp, rank, case.total_heads)


def layout(case, tp, rank, reports_heads=True) -> KVLayout:
    heads = heads_of(case, tp, rank)[1]
    item_lens = tuple(case.page_size * heads * hb for hb in case.head_bytes)
    return KVLayout(
        is_mla=case.is_mla,
        tp_size=tp,
        tp_rank=rank,
        page_size=case.page_size,
        kv_cache_dtype="bfloat16",
        kv_item_lens=item_lens,
        kv_data_lens=tuple(CAPACITY_PAGES * i for i in item_lens),
        kv_head_num=0 if case.is_mla or not reports_heads else heads,
        total_kv_head_num=0 if case.is_mla or not reports_heads else case.total_heads,
    )


def rank_buffer(model_kv, case, tp, rank):
    first, count = heads_of(case, tp, rank)
    return [np.ascontiguousarray(g[:, first : first + count, :]).ravel() for g in model_kv]


def expected_decode_buffers(model_kv, case, rank):
    """Reference: copy token by token, head by head."""
    first, count = heads_of(case, case.decode_tp, rank)
    out = []
    for g in model_kv:
        e = np.zeros((CAPACITY_PAGES * case.page_size, count, g.shape[2]), dtype=np.uint8)
        for s, d in zip(case.src_pages, case.dst_pages):
            for t in range(case.page_size):
                for h in range(count):
                    e[d * case.page_size + t, h] = g[s * case.page_size + t, first + h]
        out.append(e.ravel())
    return out


def reference_range_count(case, p_rank, d_rank, buffer):
    """Maximal runs of per-token head blocks contiguous on both sides, found by walking them."""
    hb = case.head_bytes[buffer]
    p_first, p_count = heads_of(case, case.prefill_tp, p_rank)
    d_first, d_count = heads_of(case, case.decode_tp, d_rank)
    first = max(p_first, d_first)
    end = min(p_first + p_count, d_first + d_count)
    size = (end - first) * hb
    runs, prev = 0, None
    for s, d in zip(case.src_pages, case.dst_pages):
        for t in range(case.page_size):
            lo = ((s * case.page_size + t) * p_count + first - p_first) * hb
            ro = ((d * case.page_size + t) * d_count + first - d_first) * hb
            if prev is None or (lo, ro) != (prev[0] + size, prev[1] + size):
                runs += 1
            prev = (lo, ro)
    return runs


def page_runs_by_hand(src, dst):
    return sum(1 for k in range(len(src)) if k == 0 or src[k] != src[k - 1] + 1 or dst[k] != dst[k - 1] + 1)


def apply(plan, src_buffers, dst_buffers):
    for t in plan:
        src, dst = src_buffers[t.local_index], dst_buffers[t.remote_index]
        ends = t.remote_offsets + t.sizes
        assert int(t.local_offsets.min()) >= 0 and int((t.local_offsets + t.sizes).max()) <= src.size
        assert int(t.remote_offsets.min()) >= 0 and int(ends.max()) <= dst.size
        order = np.argsort(t.remote_offsets)
        assert (t.remote_offsets[order][1:] >= ends[order][:-1]).all(), "destination ranges overlap"
        for lo, ro, sz in zip(*ranges(t)):
            dst[ro : ro + sz] = src[lo : lo + sz]


def senders_for(case, d_rank):
    if case.is_mla:
        return [d_rank % case.prefill_tp]  # MLA: any one prefill rank holds the whole latent
    return [p for p in range(case.prefill_tp)
            if d_rank in decode_ranks_for_prefill_rank(case.prefill_tp, p, case.decode_tp)]


@settings(max_examples=150, deadline=None)
@given(case=cases())
def test_plans_deliver_exactly_the_reference_bytes(case):
    rng = np.random.default_rng(case.seed)
    tokens = CAPACITY_PAGES * case.page_size
    model_kv = [rng.integers(0, 256, (tokens, case.total_heads, hb), dtype=np.uint8) for hb in case.head_bytes]
    src_pages = np.array(case.src_pages, dtype=np.int32)
    dst_pages = np.array(case.dst_pages, dtype=np.int32)

    for d_rank in range(case.decode_tp):
        decode = layout(case, case.decode_tp, d_rank, case.decode_reports_heads)
        whole = [np.zeros_like(b) for b in rank_buffer(model_kv, case, case.decode_tp, d_rank)]
        chunked = [np.zeros_like(b) for b in whole]
        for p_rank in senders_for(case, d_rank):
            planner = TransferPlanner(layout(case, case.prefill_tp, p_rank), decode)
            src_buffers = rank_buffer(model_kv, case, case.prefill_tp, p_rank)
            plan = planner.plan_kv(src_pages, dst_pages)
            apply(plan, src_buffers, whole)

            assert plan.total_bytes == sum(int(t.sizes.sum()) for t in plan)
            if case.src_pages:
                assert [t.local_index for t in plan] == list(range(len(case.head_bytes)))
            for t in plan:
                assert t.num_ranges == reference_range_count(case, p_rank, d_rank, t.local_index)
                if planner.prefill.tp_size == planner.decode.tp_size or case.is_mla:
                    assert t.num_ranges == page_runs_by_hand(case.src_pages, case.dst_pages)

            # Chunked prefill: each chunk planned alone from its page slice, no shared state.
            bounds = [0, *case.chunk_cuts, len(case.src_pages)]
            for a, b in zip(bounds[:-1], bounds[1:]):
                apply(planner.plan_kv(src_pages[a:b], dst_pages[a:b]), src_buffers, chunked)

        expected = expected_decode_buffers(model_kv, case, d_rank)
        for got, got_chunked, want in zip(whole, chunked, expected):
            assert np.array_equal(got, want)
            assert np.array_equal(got_chunked, want)
