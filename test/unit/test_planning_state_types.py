"""Every state type SGLang 0.5.23 sends: its index form and its rule for different TP sizes."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_mori.planning import (
    KVLayout,
    LayoutMismatchError,
    PlanError,
    StateLayout,
    TransferPlanner,
    UnsupportedLayoutError,
)
from sglang_mori.planning.state_rules import STATE_RULES

from test_planning_state_slice import sglang_functions
from harness.plan_ranges import ranges

CAPACITY = 16


def state(state_type, item_lens, layer_ids=()):
    return StateLayout(state_type=state_type, item_lens=tuple(item_lens),
                       data_lens=tuple(i * CAPACITY for i in item_lens), layer_ids=tuple(layer_ids))


def layout(states, tp_size=1, tp_rank=0, is_mla=True):
    # MLA KV (copied whole between any ranks) unless a test asks otherwise: the state is under test.
    heads = {} if is_mla else {"total_kv_head_num": 4}
    return KVLayout(is_mla=is_mla, tp_size=tp_size, tp_rank=tp_rank, page_size=1, kv_cache_dtype="bf16",
                    kv_item_lens=(64 if is_mla else 64 // tp_size,), kv_data_lens=(64 * 8,),
                    states=tuple(states), **heads)


def apply(plan, src, dst):
    for t in plan:
        for lo, ro, sz in zip(*ranges(t)):
            dst[t.remote_index][ro:ro + sz] = src[t.local_index][lo:lo + sz]


def buffers(item_lens, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, i * CAPACITY, dtype=np.uint8) for i in item_lens]


ITEM_COPIED = sorted(t for t, (form, _) in STATE_RULES.items() if form in ("paged", "exact"))
EXACT = sorted(t for t, (form, _) in STATE_RULES.items() if form == "exact")
PAGED = sorted(t for t, (form, _) in STATE_RULES.items() if form == "paged")


@pytest.mark.parametrize("state_type", ITEM_COPIED)
def test_item_indexed_state_types_copy_their_items_byte_exact(state_type):
    items = (24, 8)
    planner = TransferPlanner(layout([state(state_type, items)]), layout([state(state_type, items)]))
    src, dst = buffers(items), [np.zeros(i * CAPACITY, np.uint8) for i in items]
    src_rows, dst_rows = [3, 4, 5, 11], [0, 1, 2, 7]
    plan = planner.plan_state(0, src_rows, dst_rows)
    assert plan.kind == f"state:{state_type}" and [t.num_ranges for t in plan] == [2, 2]
    apply(plan, src, dst)
    for buf_src, buf_dst, item in zip(src, dst, items):
        want = np.zeros_like(buf_dst)
        for s, d in zip(src_rows, dst_rows):
            want[d * item:(d + 1) * item] = buf_src[s * item:(s + 1) * item]
        assert np.array_equal(buf_dst, want)


@pytest.mark.parametrize("state_type", EXACT)
def test_positional_rows_of_unequal_length_fail_the_request(state_type):
    planner = TransferPlanner(layout([state(state_type, [8])]), layout([state(state_type, [8])]))
    with pytest.raises(PlanError, match=rf"{state_type} state index length mismatch: prefill=2 decode=1"):
        planner.plan_state(0, [1, 2], [3])
    assert planner.plan_state(0, [], []).empty  # e.g. c128_state before the first c128 page


@pytest.mark.parametrize("state_type", PAGED)
def test_page_lists_of_unequal_length_are_cut_to_the_common_prefix(state_type):
    planner = TransferPlanner(layout([state(state_type, [8])]), layout([state(state_type, [8])]))
    plan = planner.plan_state(0, [1, 2, 3], [4, 5])
    assert plan.dropped == 1 and plan.total_bytes == 16


@pytest.mark.parametrize("state_type", ["minimax_index_k", "minimax_dense_kv", "block_scale", "block_scale_swa"])
def test_equal_tp_only_types_refuse_a_tp_mismatch_naming_both_sizes(state_type):
    prefill, decode = layout([state(state_type, [8])], 1, 0, False), layout([state(state_type, [8])], 2, 1, False)
    with pytest.raises(UnsupportedLayoutError,
                       match=rf"'{state_type}' \(state component 0\) needs equal attention TP sizes: prefill=1 decode=2"):
        TransferPlanner(prefill, decode)
    TransferPlanner(layout([state(state_type, [8])], 2, 1, False), layout([state(state_type, [8])], 2, 1, False))


@pytest.mark.parametrize("state_type", ["swa_ring", "c128_state", "request_row"])
def test_deepseek_v4_state_is_whole_on_every_mla_rank(state_type):
    # DeepSeek-V4 pools are MLA: any prefill rank copies the rows whole to its decode ranks.
    for p_tp, p_rank, d_tp, d_rank in [(1, 0, 2, 1), (4, 3, 2, 1)]:
        planner = TransferPlanner(layout([state(state_type, [8])], p_tp, p_rank),
                                  layout([state(state_type, [8])], d_tp, d_rank))
        assert ranges(planner.plan_state(0, [2], [5]).transfers[0]) == ([16], [40], [8])
    with pytest.raises(UnsupportedLayoutError, match=rf"'{state_type}'.*prefill=1 decode=2 \(outside an MLA model"):
        TransferPlanner(layout([state(state_type, [8])], 1, 0, False), layout([state(state_type, [8])], 2, 0, False))


@pytest.mark.parametrize("state_type", ["qsa_pending", "qsa_compressed"])
def test_qsa_state_whole_on_every_rank_is_written_once_per_decode_rank(state_type):
    def plans(p_tp, d_tp):
        out = {}
        for p in range(p_tp):
            d = p * d_tp // p_tp if d_tp < p_tp else p * (d_tp // p_tp)
            planner = TransferPlanner(layout([state(state_type, [8])], p_tp, p, False),
                                      layout([state(state_type, [8])], d_tp, d, False))
            out[p] = planner.plan_state(0, [1], [2]).total_bytes
        return out

    assert plans(4, 2) == {0: 8, 1: 0, 2: 8, 3: 0}  # aggregation: the first rank of each group
    assert plans(1, 2) == {0: 8}  # scatter: the one sender writes to each decode rank
    with pytest.raises(LayoutMismatchError, match=rf"state '{state_type}' tensor 0->0 item_len: prefill=8 decode=16"):
        TransferPlanner(layout([state(state_type, [8])]), layout([state(state_type, [16])]))


# --- dsa_tail ------------------------------------------------------------------------------

def tail(row, n_valid, start, size):
    """SGLang's descriptor for `n_valid` live tokens from ring slot `start` (wrapping)."""
    first = min(n_valid, size - start)
    return [row, start, first, 0, n_valid - first, size]


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.tuples(st.integers(4, 12), st.integers(4, 12)),
    data=st.data(),
)
def test_dsa_tail_rings_of_different_sizes_match_sglang_and_land_token_for_token(sizes, data):
    build, = sglang_functions("srt/disaggregation/utils.py", "build_dsa_tail_transfer_blocks")
    s_size, d_size = sizes
    n_valid = data.draw(st.integers(0, min(sizes)))
    s_start, d_start = data.draw(st.integers(0, s_size - 1)), data.draw(st.integers(0, d_size - 1))
    slot = (3, 5)  # key and score tensors: bytes per ring slot
    src_idx, dst_idx = tail(2, n_valid, s_start, s_size), tail(1, n_valid, d_start, d_size)
    prefill = layout([state("dsa_tail", [s_size * b for b in slot])])
    decode = layout([state("dsa_tail", [d_size * b for b in slot])])
    plan = TransferPlanner(prefill, decode).plan_state(0, src_idx, dst_idx)
    ours = sorted((t.local_index, lo, ro, sz) for t in plan for lo, ro, sz in zip(*ranges(t)))
    theirs = build([0, 0], [s_size * b for b in slot], [0, 0], src_idx, dst_idx, [d_size * b for b in slot])
    assert sum(sz for *_, sz in ours) == sum(sz for *_, sz in theirs) == n_valid * sum(slot)
    # The i-th live prefill token lands in the i-th live decode slot.
    src, dst = buffers(prefill.states[0].item_lens), [np.zeros(d_size * b * CAPACITY, np.uint8) for b in slot]
    apply(plan, src, dst)
    for k, b in enumerate(slot):
        for i in range(n_valid):
            s = 2 * s_size * b + ((s_start + i) % s_size) * b
            d = 1 * d_size * b + ((d_start + i) % d_size) * b
            assert np.array_equal(dst[k][d:d + b], src[k][s:s + b])


def test_dsa_tail_errors():
    planner = TransferPlanner(layout([state("dsa_tail", [24, 0])]), layout([state("dsa_tail", [32, 0])]))
    assert planner.plan_state(0, [], []).empty  # no live tail (seq_len a multiple of the pool)
    with pytest.raises(PlanError, match="live tokens differ: prefill=2 decode=3"):
        planner.plan_state(0, tail(0, 2, 0, 6), tail(0, 3, 0, 8))
    with pytest.raises(PlanError, match="exceeds its ring of 6 slots"):
        planner.plan_state(0, [0, 5, 3, 0, 0, 6], tail(0, 3, 0, 8))
    with pytest.raises(PlanError, match="do not hold 6 and 6 slots of one size"):
        planner.plan_state(0, tail(0, 2, 0, 6), tail(0, 2, 0, 6))  # 32 bytes are not 6 slots
    with pytest.raises(PlanError, match="6-tuple"):
        planner.plan_state(0, [1, 2, 3], [1, 2, 3])
    with pytest.raises(LayoutMismatchError, match="one side elides this layer's tail"):
        TransferPlanner(layout([state("dsa_tail", [24])]), layout([state("dsa_tail", [0])]))
