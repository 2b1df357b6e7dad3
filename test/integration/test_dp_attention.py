"""DP attention on both sides: two prefill DP ranks (attention TP 1 each) into a decode running DP
attention with two DP ranks, one process per rank, as `--tp-size 2 --dp-size 2
--enable-dp-attention` places them (prefill engine_rank = tp_rank, system_dp_rank = the DP rank;
decode engine_rank = tp_rank % attn_tp_size).

Each DP rank has its own pools. A room runs on one prefill DP rank and one decode DP rank, and the
decode DP rank learns which prefill DP rank to pair with in one of SGLang's three ways
(decode.py `_resolve_prefill_dp_rank`): bootstrap_room % dp (`follow_bootstrap_room`, the default),
the router's `disagg_prefill_dp_rank` ("explicit"), or the bootstrap server's room -> DP rank
table that each prefill sender fills (`--load-balance-method round_robin`, "query"). Prefill DP
ranks hold different bytes (the pattern is keyed by the DP rank), so a page, aux row or state row
fetched from the other DP rank is a mismatch; every page and row of the other decode DP rank's
rooms must stay zero.
"""

from __future__ import annotations

import pytest
from integration_support import config

from harness.pd.plan import build_plan
from harness.pd.run import KVLayout, RoomShape

CASES = {
    # (layout, routing): MHA with state under the default routing; DeepSeek-shaped MLA with the
    # router naming the prefill DP rank; MHA with the bootstrap server's DP-rank table.
    "mha_follow_bootstrap_room": (
        KVLayout(num_layers=2, total_kv_heads=4, head_dim=16, page_size=16, state_item_bytes=(48,)),
        "follow_bootstrap_room",
    ),
    "mla_explicit_dp_rank": (KVLayout(num_layers=2, mla=True, head_dim=72, page_size=1), "explicit"),
    "mha_query_bootstrap": (KVLayout(num_layers=2, total_kv_heads=2, head_dim=32, page_size=16), "query"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_two_prefill_dp_ranks_into_dp_attention_decode(run_clean, case):
    layout, routing = CASES[case]
    cfg = config(
        rooms=16,
        prefill_dp=2,
        decode_dp=2,
        prefill_dp_routing=routing,
        layout=layout,
        shape=RoomShape(min_tokens=1, max_tokens=3 * layout.page_size + 5, chunks=2),
    )
    result = run_clean(cfg)
    plan = build_plan(cfg)
    # Every prefill DP rank and every decode DP rank served rooms, in every pairing.
    pairs = {(r.prefill_dp, r.decode_dp) for r in plan.rooms}
    assert pairs == {(0, 0), (0, 1), (1, 0), (1, 1)}, pairs
    if routing != "follow_bootstrap_room":
        # The DP rank does not follow the room id, so routing by bootstrap_room % 2 would be wrong.
        assert any(r.prefill_dp != r.room % 2 for r in plan.rooms)
    for rep in result.ranks:
        served = [o.index for o in rep.rooms]
        assert served, f"{rep.worker} served no room\n{result.summary()}"
    assert {(r.dp_rank, r.rank) for r in result.side("prefill")} == {(0, 0), (1, 1)}
    assert {(r.dp_rank, r.rank) for r in result.side("decode")} == {(0, 0), (1, 1)}


def test_deepseek_shaped_prefill_tp2_into_dp_attention_decode(run_clean):
    # DeepSeek-V3 shape at small scale: MLA with an MTP layer, prefill TP 2 (no DP attention) into
    # a decode with DP attention (2 DP ranks of attention TP 1). Each decode DP rank fetches both
    # prefill TP ranks: one sends the replicated latent KV, the other is a dummy that only
    # reports Success; the rooms of the other decode DP rank stay zero.
    layout = KVLayout(num_layers=2, mla=True, head_dim=72, page_size=16, draft_layers=1, state_item_bytes=())
    cfg = config(
        rooms=16,
        prefill_tp=2,
        decode_dp=2,
        layout=layout,
        shape=RoomShape(min_tokens=1, max_tokens=3 * layout.page_size + 5, chunks=2),
    )
    result = run_clean(cfg)
    plan = build_plan(cfg)
    assert {r.decode_dp for r in plan.rooms} == {0, 1}
    assert sorted(len(r.rooms) for r in result.side("prefill")) == [16, 16]
    assert {(r.dp_rank, r.rank) for r in result.side("decode")} == {(0, 0), (1, 1)}
