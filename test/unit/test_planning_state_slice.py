"""Mamba state with different prefill / decode attention-TP sizes: sliced, byte-exact.

Each test builds the model's full state, shards it for the prefill and the decode TP as SGLang's
mamba pool does (slice axis per tensor, Kimi's outer rows, GDN's independently sharded q/k/v
sub-blocks, tensors whole on every rank), plans every (prefill rank, decode rank) pair SGLang
connects, applies the plans and checks every byte of every decode buffer.
"""

from harness.plan_ranges import ranges
import ast
import importlib.util
import itertools
import typing
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_mori.planning import (
    KVLayout,
    LayoutMismatchError,
    StateLayout,
    TransferPlanner,
    UnsupportedLayoutError,
    decode_ranks_for_prefill_rank,
)

SLOTS = 4
TP_PAIRS = [(1, 2), (2, 1), (1, 4), (4, 2), (2, 4), (4, 1), (2, 2)]


def sglang_functions(relative_path, *names):
    """Compile pure functions from SGLang's source without importing SGLang (seconds)."""
    root = Path(importlib.util.find_spec("sglang").submodule_search_locations[0])
    tree = ast.parse((root / relative_path).read_text())
    nodes = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
    namespace = {k: getattr(typing, k) for k in ("List", "Optional", "Tuple", "Sequence")}
    exec(compile(ast.Module(body=nodes, type_ignores=[]), relative_path, "exec"), namespace)
    return [namespace[n] for n in names]


class Tensor:
    """One state tensor of the model: `outer` rows of an axis of sub-blocks `groups`, `unit` bytes."""

    def __init__(self, groups, outer=1, unit=2, replicated=False, seed=0):
        self.groups, self.outer, self.unit, self.replicated = tuple(groups), outer, unit, replicated
        rng = np.random.default_rng(seed)
        # Full data per slot: [SLOTS, outer, full axis, unit] bytes.
        self.full = rng.integers(0, 256, (SLOTS, outer, sum(groups), unit), dtype=np.uint8)

    def local_dim(self, tp):
        return 0 if self.replicated else sum(self.groups) // tp

    def shard(self, tp, rank):
        """[SLOTS, item bytes] of one rank: its part of every sub-block, in sub-block order."""
        if self.replicated:
            return self.full.reshape(SLOTS, -1).copy()
        parts, base = [], 0
        for g in self.groups:
            part = g // tp
            parts.append(self.full[:, :, base + rank * part: base + (rank + 1) * part])
            base += g
        return np.concatenate(parts, axis=2).reshape(SLOTS, -1).copy()

    def item_len(self, tp):
        return self.shard(tp, 0).shape[1]


def layout(tensors, tp, rank, report_groups=True):
    mamba = StateLayout(
        state_type="mamba",
        item_lens=tuple(t.item_len(tp) for t in tensors),
        data_lens=tuple(t.item_len(tp) * SLOTS for t in tensors),
        slice_dims=tuple(t.local_dim(tp) for t in tensors),
        outer_counts=tuple(t.outer for t in tensors),
        conv_groups=tuple(t.groups if report_groups and len(t.groups) > 1 else () for t in tensors),
    )
    # Hybrid MLA full-attention KV (any rank pair copies it whole): the state is what is tested.
    return KVLayout(is_mla=True, tp_size=tp, tp_rank=rank, page_size=1, kv_cache_dtype="bf16",
                    kv_item_lens=(64,), kv_data_lens=(64 * 4,), states=(mamba,))


def transfer_all(tensors, p_tp, d_tp, src_slot, dst_slot):
    """Decode buffers after every paired prefill rank wrote; untouched bytes are 0xEE."""
    decode = {r: [np.full(t.item_len(d_tp) * SLOTS, 0xEE, np.uint8) for t in tensors] for r in range(d_tp)}
    for p in range(p_tp):
        src = [t.shard(p_tp, p).ravel() for t in tensors]
        for r in decode_ranks_for_prefill_rank(p_tp, p, d_tp):
            planner = TransferPlanner(layout(tensors, p_tp, p), layout(tensors, d_tp, r))
            for tr in planner.plan_state(0, [src_slot], [dst_slot]):
                for lo, ro, sz in zip(*ranges(tr)):
                    decode[r][tr.remote_index][ro:ro + sz] = src[tr.local_index][lo:lo + sz]
    return decode


def check_exact(tensors, p_tp, d_tp, src_slot=1, dst_slot=2):
    decode = transfer_all(tensors, p_tp, d_tp, src_slot, dst_slot)
    for r in range(d_tp):
        for k, t in enumerate(tensors):
            expected = np.full((SLOTS, t.item_len(d_tp)), 0xEE, np.uint8)
            # What the decode rank would hold had it computed the state itself, from the prefill slot.
            expected[dst_slot] = t.shard(d_tp, r)[src_slot]
            assert np.array_equal(decode[r][k].reshape(SLOTS, -1), expected), (p_tp, d_tp, r, k)


def qwen3_next_layer(seed=0):
    """GDN: conv state [q | k | v] x (kernel - 1), temporal state [heads, head_dim, state]."""
    return [Tensor([8, 8, 16], outer=1, unit=3, seed=seed), Tensor([8], outer=1, unit=4, seed=seed + 1)]


@pytest.mark.parametrize("p_tp, d_tp", [(1, 2), (2, 1), (1, 4), (4, 2)])
def test_qwen3_next_shaped_state_is_byte_exact(p_tp, d_tp):
    check_exact(qwen3_next_layer() + qwen3_next_layer(seed=7), p_tp, d_tp)


@pytest.mark.parametrize("p_tp, d_tp", [(1, 2), (2, 1), (1, 4), (4, 2)])
def test_kimi_conv_state_rows_and_replicated_tensors_are_byte_exact(p_tp, d_tp):
    # Kimi conv state: [K-1, dim] per slot (slice on the second axis); a replicated tensor.
    check_exact([Tensor([16], outer=3, unit=2), Tensor([5], unit=2, replicated=True)], p_tp, d_tp)


@settings(max_examples=40, deadline=None)
@given(
    tp=st.sampled_from(TP_PAIRS),
    shapes=st.lists(
        st.tuples(st.lists(st.sampled_from([4, 8, 12]), min_size=1, max_size=3),
                  st.integers(1, 3), st.integers(1, 4), st.booleans()),
        min_size=1, max_size=3,
    ),
    slots=st.tuples(st.integers(0, SLOTS - 1), st.integers(0, SLOTS - 1)),
)
def test_any_mamba_shape_is_byte_exact(tp, shapes, slots):
    tensors = [Tensor(g, outer, unit, replicated=rep and len(g) == 1, seed=k)
               for k, (g, outer, unit, rep) in enumerate(shapes)]
    check_exact(tensors, *tp, *slots)


def test_blocks_match_sglang_for_every_pair_it_connects():
    compute, = sglang_functions(
        "srt/disaggregation/utils.py", "compute_mamba_state_slice_byte_blocks"
    )
    helpers = sglang_functions("srt/disaggregation/utils.py", "compute_mamba_state_slice_blocks",
                               "should_send_replicated_state")
    compute.__globals__.update(zip(("compute_mamba_state_slice_blocks", "should_send_replicated_state"),
                                   helpers))
    cases = [Tensor([8, 8, 16], unit=3), Tensor([16], outer=3, unit=2), Tensor([4], unit=1, replicated=True)]
    checked = 0
    for (p_tp, d_tp), t in itertools.product([p for p in TP_PAIRS if p[0] != p[1]], cases):
        for p in range(p_tp):
            for r in decode_ranks_for_prefill_rank(p_tp, p, d_tp):
                plan = TransferPlanner(layout([t], p_tp, p), layout([t], d_tp, r)).plan_state(0, [0], [0])
                ours = sorted(zip(*ranges(plan.transfers[0]))) if plan.transfers else []
                theirs = compute(
                    src_item_len=t.item_len(p_tp), dst_item_len=t.item_len(d_tp),
                    src_dim=t.local_dim(p_tp), dst_dim=t.local_dim(d_tp), outer_count=t.outer,
                    src_attn_tp_size=p_tp, dst_attn_tp_size=d_tp, dst_tp_rank_in_group=r,
                    local_tp_rank_in_group=p,
                    conv_shard_groups=list(t.groups) if len(t.groups) > 1 else None,
                )
                # Ours merges blocks that continue each other on both sides; compare bytes moved.
                assert expand(ours) == expand(theirs), (p_tp, d_tp, p, r, t.groups, t.outer)
                checked += 1
    assert checked > 40


def expand(blocks):
    return sorted((lo + k, ro + k) for lo, ro, size in blocks for k in range(size))


def test_equal_tp_copies_whole_slots():
    tensors = qwen3_next_layer()
    plan = TransferPlanner(layout(tensors, 2, 1), layout(tensors, 2, 1)).plan_state(0, [3], [0])
    assert [t.num_ranges for t in plan] == [1, 1]
    check_exact(tensors, 2, 2)


def test_one_slot_is_one_batch_of_few_ranges():
    # GDN conv state: one range per sub-block, not per byte or per head.
    plan = TransferPlanner(layout(qwen3_next_layer(), 1, 0), layout(qwen3_next_layer(), 2, 1)).plan_state(0, [1], [2])
    assert [t.num_ranges for t in plan] == [3, 1]


def test_replicated_state_is_written_by_one_prefill_rank_of_each_group():
    t = [Tensor([4], replicated=True)]
    writers = [p for p in range(4) if TransferPlanner(layout(t, 4, p), layout(t, 2, p // 2)).plan_state(0, [0], [0]).transfers]
    assert writers == [0, 2]


def test_inconsistent_slice_metadata_is_refused_naming_both_sides():
    t = qwen3_next_layer()
    good = layout(t, 2, 0)
    src = layout(t, 1, 0)
    bad_states = (StateLayout(**{**_fields(good.states[0]), "slice_dims": (16, 2)}),)
    bad = KVLayout(**{**_fields(good), "states": bad_states})
    with pytest.raises(LayoutMismatchError, match=r"state 'mamba' tensor 1->1 slice dim: prefill=8 x TP 1 decode=2 x TP 2"):
        TransferPlanner(src, bad)
    replicated = (StateLayout(**{**_fields(good.states[0]), "slice_dims": (16, 0)}),)
    with pytest.raises(LayoutMismatchError, match=r"tensor 1->1 slice dim: prefill=8 decode=0"):
        TransferPlanner(src, KVLayout(**{**_fields(good), "states": replicated}))
    groups = (StateLayout(**{**_fields(good.states[0]), "conv_groups": ((16, 8, 8), ())}),)
    with pytest.raises(LayoutMismatchError, match=r"conv sub-blocks: prefill=\[8, 8, 16\] decode=\[16, 8, 8\]"):
        TransferPlanner(src, KVLayout(**{**_fields(good), "states": groups}))


def test_sub_blocks_that_do_not_split_over_tp_are_refused():
    t = [Tensor([6, 6], unit=1)]
    with pytest.raises(UnsupportedLayoutError, match="sub-block of 6 entries does not split over prefill TP 1 and decode TP 4"):
        TransferPlanner(layout(t, 1, 0), KVLayout(**{**_fields(layout(t, 1, 0)), "tp_size": 4, "tp_rank": 0,
                                                      "states": (StateLayout(**{**_fields(layout(t, 1, 0).states[0]),
                                                                                "item_lens": (3,), "slice_dims": (3,)}),)}))


def _fields(struct):
    return {name: getattr(struct, name) for name in struct.__struct_fields__}
