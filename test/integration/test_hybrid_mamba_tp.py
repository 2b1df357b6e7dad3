"""A Qwen3-Next-shaped hybrid model (full-attention GQA KV layers + GDN linear-attention state)
with different prefill and decode TP sizes, one process per TP rank.

Every rank registers what SGLang's HybridLinearKVPool registers on it (harness/pd/mamba.py): the
full-attention K and V buffers with their global layer ids, and one MAMBA state component of a
conv tensor ([q|k|v] sub-blocks, each head-sharded on its own) and a temporal tensor (sharded
on its value heads) per linear-attention layer, with SGLang's slice metadata. Prefill TP 1 ->
decode TP 2 scatters each prefill slot over both decode ranks; TP 2 -> 1 gathers both prefill
ranks' shards into one decode slot. The same runs with Kimi-Linear's transposed conv state and
a state tensor whole on every rank. The decode's every KV head and every state position is
checked byte for byte against the prefill's bytes for that global head / position, and pages
and state slots no room was given stay zero (the harness's self-check,
test_harness_mamba_selfcheck.py, shows the checker catches a wrong shard or a conv state cut
without its sub-blocks), and SGLang's Mooncake moves the same bytes for the same registration
(so the harness registers what SGLang's own slicer expects).
"""

from __future__ import annotations

import pytest
from integration_support import config

from harness.pd.config import HybridMambaShape
from harness.pd.run import KVLayout, RoomShape

# Qwen3-Next's proportions, scaled down: 2 KV heads (GQA), 2 key / 4 value linear-attention
# heads (key_dim 16, value_dim 32: conv axis [16 | 16 | 32]), conv kernel 4, 8 model layers
# (linear, linear, linear, full) x 2.
GDN = HybridMambaShape(num_key_heads=2, num_value_heads=4, head_k_dim=8, head_v_dim=8, conv_kernel=4)
# Kimi-Linear's conv [K-1, v | k | k] (sliced on its second axis) and a short-conv slot sibling
# whole on every rank (slice dim 0), which one elected prefill rank writes.
KIMI = HybridMambaShape(num_key_heads=2, num_value_heads=4, head_k_dim=8, head_v_dim=8, conv_kernel=4,
                        kimi=True, replicated_conv=True)


def _config(backend: str, prefill_tp: int, decode_tp: int, mamba: HybridMambaShape = GDN):
    layout = KVLayout(num_layers=2, total_kv_heads=2, head_dim=32, page_size=16, mamba=mamba)
    return config(
        backend=backend,
        rooms=12,
        prefill_tp=prefill_tp,
        decode_tp=decode_tp,
        layout=layout,
        # Up to 5 pages in 3 sends; the state rides on the last one.
        shape=RoomShape(min_tokens=1, max_tokens=5 * layout.page_size, chunks=3),
        # Start-up only (SGLang imports in 3 processes): on a loaded 2-core CI box 120 s was seen
        # to run out before any room opened. The transfer deadlines stay the suite's.
        startup_timeout_s=240.0,
    )


@pytest.mark.parametrize("prefill_tp,decode_tp", [(1, 2), (2, 1)],
                         ids=["tp1to2", "tp2to1"])  # tp1to2: `make test-all` (the state split is tp2to1's mirror)
def test_qwen3_next_shaped_hybrid_kv_and_mamba_state(run_clean, prefill_tp, decode_tp):
    result = run_clean(_config("mori", prefill_tp, decode_tp))
    decode = result.side("decode")
    assert sorted(r.rank for r in decode) == list(range(decode_tp))
    # Every decode rank checked its own shard: KV heads, plus 12 state tensors per room.
    assert all(r.checked_bytes > 0 and r.mismatch_count == 0 for r in decode), result.summary()


@pytest.mark.parametrize("prefill_tp,decode_tp", [(1, 2), (2, 1)],
                         ids=["tp1to2", "tp2to1"])  # tp1to2: `make test-all` (the state split is tp2to1's mirror)
def test_kimi_linear_shaped_state_and_a_replicated_sibling(run_clean, prefill_tp, decode_tp):
    result = run_clean(_config("mori", prefill_tp, decode_tp, KIMI))
    assert sorted(r.rank for r in result.side("decode")) == list(range(decode_tp))


def test_mooncake_reference_moves_the_same_shards(run_clean, require_netns):
    # SGLang's Mooncake slices mamba state with the same KVArgs metadata (its
    # compute_mamba_state_slice_byte_blocks): passing the same checks shows the harness registers
    # and expects what SGLang does. One direction is enough; TP 2 -> 1 was also checked by hand.
    result = run_clean(_config("mooncake", 1, 2))
    assert "mooncake" in result.ready.manager_classes["prefill0"].lower()
