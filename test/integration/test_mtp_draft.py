"""MTP / EAGLE speculative decoding: the draft model's KV and the draft aux.

With a draft model SGLang registers its KV buffers after the target's on both sides
(`kv_data_ptrs += draft buffers`, `num_draft_entries` = their count: K and V per draft layer for
MHA, one latent buffer per draft layer for MLA), and the metadata buffers gain the draft's
inputs for the first decode step: top-k probabilities (float32), top-k token ids (int64) and the
last hidden state (bf16). The draft buffers hold their own bytes (the pattern has draft kinds), so
a draft layer written into a target layer, or the reverse, is a mismatch; the aux rows are checked
whole, the draft ones included.

Cases: MHA with the heads split across prefill TP 2 -> decode TP 1 (the draft KV is head-sliced
like the target's), and a small DeepSeek-shaped run: MLA with DP attention on both sides (two
prefill DP ranks into two decode DP ranks) and one MTP layer.
"""

from __future__ import annotations

import pytest
from integration_support import config

from harness.pd.plan import build_plan
from harness.pd.pool import RankPool
from harness.pd.run import AuxBufferSpec, KVLayout, RoomShape

# SGLang's MetadataBuffers order: output ids, cached tokens, logprobs..., then the draft's
# top-k p, top-k index and hidden states (the widths are small stand-ins).
DRAFT_AUX = (
    AuxBufferSpec("int32", 16),
    AuxBufferSpec("float32", 16),
    AuxBufferSpec("int64", 8),
    AuxBufferSpec("float32", 16),  # output_topk_p
    AuxBufferSpec("int64", 16),  # output_topk_index
    AuxBufferSpec("bfloat16", 64),  # output_hidden_states
)

CASES = {
    "mha_tp2to1": dict(
        prefill_tp=2,
        decode_tp=1,
        layout=KVLayout(num_layers=2, total_kv_heads=4, head_dim=16, page_size=16, draft_layers=1, aux=DRAFT_AUX),
    ),
    "mla_dp_attention": dict(
        prefill_dp=2,
        decode_dp=2,
        layout=KVLayout(num_layers=2, mla=True, head_dim=72, page_size=1, draft_layers=1, aux=DRAFT_AUX),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_draft_kv_and_draft_aux(run_clean, case):
    kw = CASES[case]
    page = kw["layout"].page_size
    cfg = config(rooms=16, shape=RoomShape(min_tokens=1, max_tokens=3 * page + 5, chunks=2), **kw)
    run_clean(cfg)
    # The byte check covered the draft buffers: it walks every KV entry decode registered, and
    # those are the target's layers followed by num_draft_entries draft buffers.
    groups = 1 if cfg.layout.mla else 2
    pool = RankPool(cfg, build_plan(cfg), "decode", 0)
    assert pool.num_draft_entries == groups * cfg.layout.draft_layers > 0
    assert len(pool.kv) == groups * (cfg.layout.num_layers + cfg.layout.draft_layers)


def test_decode_with_a_draft_model_the_prefill_does_not_run(run_clean):
    # A decode running MTP/EAGLE fed by a prefill without it: decode registers a draft layer's KV
    # and the draft's aux buffers, prefill has neither. The target's layers and the leading aux
    # buffers move; the decode's draft KV and extra aux buffers are never written (they stay zero).
    layout = KVLayout(num_layers=2, total_kv_heads=4, head_dim=16, page_size=16, aux=DRAFT_AUX[:3])
    cfg = config(
        rooms=16,
        layout=layout,
        decode_draft_layers=1,
        decode_aux=DRAFT_AUX,
        shape=RoomShape(min_tokens=1, max_tokens=3 * layout.page_size + 5, chunks=2),
    )
    run_clean(cfg)
    pool = RankPool(cfg, build_plan(cfg), "decode", 0)
    assert pool.num_draft_entries == 2 and not pool.sent_by_prefill(len(pool.kv) - 1)
