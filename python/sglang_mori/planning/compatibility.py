"""Registration-time checks of a (prefill, decode) layout pair.

Every message names the field and both sides' values (`page_size: prefill=16 decode=64`), so an
operator reading one log line knows which server to fix.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

from sglang_mori.planning.errors import InvalidLayoutError, UnsupportedLayoutError, mismatch
from sglang_mori.planning.head_slice import (
    HeadSlice,
    check_tp_sizes,
    compute_head_slice,
    decode_ranks_for_prefill_rank,
)
from sglang_mori.planning.layout import KVLayout
from sglang_mori.planning.physical_layout import HEAD_MAJOR, NHD, TOKEN_MAJOR, head_major

Pairs = Sequence[Tuple[int, int]]


def check_scalar_fields(prefill: KVLayout, decode: KVLayout) -> None:
    """Fields that must be equal on both sides for any byte copy to be meaningful."""
    if prefill.is_mla != decode.is_mla:
        raise mismatch("is_mla", prefill.is_mla, decode.is_mla)
    if prefill.page_size != decode.page_size:
        raise mismatch(
            "page_size", prefill.page_size, decode.page_size, "pages are copied whole, not re-tiled"
        )
    if prefill.kv_cache_dtype != decode.kv_cache_dtype:
        raise mismatch("kv_cache_dtype", prefill.kv_cache_dtype, decode.kv_cache_dtype)
    if prefill.kv_layout != decode.kv_layout:
        raise mismatch("kv_layout", prefill.kv_layout, decode.kv_layout)
    check_physical_layouts(prefill, decode)
    check_tp_sizes(prefill.tp_size, decode.tp_size)
    # Aux buffers pair up by position, as in SGLang: an optional one enabled on one engine only
    # (--disaggregation-enable-kv-checksum, SGLANG_ENABLE_DISAGG_SAMPLING_MASK, the DSA top-k
    # buffer) is appended last, so the leading ones still match and only those move. Their item
    # sizes must agree, or the copy would mix fields.
    common = min(len(prefill.aux_item_lens), len(decode.aux_item_lens))
    if tuple(prefill.aux_item_lens[:common]) != tuple(decode.aux_item_lens[:common]):
        raise mismatch("aux_item_lens", list(prefill.aux_item_lens), list(decode.aux_item_lens),
                       "the aux buffers both sides have must have the same item sizes")
    src_types = [s.state_type for s in prefill.states]
    dst_types = [s.state_type for s in decode.states]
    if src_types != dst_types:
        raise mismatch("state_types", src_types, dst_types)


def check_physical_layouts(prefill: KVLayout, decode: KVLayout) -> None:
    """Pages of equal size in another byte order would be copied without an error, then read wrong."""
    why = ("pages of the same size hold their bytes in another order; set SGLANG_USE_HND_KVCACHE, "
           "SGLANG_USE_AITER and SGLANG_AITER_KV_CACHE_LAYOUT alike on both servers")
    if not prefill.is_mla:
        src = prefill.kv_physical_layout or NHD
        dst = decode.kv_physical_layout or NHD
        if src != dst:
            raise mismatch("kv_physical_layout", src, dst, why)
    if prefill.swa_physical_layout != decode.swa_physical_layout:
        raise mismatch("swa_physical_layout", prefill.swa_physical_layout,
                       decode.swa_physical_layout, why)


def resolve_total_heads(prefill: KVLayout, decode: KVLayout) -> int:
    """The model's KV head count; SGLang's decode reports it only in some modes, so either side
    may supply it, but two reported values must agree."""
    src, dst = prefill.total_heads(), decode.total_heads()
    if src and dst and src != dst:
        raise mismatch("total_kv_head_num", src, dst)
    return src or dst


def mha_head_slice(prefill: KVLayout, decode: KVLayout) -> Optional[HeadSlice]:
    """Head slice for an MHA pair with different TP sizes; None when no slicing is needed.

    Raises when these ranks are not paired by SGLang: with equal TP an MHA prefill rank holds
    other heads than any other decode rank, so a wrong pairing would copy the wrong heads.
    """
    if prefill.is_mla:
        return None
    receivers = decode_ranks_for_prefill_rank(prefill.tp_size, prefill.tp_rank, decode.tp_size)
    if decode.tp_rank not in receivers:
        raise mismatch(
            "tp_rank",
            f"{prefill.tp_rank}/{prefill.tp_size}",
            f"{decode.tp_rank}/{decode.tp_size}",
            f"this prefill rank sends MHA KV only to decode ranks {list(receivers)}",
        )
    if prefill.tp_size == decode.tp_size:
        return None
    total = resolve_total_heads(prefill, decode)
    if total <= 0:
        raise UnsupportedLayoutError(
            f"MHA KV with prefill TP {prefill.tp_size} and decode TP {decode.tp_size} needs the "
            "model's KV head count (total_kv_head_num), and neither side reports it"
        )
    # Geometry per buffer comes later (K and V may differ in head_dim); 1-byte heads here.
    base = compute_head_slice(
        prefill.tp_size, prefill.tp_rank, decode.tp_size, decode.tp_rank, total, 1, 1,
        prefill.page_size,
    )
    for side, layout, heads in (("prefill", prefill, base.prefill_heads),
                                ("decode", decode, base.decode_heads)):
        if layout.kv_head_num and layout.kv_head_num != heads:
            raise InvalidLayoutError(
                f"{side}: kv_head_num={layout.kv_head_num} but {total} KV heads over TP "
                f"{layout.tp_size} give {heads} heads per rank"
            )
    order = head_major(prefill.kv_physical_layout)
    if order is None:
        raise UnsupportedLayoutError(
            f"MHA KV with prefill TP {prefill.tp_size} and decode TP {decode.tp_size} needs head "
            f"slicing, which cannot cut pages of the {prefill.kv_physical_layout!r} layout "
            f"(it cuts {', '.join(sorted(TOKEN_MAJOR | HEAD_MAJOR))}); use equal attention TP sizes"
        )
    return base.with_head_major(order)


def pair_head_slice(
    base: HeadSlice, src_index: int, dst_index: int, src_item_len: int, dst_item_len: int,
    what: str = "KV buffer",
) -> HeadSlice:
    """The head slice of one (prefill buffer, decode buffer) pair, with its own head size."""
    per_head = base.page_size * base.prefill_heads
    head_bytes = src_item_len // per_head
    expected_dst = base.page_size * base.decode_heads * head_bytes
    if head_bytes * per_head != src_item_len or dst_item_len != expected_dst:
        raise mismatch(
            f"{what} {src_index}->{dst_index} item_len",
            src_item_len,
            dst_item_len,
            f"expected {base.prefill_heads} vs {base.decode_heads} heads of equal size per token "
            f"and page_size {base.page_size}",
        )
    return base.with_head_bytes(head_bytes)


def check_equal_item_lens(
    pairs: Pairs, src_lens: Sequence[int], dst_lens: Sequence[int], what: str
) -> None:
    for i, j in pairs:
        if src_lens[i] != dst_lens[j]:
            raise mismatch(f"{what} {i}->{j} item_len", src_lens[i], dst_lens[j])
