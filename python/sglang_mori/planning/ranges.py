"""Vectorised building blocks: index validation, run detection, range merging and splitting.

Everything here works on whole numpy arrays; nothing loops over pages in Python. Offsets are
absolute (index * item_len), so a chunk is planned from its own indices alone and no state is
carried from one chunk to the next.
"""

from __future__ import annotations

from typing import Sequence, Tuple

import numpy as np

from sglang_mori.planning.errors import PlanError

Ranges = Tuple[np.ndarray, np.ndarray, np.ndarray]  # (local_offsets, remote_offsets, sizes)

# MORI-IO rejects a whole batch if one entry exceeds UINT32_MAX bytes. Long runs of large pages can
# get there (a 128k-token MHA layer is already ~256 MiB), so ranges are capped well below it.
MAX_RANGE_BYTES = 1 << 30

_EMPTY = np.zeros(0, dtype=np.int64)


def as_index_array(indices, what: str) -> np.ndarray:
    """Validate one index list (page, aux or state indices) and return it as 1-D int64."""
    array = np.asarray(indices)
    if array.dtype == np.int64 and array.ndim == 1:
        return array if array.size else _EMPTY  # the common case: no dtype-kind checks per chunk
    if array.ndim != 1:
        raise PlanError(f"{what} must be a 1-D array, got shape {array.shape}")
    if array.size == 0:
        return _EMPTY
    if not np.issubdtype(array.dtype, np.integer):
        raise PlanError(f"{what} must be integers, got dtype {array.dtype}")
    return array.astype(np.int64, copy=False)


def check_paired(src: np.ndarray, dst: np.ndarray, what: str) -> None:
    if src.size != dst.size:
        raise PlanError(
            f"{what}: prefill has {src.size} indices but decode has {dst.size}; they are copied "
            "pairwise and must have equal length"
        )


def check_in_range(
    indices: np.ndarray, limits: Sequence[int], names: Sequence[str], item: str = "item"
) -> None:
    """Raise PlanError naming the first buffer whose item count `indices` exceed.

    `limits[i]` is how many items buffer `names[i]` holds. One min/max over the indices, then
    a scan of the (few) buffers only when something is out of range.
    """
    if indices.size == 0 or not len(limits):
        return
    low, high = int(indices.min()), int(indices.max())
    if low < 0:
        raise PlanError(f"{names[0]}: {item} index {low} is negative")
    limits_array = np.asarray(limits, dtype=np.int64)
    if high < int(limits_array.min()):
        return
    worst = int(np.argmax(high >= limits_array))
    limit = int(limits_array[worst])
    raise PlanError(
        f"{names[worst]}: {item} index {high} out of range (limit {limit}: the buffer holds "
        f"{limit} {item}s)"
    )


def index_runs(src: np.ndarray, dst: np.ndarray) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Maximal runs where both src and dst advance by exactly one.

    Returns (src_starts, dst_starts, lengths). Runs are found in the given order: the same pages
    in another order are other runs, as they would be other writes. The two common cases (every
    page its own run, or one run) skip the general path: each numpy call is microseconds, and
    this runs on every chunk.
    """
    if src.size == 0:
        return _EMPTY, _EMPTY, _EMPTY
    return _runs_at(src, dst, run_cuts(src, dst))


def run_cuts(src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """Positions i where page i + 1 does not continue page i on both sides (src non-empty).
    The mask is 1-D: its `nonzero()` is flatnonzero's answer without that function's Python
    wrapper and ravel (a few microseconds a chunk on the send path, issue 28)."""
    return ((src[1:] - src[:-1] != 1) | (dst[1:] - dst[:-1] != 1)).nonzero()[0]


def _runs_at(src: np.ndarray, dst: np.ndarray, cuts: np.ndarray) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    n = src.size
    if cuts.size == n - 1:  # no two neighbours continue each other
        return src, dst, np.ones(n, dtype=np.int64)
    if cuts.size == 0:
        return src[:1], dst[:1], np.array([n], dtype=np.int64)
    starts = np.empty(cuts.size + 1, dtype=np.int64)
    starts[0] = 0
    starts[1:] = cuts + 1
    lengths = np.empty_like(starts)
    lengths[:-1] = starts[1:] - starts[:-1]
    lengths[-1] = n - starts[-1]
    return src[starts], dst[starts], lengths


def contiguous_item_ranges(src: np.ndarray, dst: np.ndarray, item_len: int) -> Ranges:
    """Byte ranges copying item src[i] to item dst[i] (same item_len both sides), runs merged.

    The number of ranges equals the number of maximal runs (before the MAX_RANGE_BYTES split).
    """
    src_starts, dst_starts, lengths = index_runs(src, dst)
    return split_large_ranges(
        src_starts * item_len, dst_starts * item_len, lengths * item_len, unit=item_len
    )


class UnitSizes:
    """Read-only arrays of `n` times one item length, for chunks whose pages are all runs of one
    page (a pool's usual, shuffled free list): a slice of one shared array per item length,
    grown when a longer chunk comes, instead of a new array per chunk and geometry."""

    def __init__(self):
        self._by_item: dict = {}

    def __call__(self, n: int, item_len: int) -> np.ndarray:
        full = self._by_item.get(item_len)
        if full is None or full.size < n:
            full = np.full(max(n, 2 * (0 if full is None else full.size)), item_len, dtype=np.int64)
            full.setflags(write=False)
            self._by_item[item_len] = full  # two threads racing here build it twice, both right
        return full[:n]


def frozen_item_ranges(src: np.ndarray, dst: np.ndarray, item_len: int, unit_sizes: UnitSizes) -> Ranges:
    """contiguous_item_ranges as read-only arrays, on the per-chunk path in fewer numpy calls:
    every array it builds is fresh (never the caller's), so it is frozen in place rather than
    copied or viewed; a chunk of single-page runs shares its sizes (`unit_sizes`). `src` and
    `dst`: int64, 1-D, paired, non-empty."""
    cuts = run_cuts(src, dst)
    if cuts.size == src.size - 1 and item_len <= MAX_RANGE_BYTES:
        ranges = (src * item_len, dst * item_len, unit_sizes(src.size, item_len))
    else:
        src_starts, dst_starts, lengths = _runs_at(src, dst, cuts)
        ranges = split_large_ranges(src_starts * item_len, dst_starts * item_len, lengths * item_len, unit=item_len)
    for array in ranges:
        array.setflags(write=False)
    return ranges


def merge_adjacent_ranges(local: np.ndarray, remote: np.ndarray, sizes: np.ndarray) -> Ranges:
    """Merge each range into its predecessor when it continues it on BOTH sides."""
    if sizes.size == 0:
        return _EMPTY, _EMPTY, _EMPTY
    continues = (local[1:] == local[:-1] + sizes[:-1]) & (remote[1:] == remote[:-1] + sizes[:-1])
    starts = np.flatnonzero(np.concatenate(([True], ~continues)))
    return local[starts], remote[starts], np.add.reduceat(sizes, starts)


def split_large_ranges(
    local: np.ndarray,
    remote: np.ndarray,
    sizes: np.ndarray,
    unit: int = 1,
    max_bytes: int = MAX_RANGE_BYTES,
) -> Ranges:
    """Cut ranges longer than max_bytes into pieces of at most max_bytes.

    Pieces are multiples of `unit` (an item length) when a unit fits, so a cut never splits a
    page, which keeps plans easy to read in traces.
    """
    if sizes.size == 0 or int(sizes.max()) <= max_bytes:
        return local, remote, sizes
    piece = (max_bytes // unit) * unit if unit <= max_bytes else max_bytes
    counts = -(-sizes // piece)  # ceil
    owner = np.repeat(np.arange(sizes.size), counts)
    first = np.cumsum(counts) - counts
    within = (np.arange(owner.size) - first[owner]) * piece
    piece_sizes = np.minimum(sizes[owner] - within, piece)
    return local[owner] + within, remote[owner] + within, piece_sizes
