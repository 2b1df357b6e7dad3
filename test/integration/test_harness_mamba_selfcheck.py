"""The harness's Qwen3-Next-shaped mamba state, without processes: each rank's tensors hold the
TP shard SGLang's MambaPool holds (Qwen3-Next's GDN layout, Kimi-Linear's transposed conv, a
replicated slot sibling), and the byte checker catches a wrong shard, a conv state cut without
its q/k/v sub-blocks or on the wrong axis, a missing head or replica and a stray write, so
test_hybrid_mamba_tp.py cannot pass by looking away.

The reference here does not use the harness's position arithmetic: it takes the unsharded model
(a TP 1 pool) and shards it with torch split/chunk, as SGLang's weights are sharded (each of q,
k, v chunked over TP on its own, then concatenated; temporal state chunked on its heads).
"""

from __future__ import annotations

import pytest
import torch

from harness.pd.config import HarnessConfig, HybridMambaShape, KVLayout, RoomShape
from harness.pd.plan import build_plan
from harness.pd.pool import RankPool
from harness.pd.results import SUCCESS, RankReport, RoomOutcome
from harness.pd.verify import verify_decode

SHAPE = HybridMambaShape(num_key_heads=2, num_value_heads=4, head_k_dim=4, head_v_dim=2, conv_kernel=4)
# Kimi-Linear's conv [K-1, v | k | k] and a short-conv sibling whole on every rank.
KIMI = HybridMambaShape(num_key_heads=2, num_value_heads=4, head_k_dim=2, head_v_dim=2, conv_kernel=3,
                        kimi=True, replicated_conv=True)
LAYOUT = KVLayout(num_layers=2, total_kv_heads=2, head_dim=8, page_size=4, mamba=SHAPE)
TP_PAIRS = [(1, 2), (2, 1)]
SHAPES = {"qwen3_next": SHAPE, "kimi_linear": KIMI}


def _cfg(prefill_tp: int, decode_tp: int, shape: HybridMambaShape = SHAPE) -> HarnessConfig:
    return HarnessConfig(rooms=6, layout=KVLayout(num_layers=2, total_kv_heads=2, head_dim=8, page_size=4, mamba=shape),
                         prefill_tp=prefill_tp, decode_tp=decode_tp, shape=RoomShape(1, 20, chunks=2))


def _shard(full: torch.Tensor, spec, tp: int, rank: int) -> torch.Tensor:
    """SGLang's TP shard of one unsharded state row: every sub-block of the sliced axis (the
    first per-slot axis, Kimi's conv the second) chunked on its own; replicated: whole."""
    if spec.replicated:
        return full.clone()
    axis = 1 if spec.outer > 1 else 0
    blocks = torch.split(full, list(spec.groups), dim=axis)
    return torch.cat([torch.chunk(b, tp, dim=axis)[rank] for b in blocks], dim=axis)


def _whole(cfg: HarnessConfig, plan) -> RankPool:
    """The unsharded model: a TP 1 prefill pool holds every KV head and every state position."""
    whole = RankPool(cfg.replace(prefill_tp=1), plan, "prefill", 0)
    whole.fill_prefill()
    return whole


def _transferred(prefill_tp: int, decode_tp: int, shape: HybridMambaShape = SHAPE):
    """Decode pools of every rank after a correct transfer, done by hand from the whole model."""
    cfg = _cfg(prefill_tp, decode_tp, shape)
    plan = build_plan(cfg)
    whole = _whole(cfg, plan)
    ps = cfg.layout.page_size
    decode = []
    for rank in range(decode_tp):
        dst = RankPool(cfg, plan, "decode", rank)
        heads = slice(dst.head_offset, dst.head_offset + dst.heads)
        for room in plan.rooms:
            for s, d in zip(whole.kv, dst.kv):
                for p, q in zip(room.prefill_pages, room.decode_pages):
                    d[q * ps:(q + 1) * ps] = s[p * ps:(p + 1) * ps, heads]
            for s, d in zip(whole.aux, dst.aux):
                d[room.decode_aux] = s[room.prefill_aux]
            for spec, s, d in zip(dst.mamba_specs, whole.state, dst.state):
                d[room.decode_state] = _shard(s[room.prefill_state], spec, decode_tp, rank)
        decode.append(dst)
    outcomes = [RoomOutcome(index=r.index, room=r.room, status=SUCCESS) for r in plan.rooms]
    return cfg, plan, whole, decode, outcomes


def _verify(plan, dst, outcomes) -> RankReport:
    report = RankReport(side="decode", rank=dst.tp_rank, pid=0)
    verify_decode(dst, plan, outcomes, report)
    return report


def test_registered_like_sglangs_mamba_pool():
    cfg = _cfg(1, 2)
    pool = RankPool(cfg, build_plan(cfg), "decode", 1)
    from sglang.srt.disaggregation.base.conn import KVArgs, StateType

    a = pool.kv_args(KVArgs)
    mamba_layers = [0, 1, 2, 4, 5, 6]  # Qwen3-Next: three linear-attention layers, then one full
    assert a.kv_layer_ids == [3, 7, 3, 7]
    assert a.state_types == [StateType.MAMBA]
    assert a.state_layer_ids == [mamba_layers * 2]  # conv of every layer, then temporal
    # Local sizes of the sliced axis: conv (8 + 8 + 8) / 2, temporal 4 heads / 2.
    assert a.state_dim_per_tensor == [[12] * 6 + [2] * 6]
    assert a.state_slice_outer_counts == [[1] * 12]
    assert a.state_conv_shard_groups == [[[8, 8, 8]] * 6 + [None] * 6]
    conv, temporal = pool.state[0], pool.state[6]
    assert conv.dtype == torch.bfloat16 and conv.shape[1:] == (12, 3)
    assert temporal.dtype == torch.float32 and temporal.shape[1:] == (2, 2, 4)
    assert a.state_item_lens == [[12 * 3 * 2] * 6 + [2 * 2 * 4 * 4] * 6]


def test_kimi_linear_registered_like_sglangs_mamba_pool_and_its_sibling():
    cfg = _cfg(1, 2, KIMI)
    pool = RankPool(cfg, build_plan(cfg), "decode", 0)
    from sglang.srt.disaggregation.base.conn import KVArgs

    a = pool.kv_args(KVArgs)
    assert a.state_layer_ids == [[0, 1, 2, 4, 5, 6] * 3]  # conv, temporal, then the sibling's
    # conv [K-1 = 2, (8 + 4 + 4) / 2], temporal 4 heads / 2, short conv whole (dim 0).
    assert a.state_dim_per_tensor == [[8] * 6 + [2] * 6 + [0] * 6]
    assert a.state_slice_outer_counts == [[2] * 6 + [1] * 12]
    assert a.state_conv_shard_groups == [[[8, 4, 4]] * 6 + [None] * 12]
    assert pool.state[0].shape[1:] == (2, 8) and pool.state[12].shape[1:] == (8, 2)


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_prefill_shards_are_sglangs_q_k_v_head_shards(shape):
    cfg = _cfg(2, 1, shape)
    plan = build_plan(cfg)
    whole = _whole(cfg, plan)
    for rank in range(2):
        pool = RankPool(cfg, plan, "prefill", rank)
        pool.fill_prefill()
        for spec, s, w in zip(pool.mamba_specs, pool.state, whole.state):
            for slot in range(s.shape[0]):
                assert torch.equal(s[slot].view(torch.uint8), _shard(w[slot], spec, 2, rank).view(torch.uint8))
        # Not the same as cutting the conv axis in one block: the sub-blocks matter.
        conv, full = pool.state[0][0], whole.state[0][0]
        assert not torch.equal(conv.view(torch.uint8), torch.chunk(full, 2, dim=0)[rank].view(torch.uint8))


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("prefill_tp,decode_tp", TP_PAIRS, ids=["tp1to2", "tp2to1"])
def test_checker_accepts_a_correct_transfer(prefill_tp, decode_tp, shape):
    _, plan, _, decode, outcomes = _transferred(prefill_tp, decode_tp, shape)
    for dst in decode:
        report = _verify(plan, dst, outcomes)
        assert report.mismatch_count == 0, report.mismatches
        assert report.checked_bytes > 0


def test_checker_catches_the_other_ranks_shard():
    _, plan, whole, decode, outcomes = _transferred(1, 2)
    room, dst = plan.rooms[2], decode[0]
    spec = dst.mamba_specs[7]  # temporal state: rank 1's heads land on rank 0
    dst.state[7][room.decode_state] = _shard(whole.state[7][room.prefill_state], spec, 2, 1)
    report = _verify(plan, dst, outcomes)
    assert report.mismatch_count == 1, report.mismatches
    assert "room#2 state tensor 7" in report.mismatches[0]
    assert "global position 0 holds the bytes of global position 2" in report.mismatches[0]


def test_checker_catches_a_conv_state_cut_without_its_sub_blocks():
    # What a backend ignoring state_conv_shard_groups writes: the first half of cat(q, k, v).
    _, plan, whole, decode, outcomes = _transferred(1, 2)
    room, dst = plan.rooms[4], decode[1]
    full = whole.state[1][room.prefill_state]
    dst.state[1][room.decode_state] = torch.chunk(full, 2, dim=0)[1]
    report = _verify(plan, dst, outcomes)
    assert report.mismatch_count == 1, report.mismatches
    assert "room#4 state tensor 1 (layer 1, conv)" in report.mismatches[0]
    assert "wrong shard or sub-block" in report.mismatches[0]


def test_checker_catches_a_kimi_conv_cut_on_the_wrong_axis_and_a_missing_replica():
    _, plan, whole, decode, outcomes = _transferred(1, 2, KIMI)
    room, dst = plan.rooms[3], decode[1]
    # Cut on the first per-slot axis as for GDN (rank 1's half of the K-1 rows), poured into
    # the slot: wrong for Kimi's [K-1, dim].
    full = whole.state[2][room.prefill_state]
    dst.state[2][room.decode_state] = torch.chunk(full, 2, dim=0)[1].reshape(2, 8)
    dst.state[13][room.decode_state] = 0  # the short-conv replica never reached this rank
    text = "\n".join(_verify(plan, dst, outcomes).mismatches)
    assert "room#3 state tensor 2 (layer 2, conv)" in text and "wrong shard or sub-block" in text
    assert "room#3 state tensor 13 (layer 1, short conv)" in text and "zeros (never written)" in text


def test_checker_catches_a_missing_head_and_a_stray_state_write():
    _, plan, _, decode, outcomes = _transferred(2, 1)
    dst = decode[0]
    dst.state[9][plan.rooms[1].decode_state, 3] = 0  # the last value head never arrived
    spare = next(i for i in range(plan.decode_state_slots) if i not in {r.decode_state for r in plan.rooms})
    dst.state[0][spare, 5] = 1.0
    text = "\n".join(_verify(plan, dst, outcomes).mismatches)
    assert "room#1 state tensor 9" in text and "zeros (never written)" in text
    assert "state buffer 0: unassigned rows" in text


def test_config_refuses_what_the_mamba_layout_cannot_shard():
    with pytest.raises(ValueError, match="do not split over TP 4"):
        _cfg(1, 4).replace(layout=KVLayout(total_kv_heads=4, mamba=HybridMambaShape(num_key_heads=2))).validate()
    with pytest.raises(ValueError, match="do not combine"):
        _cfg(1, 1).replace(layout=KVLayout(state_item_bytes=(8,), mamba=SHAPE)).validate()
