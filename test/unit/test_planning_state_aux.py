"""Aux and hybrid-state plans; unsupported state types fail at registration."""

from harness.plan_ranges import ranges
import numpy as np
import pytest

from sglang_mori.planning import (
    KVLayout,
    LayoutMismatchError,
    PlanError,
    StateLayout,
    TransferPlanner,
    UnsupportedLayoutError,
)

ITEM = 16 * 2 * 8 * 2


def layout(states=(), tp_size=1, tp_rank=0, is_mla=False, **fields) -> KVLayout:
    values = dict(
        is_mla=is_mla, tp_size=tp_size, tp_rank=tp_rank, page_size=16, kv_cache_dtype="bfloat16",
        kv_item_lens=(ITEM // tp_size,) * 2, kv_data_lens=(ITEM * 8,) * 2,
        total_kv_head_num=0 if is_mla else 2, states=tuple(states),
    )
    values.update(fields)
    return KVLayout(**values)


def state(state_type, item_lens, capacity=10, layer_ids=()):
    return StateLayout(
        state_type=state_type, item_lens=tuple(item_lens),
        data_lens=tuple(i * capacity for i in item_lens), layer_ids=tuple(layer_ids),
    )


def apply(plan, src_buffers, dst_buffers):
    for t in plan:
        for lo, ro, sz in zip(*ranges(t)):
            dst_buffers[t.remote_index][ro : ro + sz] = src_buffers[t.local_index][lo : lo + sz]


# --- state ---------------------------------------------------------------------------------

def test_mamba_copies_the_whole_slot_of_each_layer():
    states = [state("mamba", [96, 96, 48], capacity=5)]
    planner = TransferPlanner(layout(states), layout(states))
    plan = planner.plan_state(0, np.array([4]), np.array([1]))
    assert plan.kind == "state:mamba" and plan.component == 0
    assert [ranges(t) for t in plan] == [([384], [96], [96]), ([384], [96], [96]), ([192], [48], [48])]
    with pytest.raises(PlanError, match="exactly one index per request, got prefill=2 decode=2"):
        planner.plan_state(0, [1, 2], [1, 2])
    with pytest.raises(PlanError, match=r"decode mamba state tensor 0: state index 5 out of range \(limit 5"):
        planner.plan_state(0, [1], [5])


def test_paged_state_runs_are_merged_and_bytes_exact():
    states = [state("swa", [32, 64], capacity=12)]
    planner = TransferPlanner(layout(states), layout(states))
    rng = np.random.default_rng(0)
    src_buffers = [rng.integers(0, 256, 32 * 12, dtype=np.uint8), rng.integers(0, 256, 64 * 12, dtype=np.uint8)]
    dst_buffers = [np.zeros_like(b) for b in src_buffers]
    src, dst = [2, 3, 4, 9], [0, 1, 2, 3]
    plan = planner.plan_state(0, src, dst)
    assert [t.num_ranges for t in plan] == [2, 2]  # runs 2..4 -> 0..2 and 9 -> 3
    apply(plan, src_buffers, dst_buffers)
    for buf_src, buf_dst, item in zip(src_buffers, dst_buffers, (32, 64)):
        expected = np.zeros_like(buf_dst)
        for s, d in zip(src, dst):
            expected[d * item : (d + 1) * item] = buf_src[s * item : (s + 1) * item]
        assert np.array_equal(buf_dst, expected)


def test_paged_state_lists_of_unequal_length_are_cut_and_reported():
    states = [state("dsa", [32])]
    plan = TransferPlanner(layout(states), layout(states)).plan_state(0, [1, 2, 3], [5, 6])
    assert plan.dropped == 1 and plan.total_bytes == 64
    assert TransferPlanner(layout(states), layout(states)).plan_state(0, [], [5]).empty


def test_elided_dsa_tensors_are_skipped():
    prefill = [state("dsa", [32, 0, 32])]
    decode = [state("dsa", [32, 32, 0])]
    plan = TransferPlanner(layout(prefill), layout(decode)).plan_state(0, [1], [1])
    assert [(t.local_index, t.remote_index) for t in plan] == [(0, 0)]


def test_state_tensors_pair_by_layer_id_when_counts_differ():
    prefill = [state("mamba", [16, 16], layer_ids=[4, 6])]  # a PP stage holds two mamba layers
    decode = [state("mamba", [16, 16, 16, 16], layer_ids=[0, 2, 4, 6])]
    plan = TransferPlanner(layout(prefill), layout(decode)).plan_state(0, [1], [2])
    assert [(t.local_index, t.remote_index) for t in plan] == [(0, 2), (1, 3)]
    with pytest.raises(UnsupportedLayoutError, match="needs layer ids from both sides"):
        TransferPlanner(layout([state("mamba", [16, 16])]), layout([state("mamba", [16, 16, 16])]))


def test_state_item_length_mismatch_names_both_values():
    with pytest.raises(LayoutMismatchError, match="state 'swa' tensor 1->1 item_len: prefill=32 decode=64"):
        TransferPlanner(layout([state("swa", [32, 32])]), layout([state("swa", [32, 64])]))


def test_unknown_state_types_fail_at_registration():
    states = [state("swa", [32]), state("future_state", [32])]
    with pytest.raises(UnsupportedLayoutError, match=r"state type 'future_state' \(state component 1\) is not supported"):
        TransferPlanner(layout(states), layout(states))


def tp_pair(states, is_mla=False):
    # prefill TP 1 -> decode TP 2 (rank 1); MHA KV item lengths halve with the heads.
    return layout(states, is_mla=is_mla), layout(states, tp_size=2, tp_rank=1, is_mla=is_mla,
                                                  kv_item_lens=(ITEM,) * 2 if is_mla else (ITEM // 2,) * 2)


def test_mamba_without_slice_dims_with_tp_mismatch_fails_at_registration():
    with pytest.raises(UnsupportedLayoutError, match=r"'mamba'.*prefill TP 1 and decode TP 2.*state_dim_per_tensor"):
        TransferPlanner(*tp_pair([state("mamba", [16])]))


def test_replicated_state_is_copied_whole_across_tp_sizes():
    # The DSA index cache, and MLA SWA, are the same on every rank (SGLang copies them too).
    TransferPlanner(*tp_pair([state("dsa", [16])]))
    planner = TransferPlanner(*tp_pair([state("swa", [16])], is_mla=True))
    assert planner.plan_state(0, [1, 2], [3, 4]).num_ranges == 1


def test_unknown_component_is_a_plan_error():
    with pytest.raises(PlanError, match="state component 2 does not exist"):
        TransferPlanner(layout(), layout()).plan_state(2, [1], [1])
