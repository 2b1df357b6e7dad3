"""DSA kpool-compress tail (`dsa_tail`): the live part of one request's ring row.

Each tensor holds one row per request of `tail_size` token slots (item_len = tail_size *
slot_bytes). SGLang does not send page indices for it but a 6-tuple per side,
`[row, offset_1, count_1, offset_2, count_2, tail_size]`: the live tokens are count_1 slots
from offset_1 then count_2 from offset_2 (a wrapped ring). The two sides may use rings of
different sizes (speculative decoding adds slots), so the tokens are re-cut: the i-th live token
of the prefill row lands in the i-th live slot of the decode row. Empty on both sides: nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import numpy as np

from sglang_mori.planning.errors import PlanError
from sglang_mori.planning.ranges import Ranges, merge_adjacent_ranges

_EMPTY = np.zeros(0, dtype=np.int64)


@dataclass(frozen=True)
class TailRows:
    """One (prefill tensor, decode tensor) pair of ring rows; the ring sizes come per request."""

    src_item_len: int
    dst_item_len: int


def parse_tail(indices: np.ndarray, side: str) -> Tuple[int, int, np.ndarray, np.ndarray]:
    """(row, tail_size, segment offsets, segment counts) of one side's 6-tuple."""
    if indices.size != 6:
        raise PlanError(f"dsa_tail: {side} indices must be a 6-tuple, got {indices.size} values")
    row, off1, n1, off2, n2, tail = (int(v) for v in indices)
    offsets, counts = np.array([off1, off2], dtype=np.int64), np.array([n1, n2], dtype=np.int64)
    if row < 0 or tail <= 0 or offsets.min() < 0 or counts.min() < 0:
        raise PlanError(f"dsa_tail: {side} indices {indices.tolist()} hold a negative value or ring size")
    if int((offsets + counts).max()) > tail:
        raise PlanError(f"dsa_tail: {side} segment exceeds its ring of {tail} slots: {indices.tolist()}")
    return row, tail, offsets, counts


def tail_pieces(src: np.ndarray, dst: np.ndarray):
    """Live tokens as pieces contiguous on both sides: (src slots, dst slots, counts), and rows."""
    s_row, s_tail, s_off, s_n = parse_tail(src, "prefill")
    d_row, d_tail, d_off, d_n = parse_tail(dst, "decode")
    if int(s_n.sum()) != int(d_n.sum()):
        raise PlanError(f"dsa_tail: live tokens differ: prefill={int(s_n.sum())} decode={int(d_n.sum())}")
    # Cut the token sequence wherever either side starts a segment; each piece is then one run.
    s_ends, d_ends = np.cumsum(s_n), np.cumsum(d_n)
    cuts = np.unique(np.concatenate(([0], s_ends, d_ends)))
    starts, counts = cuts[:-1], np.diff(cuts)
    s_seg = np.searchsorted(s_ends, starts, side="right")
    d_seg = np.searchsorted(d_ends, starts, side="right")
    s_slot = s_off[s_seg] + starts - (s_ends - s_n)[s_seg]
    d_slot = d_off[d_seg] + starts - (d_ends - d_n)[d_seg]
    return (s_row, s_tail), (d_row, d_tail), s_slot, d_slot, counts


def tail_ranges(geometry: TailRows, pieces) -> Ranges:
    (s_row, s_tail), (d_row, d_tail), s_slot, d_slot, counts = pieces
    if counts.size == 0:
        return _EMPTY, _EMPTY, _EMPTY
    slot, rem = divmod(geometry.src_item_len, s_tail)
    d_slot_bytes, d_rem = divmod(geometry.dst_item_len, d_tail)
    if rem or d_rem or slot != d_slot_bytes:
        raise PlanError(
            f"dsa_tail: ring rows of {geometry.src_item_len} and {geometry.dst_item_len} bytes "
            f"do not hold {s_tail} and {d_tail} slots of one size"
        )
    local = s_row * geometry.src_item_len + s_slot * slot
    remote = d_row * geometry.dst_item_len + d_slot * slot
    return merge_adjacent_ranges(local, remote, counts * slot)
