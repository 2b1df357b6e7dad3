"""MHA KV with different attention-TP sizes on prefill and decode: which heads go where.

Each rank's per-layer K (or V) buffer holds only its own heads, laid out per token slot as
[local_heads, head_dim]. A prefill rank therefore writes, for every token slot, the heads it
shares with one decode rank, from its head offset to the decode rank's head offset.

We reason in *global* head numbers. With H total KV heads and TP size T, rank r holds
  - heads [r*H/T, (r+1)*H/T)       when H >= T (H divisible by T),
  - the single head r // (T/H)     when H < T  (GQA replication: T/H consecutive ranks share it).
The heads a (prefill rank, decode rank) pair exchanges are the intersection of their sets. This
gives the same answer as SGLang's `compute_head_slice_params` for every pair SGLang connects
(tested against it), including replication on either side; replicated prefill ranks all write
the same bytes to the same place, as in SGLang.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Tuple

import numpy as np

from sglang_mori.planning.errors import UnsupportedLayoutError
from sglang_mori.planning.ranges import Ranges, contiguous_item_ranges


def check_tp_sizes(prefill_tp_size: int, decode_tp_size: int) -> None:
    """SGLang connects TP groups only when one size divides the other."""
    if prefill_tp_size < 1 or decode_tp_size < 1:
        raise UnsupportedLayoutError(
            f"attention TP sizes must be >= 1, got prefill={prefill_tp_size} decode={decode_tp_size}"
        )
    big, small = max(prefill_tp_size, decode_tp_size), min(prefill_tp_size, decode_tp_size)
    if big % small:
        raise UnsupportedLayoutError(
            f"attention TP sizes prefill={prefill_tp_size} decode={decode_tp_size}: one must divide "
            "the other for prefill ranks to map onto decode ranks"
        )


def rank_heads(tp_size: int, tp_rank: int, total_heads: int) -> Tuple[int, int]:
    """(first global head, number of heads) held by `tp_rank` of a TP group of `tp_size`."""
    if not 0 <= tp_rank < tp_size:
        raise UnsupportedLayoutError(f"TP rank {tp_rank} is outside a TP group of size {tp_size}")
    if total_heads < 1:
        raise UnsupportedLayoutError(f"total KV heads must be >= 1, got {total_heads}")
    if total_heads >= tp_size:
        if total_heads % tp_size:
            raise UnsupportedLayoutError(
                f"{total_heads} KV heads cannot be split evenly over TP size {tp_size}"
            )
        per_rank = total_heads // tp_size
        return tp_rank * per_rank, per_rank
    if tp_size % total_heads:
        raise UnsupportedLayoutError(
            f"{total_heads} KV heads cannot be replicated evenly over TP size {tp_size}"
        )
    return tp_rank // (tp_size // total_heads), 1


def decode_ranks_for_prefill_rank(
    prefill_tp_size: int, prefill_rank: int, decode_tp_size: int
) -> range:
    """Decode attention-TP ranks that receive KV from `prefill_rank` (SGLang's rank pairing).

    Prefill TP < decode TP: each prefill rank feeds a block of decode ranks. Prefill TP >= decode
    TP: a block of prefill ranks feeds one decode rank.
    """
    check_tp_sizes(prefill_tp_size, decode_tp_size)
    if not 0 <= prefill_rank < prefill_tp_size:
        raise UnsupportedLayoutError(
            f"prefill TP rank {prefill_rank} is outside a TP group of size {prefill_tp_size}"
        )
    if decode_tp_size >= prefill_tp_size:
        fan_out = decode_tp_size // prefill_tp_size
        return range(prefill_rank * fan_out, (prefill_rank + 1) * fan_out)
    first = prefill_rank // (prefill_tp_size // decode_tp_size)
    return range(first, first + 1)


@dataclass(frozen=True)
class HeadSlice:
    """Which heads one prefill rank writes into one decode rank, and the byte geometry.

    Head starts are positions inside each side's own buffer (local head numbering).
    """

    prefill_head_start: int
    decode_head_start: int
    num_heads: int
    prefill_heads: int  # heads in each prefill token slot
    decode_heads: int  # heads in each decode token slot
    head_bytes: int  # head_dim * dtype size
    page_size: int
    # Page byte order (physical_layout.py): False = token-major (NHD, a token's heads are
    # contiguous), True = head-major (HND, vectorized_5d: a head's page_size slots are contiguous).
    head_major: bool = False

    @property
    def slice_bytes(self) -> int:
        return self.num_heads * self.head_bytes

    @property
    def prefill_token_bytes(self) -> int:
        return self.prefill_heads * self.head_bytes

    @property
    def decode_token_bytes(self) -> int:
        return self.decode_heads * self.head_bytes

    @property
    def prefill_item_len(self) -> int:
        return self.page_size * self.prefill_token_bytes

    @property
    def decode_item_len(self) -> int:
        return self.page_size * self.decode_token_bytes

    @property
    def whole_tokens(self) -> bool:
        """Every head of a token on both sides: token slots (and pages) can merge."""
        return self.num_heads == self.prefill_heads == self.decode_heads

    def with_head_bytes(self, head_bytes: int) -> "HeadSlice":
        """The same heads for a buffer with another head size (e.g. V with its own head_dim)."""
        return replace(self, head_bytes=head_bytes)

    def with_head_major(self, head_major: bool) -> "HeadSlice":
        """The same heads in pages of the other byte order."""
        return replace(self, head_major=head_major)


def compute_head_slice(
    prefill_tp_size: int,
    prefill_rank: int,
    decode_tp_size: int,
    decode_rank: int,
    total_kv_heads: int,
    head_dim: int,
    dtype_size: int,
    page_size: int,
) -> HeadSlice:
    """Slice parameters for the (prefill rank, decode rank) pair; ranks are attention-TP ranks.

    Raises UnsupportedLayoutError when the sizes cannot be split, or when SGLang would not pair
    these two ranks (the prefill rank never writes to that decode rank).
    """
    if head_dim < 1 or dtype_size < 1 or page_size < 1:
        raise UnsupportedLayoutError(
            f"head_dim, dtype_size and page_size must be >= 1, got {head_dim}, {dtype_size}, "
            f"{page_size}"
        )
    receivers = decode_ranks_for_prefill_rank(prefill_tp_size, prefill_rank, decode_tp_size)
    if decode_rank not in receivers:
        raise UnsupportedLayoutError(
            f"prefill rank {prefill_rank}/{prefill_tp_size} does not send KV to decode rank "
            f"{decode_rank}/{decode_tp_size}; its decode ranks are {list(receivers)}"
        )
    p_first, p_count = rank_heads(prefill_tp_size, prefill_rank, total_kv_heads)
    d_first, d_count = rank_heads(decode_tp_size, decode_rank, total_kv_heads)
    first = max(p_first, d_first)
    end = min(p_first + p_count, d_first + d_count)
    # Paired ranks always share heads (the pairing follows the head split); guard anyway,
    # since an empty slice would silently transfer nothing.
    if end <= first:
        raise UnsupportedLayoutError(
            f"prefill rank {prefill_rank}/{prefill_tp_size} and decode rank "
            f"{decode_rank}/{decode_tp_size} share no KV head of {total_kv_heads}"
        )
    return HeadSlice(
        prefill_head_start=first - p_first,
        decode_head_start=first - d_first,
        num_heads=end - first,
        prefill_heads=p_count,
        decode_heads=d_count,
        head_bytes=head_dim * dtype_size,
        page_size=page_size,
    )


def head_sliced_ranges(src_pages: np.ndarray, dst_pages: np.ndarray, hs: HeadSlice) -> Ranges:
    """Byte ranges writing the slice's heads of every token slot of every page pair.

    Token-major pages: one range per token slot (the heads are contiguous inside a slot).
    Head-major pages: one range per page (each head's slots are contiguous, and so are the
    slice's heads). When the slice is whole tokens on both sides, slots and pages merge like a
    plain page copy.
    """
    if hs.whole_tokens:
        # Both page layouts are identical, so this is a plain page copy: merge at page level.
        return contiguous_item_ranges(src_pages, dst_pages, hs.prefill_item_len)
    if hs.head_major:
        head_block = hs.page_size * hs.head_bytes
        local = src_pages * hs.prefill_item_len + hs.prefill_head_start * head_block
        remote = dst_pages * hs.decode_item_len + hs.decode_head_start * head_block
        # Not whole pages on at least one side, so consecutive pages never continue each other.
        return local, remote, np.full(local.size, hs.num_heads * head_block, dtype=np.int64)
    slots = np.arange(hs.page_size, dtype=np.int64)
    local = (
        src_pages[:, None] * hs.prefill_item_len
        + slots * hs.prefill_token_bytes
        + hs.prefill_head_start * hs.head_bytes
    ).ravel()
    remote = (
        dst_pages[:, None] * hs.decode_item_len
        + slots * hs.decode_token_bytes
        + hs.decode_head_start * hs.head_bytes
    ).ravel()
    sizes = np.full(local.size, hs.slice_bytes, dtype=np.int64)
    # No merge needed: when one side holds more heads than the slice, consecutive slots on that
    # side are a token apart, so no range ever continues its neighbour on both sides.
    return local, remote, sizes
