"""Prefill with pipeline parallelism (`--pp-size 2`) into a decode with PP 1, one process per PP
stage, as SGLang places them: stage s registers only its layers' KV buffers with
`prefill_start_layer = s * L/2` and `pp_rank = s`, both stages register with the bootstrap server
under their PP rank, and the decode fetches both (`target_pp_ranks = [0, 1]`) and waits for a
Success from each (`required_prefill_response_num = 2`). The stages' managers replicate their room
statuses to stage 0 (SGLang's PPConsensusStore), over the harness's stand-in PP group.

Every stage fills its metadata (aux) buffers, with different bytes per stage; only the last stage
computes the outputs, so decode must hold the last stage's aux rows, and exactly one Success per
room may carry aux. Mamba-like state is per layer: each stage sends its own layers' state tensors,
which decode pairs by layer id. DeepSeek-V3.2 DSA state (the MLA case) is registered as
DSATokenToKVPool does, one index buffer per layer of the stage and the compress tail's key then
score buffers, without layer ids: each stage's tensors must land at its prefill_start_layer in
each group of the decode's full model (issue 11 item 7). The decode's every layer is checked byte for byte against the stage that owns
it (the pattern is keyed by the global layer).
"""

from __future__ import annotations

import pytest
from integration_support import config

from harness.pd.config import DeepSeekStateSpec
from harness.pd.results import SUCCESS
from harness.pd.run import AuxBufferSpec, KVLayout, RoomShape

AUX = (AuxBufferSpec("int32", 16), AuxBufferSpec("float32", 16), AuxBufferSpec("int64", 8))
# Four layers: an index buffer per layer; the tail's 4 key buffers, then 4 score buffers (items
# of different sizes per layer, so a buffer landing on another layer's tensor shows), decode's
# tail ring 2 slots longer (speculative slots on decode only).
DSA_STATE = (
    DeepSeekStateSpec("dsa", item_bytes=(40, 48, 56, 64)),
    DeepSeekStateSpec("dsa_tail", item_bytes=(16, 24, 32, 40, 8, 16, 24, 32), ring=4, ratio=4, decode_ring=6),
)


@pytest.mark.parametrize(
    "layout",
    [
        KVLayout(num_layers=4, total_kv_heads=4, head_dim=16, page_size=16, aux=AUX),
        KVLayout(num_layers=4, mla=True, head_dim=72, page_size=1, aux=AUX, deepseek_state=DSA_STATE),
        # Mamba-like state, one tensor per layer: each stage holds its layers' tensors and
        # reports their global layer ids, and sends them with its last chunk (as Mooncake does);
        # decode pairs them by id.
        KVLayout(num_layers=4, total_kv_heads=2, head_dim=16, page_size=16, aux=AUX, state_item_bytes=(48, 40, 32, 24)),
    ],
    ids=["mha", "mla_dsa_state", "mha_mamba_state"],
)
def test_prefill_pp2_into_decode_pp1(run_clean, layout):
    cfg = config(
        rooms=16,
        prefill_pp=2,
        layout=layout,
        shape=RoomShape(min_tokens=1, max_tokens=3 * layout.page_size + 5, chunks=2),
        record_statuses=True,
    )
    result = run_clean(cfg)
    stages = sorted((r.pp_rank, len(r.rooms)) for r in result.side("prefill"))
    assert stages == [(0, 16), (1, 16)], result.summary()
    for rep in result.ranks:
        # Every room was cleared on every stage (under PP, SGLang's request_status is its
        # PPConsensusStore, replicated to stage 0).
        assert rep.tables is not None and rep.tables["sglang.request_status"] == 0, (rep.worker, rep.tables)
    (decode,) = result.side("decode")
    # SGLang's per-sender id: attn_tp_rank * pp_size + pp_rank, so stage s reports as rank s.
    last = cfg.prefill_pp - 1
    for index in range(cfg.rooms):
        seen = decode.statuses.get(index, [])
        successes = sorted(rank for rank, status, _ in seen if status == SUCCESS)
        with_aux = [rank for rank, status, aux in seen if status == SUCCESS and aux]
        assert successes == [0, 1], f"room#{index}: {seen}"
        assert with_aux == [last], f"room#{index}: aux must ride once, on the last stage's Success: {seen}"
