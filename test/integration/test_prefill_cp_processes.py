"""Prefill context parallel (`--enable-prefill-cp --attn-cp-size 2 --cp-strategy zigzag`) into a
decode without CP, one process per CP rank, SGLang's real classes on both sides: both CP ranks
register with the bootstrap server under their CP rank and hold the same KV, state and aux.

With `SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER=1` on both servers each CP rank sends its share
of every chunk's pages; decode registers with both (telling them it waits for every CP rank, which
they check) and waits for a Success from each (`required_prefill_response_num = 2`); state goes
from CP rank 0 only and aux rides on rank 0's Success only. Decode's every page, state slot and aux
row is checked byte for byte.

SGLang's default (no flag): CP rank 0 sends every page, the state and aux, and CP rank 1 is a dummy
that decode never asks; its rooms end on their own and it opens no engine session.

That each byte is written once and the refusal of the flag on one side only are proven in-process,
through SGLang's own page selection (test/inprocess/test_prefill_context_parallel.py).
"""

from __future__ import annotations

from integration_support import config

from harness.pd.results import SUCCESS
from harness.pd.run import AuxBufferSpec, KVLayout, RoomShape

AUX = (AuxBufferSpec("int32", 16), AuxBufferSpec("float32", 16))
ALL_CP_RANKS = {"SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER": "1"}


LAYOUT = KVLayout(num_layers=2, total_kv_heads=2, head_dim=16, page_size=4, aux=AUX, state_item_bytes=(48, 40))


def cp2_config(**overrides):
    """12 chunked rooms from a prefill CP 2 into a decode without CP, with state and aux."""
    return config(rooms=12, prefill_cp=2, layout=LAYOUT, record_statuses=True,
                  shape=RoomShape(min_tokens=1, max_tokens=6 * LAYOUT.page_size + 3, chunks=2), **overrides)


def test_every_cp_rank_sends_its_share_into_a_decode_without_cp(run_clean):
    cfg = cp2_config(env=ALL_CP_RANKS)
    result = run_clean(cfg)
    assert sorted((r.rank, len(r.rooms)) for r in result.side("prefill")) == [(0, 12), (1, 12)], result.summary()
    for rep in result.side("prefill"):
        assert rep.tables is not None and not any(rep.tables.values()), (rep.worker, rep.tables)
    (decode,) = result.side("decode")
    senders = [0, 1]
    for index in range(cfg.rooms):
        seen = decode.statuses.get(index, [])
        # SGLang's per-sender id is the CP rank here (attn_tp_rank * pp * cp + pp_rank * cp + cp_rank).
        assert sorted(rank for rank, status, _ in seen if status == SUCCESS) == senders, f"room#{index}: {seen}"
        assert [rank for rank, status, aux in seen if aux] == [0], f"room#{index}: aux once, from CP rank 0: {seen}"


def test_by_default_cp_rank_0_sends_everything_and_rank_1_stays_silent(run_clean):
    cfg = cp2_config()
    result = run_clean(cfg)  # every prefill rank polled Success, decode byte-exact
    prefill = {r.rank: r for r in result.side("prefill")}
    assert sorted((rank, len(r.rooms)) for rank, r in prefill.items()) == [(0, 12), (1, 12)], result.summary()
    (decode,) = result.side("decode")
    assert prefill[0].engine_contacts["sessions"] == [decode.engine_contacts["key"]], prefill[0].engine_contacts
    assert prefill[1].engine_contacts["sessions"] == [], prefill[1].engine_contacts
    assert decode.engine_contacts["inbound"] == [prefill[0].engine_contacts["key"]], decode.engine_contacts
    for index in range(cfg.rooms):
        assert decode.statuses.get(index) == [(0, SUCCESS, True)], f"room#{index}: {decode.statuses.get(index)}"
