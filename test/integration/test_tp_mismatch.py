"""Prefill and decode with different attention-TP sizes, one process per TP rank, and one
prefill serving two decode instances.

MHA: KV heads are split over TP ranks, so 1->2 means each decode rank takes half the heads of the
single prefill rank (head slicing inside every page), and 2->1 means the decode rank assembles its
heads from both prefill ranks. MLA: the latent buffer is replicated, so any one prefill rank
supplies it (2->1: SGLang sends from one rank and the other acts as a dummy; 1->2: both decode
ranks receive the full buffer).
"""

from __future__ import annotations

import pytest
from integration_support import config

from harness.pd.run import KVLayout, RoomShape


@pytest.mark.parametrize("prefill_tp,decode_tp", [(1, 2), (2, 1)],
                         ids=["tp1to2", "tp2to1"])
def test_mha_heads_split_across_ranks(run_clean, prefill_tp, decode_tp):
    cfg = config(
        rooms=64,
        prefill_tp=prefill_tp,
        decode_tp=decode_tp,
        layout=KVLayout(num_layers=2, total_kv_heads=4, head_dim=32, page_size=16),
        shape=RoomShape(min_tokens=1, max_tokens=80, chunks=2),
    )
    result = run_clean(cfg)
    heads = {r.rank: r.checked_bytes for r in result.side("decode")}
    assert len(heads) == decode_tp and all(v > 0 for v in heads.values())


@pytest.mark.parametrize("prefill_tp,decode_tp", [(1, 2), (2, 1)],
                         ids=["tp1to2", "tp2to1"])
def test_mla_replicated_latent(run_clean, prefill_tp, decode_tp):
    cfg = config(
        rooms=64,
        prefill_tp=prefill_tp,
        decode_tp=decode_tp,
        layout=KVLayout(num_layers=2, mla=True, head_dim=72, page_size=1),
        shape=RoomShape(min_tokens=1, max_tokens=40, chunks=2),
    )
    run_clean(cfg)


def test_one_prefill_two_decode_instances(run_clean):
    # 1P-2D: two independent decode servers (each TP 2, own engine, own pools) register with the
    # same prefill rank and share its rooms. Each instance must get exactly its rooms' heads, and
    # the pages it holds for the other instance's rooms must stay zero (no cross-delivery).
    cfg = config(
        rooms=64,
        decode_tp=2,
        decode_instances=2,
        layout=KVLayout(num_layers=2, total_kv_heads=4, head_dim=16, page_size=16, state_item_bytes=()),
        shape=RoomShape(min_tokens=1, max_tokens=80, chunks=2),
    )
    result = run_clean(cfg)
    assert {(r.instance, r.rank) for r in result.side("decode")} == {(0, 0), (0, 1), (1, 0), (1, 1)}
