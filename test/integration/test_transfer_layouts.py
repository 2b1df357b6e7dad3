"""Byte-exact KV transfer through our backend (`mori`, software engine) for the pool layouts SGLang
registers: MHA (K and V per layer) and MLA (one latent buffer per layer), page sizes 1, 16 and 64,
chunked sends, metadata (aux) buffers and Mamba-like state, 64+ rooms in flight at once.

Each case runs one harness session (bootstrap server + one process per TP rank); the contract
checked is in integration_support.assert_clean: every room Success on both sides, every decode page
of every layer, aux row and state row equal to the prefill's bytes at the mapped place, every other
decode page/row still zero, every process alive at the end.
"""

from __future__ import annotations

import pytest
from integration_support import config

from harness.pd.config import DeepSeekStateSpec
from harness.pd.run import AuxBufferSpec, KVLayout, RoomShape


def test_mha_every_layer_aux_and_state_64_rooms_chunked(run_clean):
    cfg = config(
        rooms=64,
        layout=KVLayout(num_layers=4, total_kv_heads=4, head_dim=32, page_size=16, state_item_bytes=(96, 40)),
        shape=RoomShape(min_tokens=1, max_tokens=200, chunks=3),
    )
    result = run_clean(cfg)
    # Both sides saw every room through to the end; prefill reports what it moved.
    for o in result.side("prefill")[0].rooms:
        assert o.t_ready is not None and o.t_sent is not None and o.t_done >= o.t_sent


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_page_sizes(run_clean, page_size):
    # Token counts straddle page boundaries: full pages, a partial last page and one-token rooms.
    cfg = config(
        rooms=64,
        seed=page_size,
        layout=KVLayout(num_layers=2, total_kv_heads=2, head_dim=64, dtype="float16", page_size=page_size),
        shape=RoomShape(min_tokens=1, max_tokens=4 * page_size + 3, chunks=2),
    )
    run_clean(cfg)


def test_mla_latent_buffer_per_layer(run_clean):
    cfg = config(
        rooms=64,
        layout=KVLayout(num_layers=3, mla=True, head_dim=288, page_size=16, state_item_bytes=(64,)),
        shape=RoomShape(min_tokens=1, max_tokens=100, chunks=2),
    )
    run_clean(cfg)


def test_many_rooms_through_a_sliding_window(run_clean):
    # 256 requests, at most 64 open on each side at a time: rooms open while others finish, so
    # room state is created and cleared concurrently and the manager's tables must not leak
    # into later rooms.
    cfg = config(
        rooms=256,
        max_inflight=64,
        layout=KVLayout(num_layers=2, total_kv_heads=4, head_dim=16, page_size=1),
        shape=RoomShape(min_tokens=1, max_tokens=48, chunks=2),
    )
    run_clean(cfg)


AUX3 = (AuxBufferSpec("int32", 16), AuxBufferSpec("float32", 16), AuxBufferSpec("int64", 8))


@pytest.mark.parametrize("decode_aux", [AUX3[:2], AUX3 + (AuxBufferSpec("int64", 8),)], ids=["fewer", "more"])
def test_aux_buffer_count_differs_between_engines(run_clean, decode_aux):
    # An optional metadata buffer enabled on one engine only (--disaggregation-enable-kv-checksum,
    # SGLANG_ENABLE_DISAGG_SAMPLING_MASK, the DSA top-k buffer) is appended last, so the leading
    # buffers still pair up; SGLang logs the mismatch and serves. The Mooncake reference passes.
    cfg = config(rooms=16, layout=KVLayout(aux=AUX3), decode_aux=decode_aux)
    run_clean(cfg)


# Item-indexed state of QSA, MiniMax sparse and MXFP8 KV pools, registered as setup_state_kv_args
# registers them and indexed as prefill.py / decode.py index them (harness/pd/ds_state.py): the
# QSA pending ring by request row, QSA compressed / MiniMax dense KV / block scales by every KV
# page of the request (the cached prefix included), the MiniMax index by the pages after decode's
# prefix, the SWA sub-pool's block scales by the window's SWA pages. Tensor sizes differ so a
# tensor landing on another shows.
ITEM_STATE = (
    DeepSeekStateSpec("qsa_pending", item_bytes=(24, 40)),
    DeepSeekStateSpec("qsa_compressed", item_bytes=(32, 48)),
    DeepSeekStateSpec("minimax_index_k", item_bytes=(16, 24)),
    DeepSeekStateSpec("minimax_dense_kv", item_bytes=(64,)),
    DeepSeekStateSpec("block_scale", item_bytes=(8, 12, 8, 12)),
    DeepSeekStateSpec("block_scale_swa", item_bytes=(8, 12), window=37),
)


def test_decode_prefix_cache_hits(run_clean):
    # Decode already holds the first pages of some rooms (its radix cache): it publishes only the
    # rest with decode_prefix_len, prefill must learn that length (pop_decode_prefix_len) and send
    # only the remaining pages, and the cached pages on decode must not be written. The same run
    # carries the QSA, MiniMax and MXFP8 block-scale state above, end to end at equal TP, each
    # type's items addressed with and without decode's prefix as SGLang addresses them.
    cfg = config(
        rooms=64,
        layout=KVLayout(num_layers=2, total_kv_heads=4, head_dim=16, page_size=16, state_item_bytes=(32,),
                        deepseek_state=ITEM_STATE),
        shape=RoomShape(min_tokens=17, max_tokens=160, chunks=2),
        decode_prefix=tuple((i, 1 + i % 4) for i in range(0, 64, 3)),
    )
    run_clean(cfg)
