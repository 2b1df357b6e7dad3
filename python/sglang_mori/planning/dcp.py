"""Decode context parallel (decode `--dcp-size N > 1`): a prefill with DCP 1 relays its KV out
token by token, striped over the N decode ranks. MLA and hybrid MLA only.

Decode's page indices are *virtual* pages of `page_size * N` tokens. Counting positions from the
start of the request (so `decode_prefix_len` and the chunk's page offset included), the token at
absolute position p belongs to DCP rank p % N; on that rank it sits at local slot
(p - decode_prefix_len) // N of the request's pages, where virtual page k of the list is the
rank's physical page k (page_size slots). `decode_prefix_len` must be a multiple of the virtual
page size, so the striping restarts cleanly after the prefix.

Draft (MTP/EAGLE) entries are not striped: each decode rank holds every token in pages of the
virtual size, so token q of the request goes to slot q % (page_size * N) of virtual page
q // (page_size * N).

Topologies: equal DCP sizes need equal DCP ranks and no relayout; prefill DCP 1 into decode
DCP N > 1 relays out (MLA only); anything else is refused at registration.
"""

from __future__ import annotations

from typing import Optional, Tuple

import numpy as np

from sglang_mori.planning.errors import PlanError, UnsupportedLayoutError, mismatch
from sglang_mori.planning.layout import KVLayout
from sglang_mori.planning.ranges import Ranges, merge_adjacent_ranges, split_large_ranges

_EMPTY = np.zeros(0, dtype=np.int64)


def _sides(prefill: KVLayout, decode: KVLayout) -> str:
    return (f"prefill dcp_size={prefill.dcp_size} dcp_rank={prefill.dcp_rank}, "
            f"decode dcp_size={decode.dcp_size} dcp_rank={decode.dcp_rank}")


def needs_dcp_relayout(prefill: KVLayout, decode: KVLayout) -> bool:
    """Whether this pair relays out tokens over decode's DCP ranks; raise if it cannot be served."""
    if prefill.dcp_size == decode.dcp_size:
        if prefill.dcp_rank != decode.dcp_rank:
            raise mismatch("dcp_rank", prefill.dcp_rank, decode.dcp_rank,
                           f"equal DCP sizes ({prefill.dcp_size}) pair matching DCP ranks only")
        return False
    if prefill.dcp_size != 1:
        raise UnsupportedLayoutError(
            f"decode context parallel: {_sides(prefill, decode)}: only a prefill with dcp_size 1 "
            "relays out KV into a decode with a larger dcp_size"
        )
    if not (prefill.is_mla and decode.is_mla):
        raise UnsupportedLayoutError(
            f"decode context parallel: {_sides(prefill, decode)}: the relayout is for MLA KV only, "
            f"and this model is not MLA (is_mla: prefill={prefill.is_mla} decode={decode.is_mla})"
        )
    return True


def is_draft_pair(prefill: KVLayout, src_index: int) -> bool:
    return src_index >= prefill.num_kv_buffers - prefill.num_draft_entries


def check_dcp_item_lens(prefill: KVLayout, decode: KVLayout, pairs) -> Tuple[int, ...]:
    """Bytes per token of every pair; decode's pages hold page_size tokens (target entries) or
    page_size * dcp_size tokens (draft entries) of the same token size."""
    out = []
    for i, j in pairs:
        src_len, dst_len = prefill.kv_item_lens[i], decode.kv_item_lens[j]
        scale = decode.dcp_size if is_draft_pair(prefill, i) else 1
        kind = "draft" if scale > 1 else "target"
        if src_len % prefill.page_size or dst_len != src_len * scale:
            raise mismatch(
                f"KV buffer {i}->{j} item_len", src_len, dst_len,
                f"a {kind} entry under decode context parallel needs decode item_len = "
                f"{scale} x prefill item_len ({_sides(prefill, decode)})",
            )
        out.append(src_len // prefill.page_size)
    return tuple(out)


def dcp_token_rows(
    src_pages: np.ndarray,
    dst_pages: np.ndarray,
    *,
    page_size: int,
    dcp_size: int,
    dcp_rank: int,
    page_offset: int,
    decode_prefix_len: int,
    num_tokens: Optional[int],
    draft: bool,
) -> Tuple[np.ndarray, np.ndarray]:
    """(prefill token slots, decode token slots) of one chunk, in token units of each buffer.

    `src_pages` are the chunk's prefill pages; `dst_pages` decode's whole virtual page list of the
    request; `page_offset` where the chunk starts in prefill's page list (SGLang's index_slice
    start); `num_tokens` the real tokens of the chunk (its last page may be partial).
    """
    virtual = page_size * dcp_size
    if decode_prefix_len < 0 or decode_prefix_len % virtual:
        raise PlanError(
            f"decode context parallel: decode_prefix_len={decode_prefix_len} is not a multiple of "
            f"the virtual page size {virtual} (page_size {page_size} x dcp_size {dcp_size})"
        )
    if page_offset < 0:
        raise PlanError(f"decode context parallel: negative page offset {page_offset}")
    capacity = src_pages.size * page_size
    if num_tokens is None:
        num_tokens = capacity
    if not 0 <= num_tokens <= capacity:
        raise PlanError(
            f"decode context parallel: the chunk has {num_tokens} tokens but {src_pages.size} "
            f"prefill pages of {page_size} slots"
        )
    if num_tokens == 0:
        return _EMPTY, _EMPTY
    first = page_offset * page_size  # the chunk's first position after decode's prefix
    if draft:
        offsets = np.arange(num_tokens, dtype=np.int64)
        local = first + offsets
        dst_page_size = virtual
    else:
        # Absolute position decode_prefix_len + first + o belongs to this rank when it is
        # congruent to dcp_rank modulo dcp_size.
        start = (dcp_rank - decode_prefix_len - first) % dcp_size
        offsets = np.arange(start, num_tokens, dcp_size, dtype=np.int64)
        local = (first + offsets) // dcp_size
        dst_page_size = page_size
    if offsets.size == 0:
        return _EMPTY, _EMPTY
    dst_page_of = local // dst_page_size
    if int(dst_page_of[-1]) >= dst_pages.size:
        raise PlanError(
            f"decode context parallel: decode gave {dst_pages.size} virtual pages, the chunk needs "
            f"page {int(dst_page_of[-1])} (position {first + int(offsets[-1])}, virtual page size "
            f"{virtual})"
        )
    src_rows = src_pages[offsets // page_size] * page_size + offsets % page_size
    dst_rows = dst_pages[dst_page_of] * dst_page_size + local % dst_page_size
    return src_rows, dst_rows


def token_ranges(src_rows: np.ndarray, dst_rows: np.ndarray, token_bytes: int) -> Ranges:
    """One range per token, merged where tokens follow each other on both sides."""
    if src_rows.size == 0:
        return _EMPTY, _EMPTY, _EMPTY
    local, remote, sizes = merge_adjacent_ranges(
        src_rows * token_bytes, dst_rows * token_bytes,
        np.full(src_rows.size, token_bytes, dtype=np.int64),
    )
    return split_large_ranges(local, remote, sizes, unit=token_bytes)
