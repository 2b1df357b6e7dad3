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

from harness.pd.ds_state import DEEPSEEK_V32_DSA_STATE
from harness.pd.plan import build_plan
from harness.pd.results import SUCCESS
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


@pytest.mark.parametrize("state", [(), DEEPSEEK_V32_DSA_STATE], ids=["v3", "v32_dsa"])
def test_deepseek_shaped_prefill_tp4_into_dp_attention_decode(run_clean, state):
    # The DeepSeek-V3/R1 deployment at small scale: MLA with an MTP layer, prefill TP 4 into a
    # decode with DP attention (2 DP ranks of attention TP 1; 6 rank processes), and the same
    # with DeepSeek-V3.2's DSA index cache and tail (whole on every rank). Each decode DP
    # rank fetches all four prefill ranks (SGLang's target_tp_ranks [0..3]): prefill rank 0 sends
    # the replicated latent KV, draft KV and aux, ranks 1-3 are MLA dummies that conclude with
    # Success on their own. Issue 11 item 9: a dummy writes nothing and opens no engine session
    # to decode, seen from both ends: prefill's sessions, and decode's inbound connections (a
    # write needs one).
    # (get_transfer_metric is no evidence: SGLang's CommonKVSender estimates it from the indices
    # it was given, so a dummy rank reports the bytes of the pages it never sends.)
    layout = KVLayout(num_layers=2, mla=True, head_dim=72, page_size=16, draft_layers=1, deepseek_state=state)
    cfg = config(
        rooms=8,
        prefill_tp=4,
        decode_dp=2,
        layout=layout,
        shape=RoomShape(min_tokens=1, max_tokens=2 * layout.page_size + 5, chunks=2),
        record_statuses=True,
        # Seven processes import SGLang and build their managers at once: on two shared cores
        # that alone took more than the suite's default 120 s once.
        startup_timeout_s=300.0,
    )
    result = run_clean(cfg)
    summary = result.summary()
    assert {r.decode_dp for r in build_plan(cfg).rooms} == {0, 1}
    prefill = {r.rank: r for r in result.side("prefill")}
    decode = {r.dp_rank: r for r in result.side("decode")}
    assert sorted(prefill) == [0, 1, 2, 3] and sorted(decode) == [0, 1], summary
    assert all(len(r.rooms) == cfg.rooms for r in prefill.values()), summary
    decode_keys = sorted(r.engine_contacts["key"] for r in decode.values())
    assert prefill[0].engine_contacts["sessions"] == decode_keys, summary
    for rank in (1, 2, 3):
        assert prefill[rank].engine_contacts["sessions"] == [], (rank, prefill[rank].engine_contacts)
    for rep in decode.values():
        assert rep.engine_contacts["inbound"] == [prefill[0].engine_contacts["key"]], rep.engine_contacts
        for o in rep.rooms:
            # Decode waits for one response (MLA): rank 0's Success, with aux. The dummies end
            # their rooms on their own (every prefill rank polled Success: run_clean) and tell
            # decode nothing.
            assert rep.statuses[o.index] == [(0, SUCCESS, True)], rep.statuses[o.index]
