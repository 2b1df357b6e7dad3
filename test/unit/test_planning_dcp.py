"""Decode context parallel relayout: prefill DCP 1 into a decode with DCP N > 1 (MLA).

Plans are applied to real byte arrays: random prefill KV (target layers and draft layers, each
with its own token size), zeroed decode buffers for every one of the N decode DCP ranks, a
request sent in several chunks (the last one ending in a partial page), after a decode prefix.
The expectation is built one token at a time from the rule: relative position q (after decode's
prefix) at absolute position p = prefix + q goes, for target entries, to rank p % N at local slot
q // N of the request's virtual pages (physical page k of the rank = virtual page k), and, for
draft entries, to every rank at slot q of the virtual pages (page_size * N tokens each).
Every byte of every decode buffer is compared, so a token written twice, to the wrong place or
not at all fails.
"""

from dataclasses import dataclass
from typing import List

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from sglang_mori.planning import (
    KVLayout,
    LayoutMismatchError,
    PlanError,
    TransferPlanner,
    UnsupportedLayoutError,
    check_compatible,
)

CAP_PAGES = 24  # physical pages per prefill buffer and per decode target buffer


@dataclass
class Case:
    page_size: int
    dcp: int
    token_bytes: List[int]  # per KV buffer: target layers first, then draft layers
    num_draft: int
    num_tokens: int  # tokens prefill sends (after decode's prefix)
    prefix_pages: int  # decode prefix, in virtual pages
    src_pages: List[int]
    dst_pages: List[int]  # virtual pages of the request after the prefix
    cuts: List[int]  # chunk boundaries in prefill pages (strictly inside)
    seed: int = 0


def layouts(case: Case):
    ps, n = case.page_size, case.dcp
    num = len(case.token_bytes)
    src_items = tuple(ps * t for t in case.token_bytes)
    prefill = KVLayout(is_mla=True, tp_size=1, tp_rank=0, page_size=ps, kv_cache_dtype="bfloat16",
                       kv_item_lens=src_items, kv_data_lens=tuple(i * CAP_PAGES for i in src_items),
                       num_draft_entries=case.num_draft)
    draft = [k >= num - case.num_draft for k in range(num)]
    dst_items = tuple(i * (n if d else 1) for i, d in zip(src_items, draft))
    decodes = [KVLayout(is_mla=True, tp_size=1, tp_rank=0, page_size=ps, kv_cache_dtype="bfloat16",
                        kv_item_lens=dst_items, kv_data_lens=tuple(i * CAP_PAGES for i in dst_items),
                        num_draft_entries=case.num_draft, dcp_size=n, dcp_rank=r)
               for r in range(n)]
    return prefill, decodes, draft


def apply(plan, src_bufs, dst_bufs):
    for t in plan.transfers:
        for lo, ro, size in zip(t.local_offsets.tolist(), t.remote_offsets.tolist(), t.sizes.tolist()):
            dst_bufs[t.remote_index][ro:ro + size] = src_bufs[t.local_index][lo:lo + size]


def run(case: Case):
    """(decode buffers per rank, expected buffers per rank, plans) for the whole request."""
    ps, n = case.page_size, case.dcp
    prefill, decodes, draft = layouts(case)
    rng = np.random.default_rng(case.seed)
    src_bufs = [rng.integers(1, 256, size=d, dtype=np.uint8) for d in prefill.kv_data_lens]
    prefix = case.prefix_pages * ps * n
    got, want, plans = [], [], []
    bounds = [0, *case.cuts, len(case.src_pages)]
    for rank, decode in enumerate(decodes):
        planner = TransferPlanner(prefill, decode)
        assert planner.dcp_relayout
        dst_bufs = [np.zeros(d, dtype=np.uint8) for d in decode.kv_data_lens]
        for a, b in zip(bounds, bounds[1:]):
            tokens = min(b * ps, case.num_tokens) - a * ps
            plan = planner.plan_kv_dcp(case.src_pages[a:b], case.dst_pages, page_offset=a,
                                       decode_prefix_len=prefix, num_tokens=tokens)
            plans.append((rank, draft, plan))
            apply(plan, src_bufs, dst_bufs)
        expected = [np.zeros(d, dtype=np.uint8) for d in decode.kv_data_lens]
        for k, tb in enumerate(case.token_bytes):
            for q in range(case.num_tokens):
                src_slot = case.src_pages[q // ps] * ps + q % ps
                if draft[k]:
                    vps = ps * n
                    dst_slot = case.dst_pages[q // vps] * vps + q % vps
                elif (prefix + q) % n == rank:
                    local = q // n
                    dst_slot = case.dst_pages[local // ps] * ps + local % ps
                else:
                    continue
                expected[k][dst_slot * tb:(dst_slot + 1) * tb] = src_bufs[k][src_slot * tb:(src_slot + 1) * tb]
        got.append(dst_bufs)
        want.append(expected)
    return got, want, plans


def assert_byte_exact(case: Case):
    got, want, _ = run(case)
    for rank, (g, w) in enumerate(zip(got, want)):
        for k, (gb, wb) in enumerate(zip(g, w)):
            bad = np.flatnonzero(gb != wb)
            assert bad.size == 0, f"rank {rank} buffer {k}: {bad.size} wrong bytes, first at {bad[:4]}"


def pages_for(num_tokens, ps, n, rng, prefix_pages=0):
    src_count = -(-num_tokens // ps)
    dst_count = -(-num_tokens // (ps * n))
    src = rng.permutation(CAP_PAGES)[:src_count].tolist()
    # Decode's virtual pages are disjoint from its prefix's pages (which start at page 0 here).
    free = rng.permutation(np.arange(prefix_pages, CAP_PAGES))[:dst_count].tolist()
    return src, free


@pytest.mark.parametrize("ps", [1, 16, 64])
@pytest.mark.parametrize("n", [2, 4])
def test_dcp_relayout_is_byte_exact_chunked_with_prefix_partial_page_and_draft(ps, n):
    rng = np.random.default_rng(ps * 10 + n)
    prefix_pages = 1
    # Several chunks; the last one ends in a partial page; three tokens past a virtual page.
    num_tokens = 3 * ps * n + 3 if ps * n * 4 <= CAP_PAGES * ps else 2 * ps + 3
    src, dst = pages_for(num_tokens, ps, n, rng, prefix_pages)
    cuts = sorted({1, max(1, len(src) // 2), len(src) - 1} - {0, len(src)})
    case = Case(page_size=ps, dcp=n, token_bytes=[12, 12, 20, 12], num_draft=1, num_tokens=num_tokens,
                prefix_pages=prefix_pages, src_pages=src, dst_pages=dst, cuts=cuts, seed=ps + n)
    assert_byte_exact(case)


def test_every_target_token_lands_on_exactly_one_rank_and_draft_on_all():
    ps, n = 16, 4
    rng = np.random.default_rng(3)
    num_tokens = 2 * ps * n + 5
    src, dst = pages_for(num_tokens, ps, n, rng)
    case = Case(page_size=ps, dcp=n, token_bytes=[8, 8], num_draft=1, num_tokens=num_tokens, prefix_pages=0,
                src_pages=src, dst_pages=dst, cuts=[3])
    _, _, plans = run(case)
    target_bytes = sum(t.total_bytes for _, draft, p in plans for t in p.transfers if not draft[t.local_index])
    draft_bytes = sum(t.total_bytes for _, draft, p in plans for t in p.transfers if draft[t.local_index])
    assert target_bytes == num_tokens * 8  # once over all ranks
    assert draft_bytes == n * num_tokens * 8  # every rank holds all of them


def test_target_ranges_are_one_token_each_and_draft_runs_merge():
    """Target tokens of one rank are dcp_size apart in prefill pages: nothing merges. Draft tokens
    of contiguous pages on both sides merge into one range."""
    ps, n = 16, 2
    prefill, decodes, _ = layouts(Case(ps, n, [8, 8], 1, 0, 0, [], [], []))
    planner = TransferPlanner(prefill, decodes[1])
    plan = planner.plan_kv_dcp([4, 5, 6, 7], [2, 3], page_offset=0, num_tokens=4 * ps)
    target, draft = plan.transfers
    assert target.num_ranges == 2 * ps and set(target.sizes.tolist()) == {8}
    assert target.local_offsets.tolist()[:2] == [(4 * ps + 1) * 8, (4 * ps + 3) * 8]
    assert target.remote_offsets.tolist()[:2] == [2 * ps * 8, (2 * ps + 1) * 8]
    assert draft.num_ranges == 1 and draft.total_bytes == 4 * ps * 8
    assert draft.remote_offsets.tolist() == [2 * ps * n * 8]


@st.composite
def dcp_cases(draw):
    ps = draw(st.sampled_from([1, 2, 16]))
    n = draw(st.sampled_from([2, 3, 4]))
    max_tokens = min(CAP_PAGES * ps, (CAP_PAGES - 2) * ps * n)
    num_tokens = draw(st.integers(1, max_tokens))
    prefix_pages = draw(st.integers(0, 2))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    src, dst = pages_for(num_tokens, ps, n, rng, prefix_pages)
    if draw(st.booleans()):  # sorted pages: long contiguous runs
        src, dst = sorted(src), sorted(dst)
    cuts = sorted(set(draw(st.lists(st.integers(1, max(1, len(src) - 1)), max_size=3))) - {len(src)})
    num_draft = draw(st.integers(0, 1))
    token_bytes = draw(st.lists(st.sampled_from([2, 6, 16]), min_size=1 + num_draft, max_size=3))
    return Case(page_size=ps, dcp=n, token_bytes=token_bytes, num_draft=num_draft, num_tokens=num_tokens,
                prefix_pages=prefix_pages, src_pages=src, dst_pages=dst, cuts=cuts,
                seed=draw(st.integers(0, 1000)))


@settings(max_examples=60, deadline=None)
@given(dcp_cases())
def test_dcp_plan_matches_a_per_token_reference(case):
    assert_byte_exact(case)


# --- registration --------------------------------------------------------------------------

def mla(**fields):
    values = dict(is_mla=True, tp_size=1, tp_rank=0, page_size=16, kv_cache_dtype="bfloat16",
                  kv_item_lens=(16 * 576,) * 2, kv_data_lens=(16 * 576 * 8,) * 2)
    values.update(fields)
    return KVLayout(**values)


def mha(**fields):
    return mla(is_mla=False, **fields)


def test_mha_with_decode_context_parallel_is_refused_naming_both_sides():
    with pytest.raises(UnsupportedLayoutError) as err:
        check_compatible(mha(), mha(dcp_size=2, dcp_rank=1))
    assert "prefill dcp_size=1 dcp_rank=0, decode dcp_size=2 dcp_rank=1" in str(err.value)
    assert "MLA KV only" in str(err.value)


def test_prefill_dcp_into_a_larger_decode_dcp_is_refused_naming_both_sides():
    with pytest.raises(UnsupportedLayoutError) as err:
        check_compatible(mla(dcp_size=2, dcp_rank=1), mla(dcp_size=4, dcp_rank=3))
    assert "prefill dcp_size=2 dcp_rank=1, decode dcp_size=4 dcp_rank=3" in str(err.value)


def test_prefill_dcp_into_decode_without_dcp_is_refused():
    with pytest.raises(UnsupportedLayoutError) as err:
        check_compatible(mla(dcp_size=2), mla())
    assert "prefill dcp_size=2 dcp_rank=0, decode dcp_size=1 dcp_rank=0" in str(err.value)


def test_equal_dcp_sizes_need_equal_ranks():
    with pytest.raises(LayoutMismatchError) as err:
        check_compatible(mla(dcp_size=2, dcp_rank=0), mla(dcp_size=2, dcp_rank=1))
    assert "dcp_rank: prefill=0 decode=1" in str(err.value)
    planner = TransferPlanner(mla(dcp_size=2, dcp_rank=1), mla(dcp_size=2, dcp_rank=1))
    assert not planner.dcp_relayout  # same stripes both sides: pages copy as they are


def test_mla_prefill_into_dcp_decode_is_served_and_page_copies_are_refused():
    planner = TransferPlanner(mla(), mla(dcp_size=2, dcp_rank=1))
    assert planner.dcp_relayout
    with pytest.raises(PlanError, match="relayout"):
        planner.plan_kv([1], [1])


def test_draft_entries_need_virtual_page_items_on_decode():
    src = mla(num_draft_entries=1)
    with pytest.raises(LayoutMismatchError, match="draft entry") as err:
        check_compatible(src, mla(num_draft_entries=1, dcp_size=2, dcp_rank=0))
    assert "decode dcp_size=2" in str(err.value)
    dst = mla(num_draft_entries=1, dcp_size=2, kv_item_lens=(16 * 576, 2 * 16 * 576),
              kv_data_lens=(16 * 576 * 8, 2 * 16 * 576 * 8))
    assert TransferPlanner(src, dst).dcp_relayout


def test_target_entries_need_equal_token_size():
    with pytest.raises(LayoutMismatchError, match="target entry"):
        check_compatible(mla(), mla(dcp_size=2, kv_item_lens=(16 * 512,) * 2))


# --- per chunk -----------------------------------------------------------------------------

def test_unaligned_decode_prefix_fails_the_chunk():
    planner = TransferPlanner(mla(), mla(dcp_size=2, dcp_rank=0))
    with pytest.raises(PlanError, match="virtual page size 32"):
        planner.plan_kv_dcp([1], [1], page_offset=0, decode_prefix_len=16, num_tokens=16)


def test_too_few_decode_pages_fail_the_chunk():
    planner = TransferPlanner(mla(), mla(dcp_size=2, dcp_rank=0))
    with pytest.raises(PlanError, match="decode gave 1 virtual pages"):
        planner.plan_kv_dcp([1, 2, 3], [1], page_offset=0, num_tokens=48)


def test_out_of_range_decode_page_fails_the_chunk():
    planner = TransferPlanner(mla(), mla(dcp_size=2, dcp_rank=0))
    with pytest.raises(PlanError, match="out of range"):
        planner.plan_kv_dcp([1], [8], page_offset=0, num_tokens=16)


def test_more_tokens_than_slots_fail_the_chunk():
    planner = TransferPlanner(mla(), mla(dcp_size=2, dcp_rank=0))
    with pytest.raises(PlanError, match="17 tokens"):
        planner.plan_kv_dcp([1], [1], page_offset=0, num_tokens=17)


def test_a_rank_with_no_token_in_a_chunk_plans_nothing():
    planner = TransferPlanner(mla(), mla(dcp_size=4, dcp_rank=3))
    plan = planner.plan_kv_dcp([5], [2], page_offset=0, num_tokens=3)  # positions 0..2: ranks 0..2
    assert plan.empty


# --- the backend's registration ------------------------------------------------------------

def test_register_dcp_position_reaches_the_planner_and_only_layerwise_on_refuses_it():
    """Decode's Register carries dcp_size / dcp_rank (they win over the layout's); the chunk-wise
    planner serves the relayout; under SGLANG_MORI_LAYERWISE=on the layer-wise planner refuses the
    peer at registration, under `auto` it serves it (chunk-wise: its rooms never stream)."""
    from types import SimpleNamespace

    from sglang_mori.backend.plans import KVPlanner, encode_layout
    from sglang_mori.backend.prefill.layerwise.assembly import layerwise_planner

    decode = mla()
    descs = [SimpleNamespace(size=d) for d in decode.kv_data_lens]
    remote = KVPlanner(mla(), None).accept_peer("k", encode_layout(decode), descs, [], [], dcp=(2, 1))
    assert (remote.dcp_size, remote.dcp_rank) == (2, 1)
    with pytest.raises(UnsupportedLayoutError, match="layer-wise") as err:
        layerwise_planner("on", mla(), None).accept_peer("k", encode_layout(decode), descs, [], [], dcp=(2, 1))
    assert "prefill dcp_size=1" in str(err.value) and "decode dcp_size=2 dcp_rank=1" in str(err.value)
    assert "SGLANG_MORI_LAYERWISE=auto" in str(err.value)
    auto = layerwise_planner("auto", mla(), None)
    assert auto.accept_peer("k", encode_layout(decode), descs, [], [], dcp=(2, 1)).dcp_size == 2
    assert auto.stream_refusal("k") == "decode_context_parallel"
    auto.accept_peer("plain", encode_layout(mla()), descs, [], [])
    assert auto.stream_refusal("plain") is None
    with pytest.raises(UnsupportedLayoutError, match="MLA KV only"):
        KVPlanner(mha(), None).accept_peer("k", encode_layout(mha()), descs, [], [], dcp=(2, 1))
