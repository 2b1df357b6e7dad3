"""Page-range and destination-slice arithmetic of layer-wise streaming (pure, unit-tested).

Coordinates, as SGLang's prefill uses them:
- token positions of the request: [0, input_len);
- decode's destination list `kv_indices` (RoomMetadata) holds one decode page per page of the
  request from `decode_prefix_len` on: entry k receives tokens
  [decode_prefix_len + k*page_size, decode_prefix_len + (k+1)*page_size);
- SGLang's `send()` hands chunks as `index_slice` over that list (its `curr_idx`).

A forward pass that extends a request over tokens [prefix_len, extend_end) completes the *full*
pages that end at or before extend_end; the page containing prefix_len may hold tokens of an
earlier pass (or of the cached prefix) and is complete too once this pass wrote its tail. A
trailing partial page is left to the next pass or to the last `send()`, as SGLang's own rule for
non-last chunks does. Everything is derived from token positions, never from `curr_idx`: with the
overlap scheduler chunk k+1 is launched before chunk k's result is processed (and sent).

`Coverage` records which KV buffers of which destination pages were streamed, so that `send()`
submits only the rest (`remainder`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import FrozenSet, List, Optional, Tuple

import numpy as np


@dataclass(frozen=True)
class StreamRange:
    """Tokens [tok_lo, tok_hi) (whole pages) of one request, streamed in one forward pass."""

    tok_lo: int
    tok_hi: int
    page_size: int
    decode_prefix_len: int

    @property
    def num_pages(self) -> int:
        return (self.tok_hi - self.tok_lo) // self.page_size

    @property
    def dst_slice(self) -> slice:
        """Entries of decode's `kv_indices` (and of SGLang's index_slice space) these pages fill."""
        start = (self.tok_lo - self.decode_prefix_len) // self.page_size
        return slice(start, start + self.num_pages)


def stream_range(*, prefix_len: int, extend_len: int, input_len: int, page_size: int, decode_prefix_len: int,
                 already_sent: int) -> Optional[StreamRange]:
    """The full pages a forward extending [prefix_len, prefix_len + extend_len) completes and that
    nobody sent yet, or None. `already_sent` is the token position up to which this request's KV
    was streamed or sent (page-aligned, or the input length after the last send)."""
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    if decode_prefix_len % page_size:
        raise ValueError(f"decode_prefix_len {decode_prefix_len} is not a multiple of page_size {page_size}")
    end = min(prefix_len + extend_len, input_len)
    lo = max(prefix_len - prefix_len % page_size, decode_prefix_len, already_sent)
    hi = end - end % page_size
    if lo % page_size:  # already_sent past the last page boundary: nothing whole is left before it
        lo += page_size - lo % page_size
    if hi <= lo:
        return None
    return StreamRange(lo, hi, page_size, decode_prefix_len)


def source_pages(row_tokens, tok_lo: int, tok_hi: int, page_size: int) -> np.ndarray:
    """Prefill page indices of tokens [tok_lo, tok_hi) from a `req_to_token` row (token slots)."""
    slots = row_tokens[tok_lo:tok_hi:page_size]
    if hasattr(slots, "cpu"):  # a torch row (on a GPU: a small device-to-host copy)
        slots = slots.cpu().numpy()
    return np.asarray(slots, dtype=np.int64) // page_size


Buffers = Optional[FrozenSet[int]]  # KV buffer indices to write; None = every buffer


@dataclass
class Segment:
    page_lo: int  # in index_slice space
    page_hi: int
    buffers: FrozenSet[int]  # KV buffers (local indices) streamed for these pages
    src_pages: np.ndarray  # prefill pages they were streamed from
    tok_lo: int


class Coverage:
    """What was streamed for one room life: disjoint page segments, each with its KV buffers."""

    def __init__(self):
        self.segments: List[Segment] = []

    def add(self, rng: StreamRange, buffers, src_pages: np.ndarray) -> None:
        buffers = frozenset(buffers)
        if not buffers or rng.num_pages == 0:
            return
        s = rng.dst_slice
        for seg in self.segments:
            if seg.page_lo < s.stop and s.start < seg.page_hi:
                raise ValueError(f"pages {s.start}..{s.stop} overlap streamed pages {seg.page_lo}..{seg.page_hi}")
        self.segments.append(Segment(s.start, s.stop, buffers, np.asarray(src_pages, dtype=np.int64), rng.tok_lo))
        self.segments.sort(key=lambda g: g.page_lo)

    def remainder(self, index_slice: slice, num_buffers: int) -> List[Tuple[int, int, Buffers]]:
        """What a `send()` of `index_slice` must still write: (lo, hi, buffers) relative to the
        chunk's start, adjacent parts with equal buffers merged; `buffers` None means all."""
        every = frozenset(range(num_buffers))
        lo, hi = index_slice.start, index_slice.stop
        parts: List[Tuple[int, int, Buffers]] = []

        def emit(a: int, b: int, bufs: Buffers) -> None:
            if b <= a or bufs == frozenset():
                return
            if parts and parts[-1][1] == a - lo and parts[-1][2] == bufs:
                parts[-1] = (parts[-1][0], b - lo, bufs)
            else:
                parts.append((a - lo, b - lo, bufs))

        cursor = lo
        for seg in self.segments:
            if seg.page_hi <= cursor or seg.page_lo >= hi:
                continue
            emit(cursor, max(cursor, seg.page_lo), None)
            a, b = max(cursor, seg.page_lo), min(hi, seg.page_hi)
            left = every - seg.buffers
            emit(a, b, left if left != every else None)
            cursor = b
        emit(cursor, hi, None)
        return parts
