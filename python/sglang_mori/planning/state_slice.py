"""Mamba state with different attention-TP sizes: which bytes of one state slot go where.

SGLang's mamba pools (MambaPool behind HybridLinearKVPool / HybridReqToTokenPool) register one
tensor per (state field, layer); one item is one request's slot. Each tensor is sharded by TP
along one axis of the slot, its "slice axis": the first per-slot axis ([dim, ...], conv and
temporal state) or, for Kimi's conv state, the second ([K-1, dim]). An item is therefore
`outer` rows (the axes before the slice axis) of `dim` entries of `bytes_per_dim` bytes.
GDN's conv state concatenates q, k and v along the slice axis and shards each of them on its
own (`conv_groups`, their full sizes). A slice dim of 0 marks a tensor whole on every rank.

We reason in global positions along the axis, per sub-block: prefill rank p holds
[p*F/Tp, (p+1)*F/Tp) of a sub-block of full size F, decode rank r holds [r*F/Td, (r+1)*F/Td);
a pair exchanges the intersection. That gives SGLang's `compute_mamba_state_slice_byte_blocks`
for every pair it connects (tested against it), in both directions, and for Kimi's layout.

All of it is decided at registration: `mamba_slice_blocks` returns the byte blocks inside one
item as a hashable `SliceBlocks`; per request the planner adds the slot offsets (numpy).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Tuple

import numpy as np

from sglang_mori.planning.errors import UnsupportedLayoutError, mismatch
from sglang_mori.planning.layout import KVLayout, StateLayout
from sglang_mori.planning.ranges import Ranges, merge_adjacent_ranges


@dataclass(frozen=True)
class SliceBlocks:
    """Byte blocks (offset in the prefill item, offset in the decode item, size) of one slot."""

    src_item_len: int
    dst_item_len: int
    blocks: Tuple[Tuple[int, int, int], ...]  # may be empty: this rank writes nothing

    def ranges(self, src_slot: int, dst_slot: int) -> Ranges:
        table = np.asarray(self.blocks, dtype=np.int64).reshape(-1, 3)
        local = src_slot * self.src_item_len + table[:, 0]
        remote = dst_slot * self.dst_item_len + table[:, 1]
        return merge_adjacent_ranges(local, remote, table[:, 2].copy())


def writes_replica(prefill: KVLayout, decode: KVLayout) -> bool:
    """Whether this prefill rank writes state that is whole on every rank (SGLang's election).

    Scatter (prefill TP <= decode TP): each decode rank has one sender, which writes. Aggregation:
    of the prefill ranks feeding one decode rank, the first writes (the rank SGLang keeps as the
    real sender for MLA, so the choice agrees with MLA's dummy ranks too).
    """
    if prefill.tp_size <= decode.tp_size:
        return True
    return prefill.tp_rank % (prefill.tp_size // decode.tp_size) == 0


def _outer(state: StateLayout, index: int) -> int:
    return state.outer_counts[index] if state.outer_counts else 1


def _sub_blocks(src: StateLayout, dst: StateLayout, i: int, j: int, full: int, what: str):
    src_groups = src.conv_groups[i] if src.conv_groups else ()
    dst_groups = dst.conv_groups[j] if dst.conv_groups else ()
    if src_groups and dst_groups and tuple(src_groups) != tuple(dst_groups):
        raise mismatch(f"{what} conv sub-blocks", list(src_groups), list(dst_groups))
    groups = src_groups or dst_groups
    # SGLang slices by sub-block only when they tile the whole axis; otherwise one block.
    return tuple(groups) if groups and sum(groups) == full else (full,)


def mamba_slice_blocks(
    component: int,
    i: int,
    j: int,
    prefill: KVLayout,
    decode: KVLayout,
) -> SliceBlocks:
    """Blocks of prefill tensor i's slot that land in decode tensor j's slot (TP sizes differ)."""
    src: StateLayout = prefill.states[component]
    dst: StateLayout = decode.states[component]
    what = f"state 'mamba' tensor {i}->{j}"
    src_item, dst_item = src.item_lens[i], dst.item_lens[j]
    if not src.slice_dims or not dst.slice_dims:
        raise UnsupportedLayoutError(
            f"state type 'mamba' (state component {component}) with prefill TP {prefill.tp_size} "
            f"and decode TP {decode.tp_size}: slicing it needs the per-tensor slice dims "
            f"(KVArgs.state_dim_per_tensor), reported by prefill: {bool(src.slice_dims)}, "
            f"decode: {bool(dst.slice_dims)}"
        )
    src_dim, dst_dim = src.slice_dims[i], dst.slice_dims[j]
    if (src_dim == 0) != (dst_dim == 0):
        raise mismatch(f"{what} slice dim", src_dim, dst_dim,
                       "one side holds the tensor whole on every rank, the other sharded")
    if src_dim == 0:
        if src_item != dst_item:
            raise mismatch(f"{what} item_len", src_item, dst_item, "a replicated tensor")
        blocks = ((0, 0, src_item),) if writes_replica(prefill, decode) else ()
        return SliceBlocks(src_item, dst_item, blocks)
    outer = _outer(src, i)
    if dst.outer_counts and _outer(dst, j) != outer:
        raise mismatch(f"{what} outer rows", outer, _outer(dst, j))
    full = src_dim * prefill.tp_size
    if dst_dim * decode.tp_size != full:
        raise mismatch(
            f"{what} slice dim", f"{src_dim} x TP {prefill.tp_size}",
            f"{dst_dim} x TP {decode.tp_size}", "the full axis must be the same size",
        )
    src_unit, dst_unit = src_item // (src_dim * outer), dst_item // (dst_dim * outer)
    if src_unit * src_dim * outer != src_item or dst_unit * dst_dim * outer != dst_item \
            or src_unit != dst_unit:
        raise mismatch(
            f"{what} item_len", src_item, dst_item,
            f"expected {outer} rows of {src_dim} vs {dst_dim} entries of equal size",
        )
    logical = _logical_blocks(
        _sub_blocks(src, dst, i, j, full, what), prefill.tp_size, prefill.tp_rank,
        decode.tp_size, decode.tp_rank, what,
    )
    rows = np.arange(outer, dtype=np.int64)[:, None]
    table = np.asarray(logical, dtype=np.int64)
    src_off = (rows * src_dim + table[:, 0]) * src_unit
    dst_off = (rows * dst_dim + table[:, 1]) * src_unit
    sizes = np.broadcast_to(table[:, 2] * src_unit, src_off.shape)
    blocks = tuple(zip(src_off.ravel().tolist(), dst_off.ravel().tolist(), sizes.ravel().tolist()))
    return SliceBlocks(src_item, dst_item, blocks)


def _logical_blocks(
    groups: Sequence[int], src_tp: int, src_rank: int, dst_tp: int, dst_rank: int, what: str
):
    """(prefill position, decode position, count) along the slice axis, one per sub-block."""
    blocks = []
    src_base = dst_base = 0
    for full in groups:
        if full % src_tp or full % dst_tp:
            raise UnsupportedLayoutError(
                f"{what}: a sub-block of {full} entries does not split over prefill TP {src_tp} "
                f"and decode TP {dst_tp}"
            )
        src_sub, dst_sub = full // src_tp, full // dst_tp
        first = max(src_rank * src_sub, dst_rank * dst_sub)
        end = min((src_rank + 1) * src_sub, (dst_rank + 1) * dst_sub)
        if end > first:
            blocks.append((src_base + first - src_rank * src_sub,
                           dst_base + first - dst_rank * dst_sub, end - first))
        src_base += src_sub
        dst_base += dst_sub
    if not blocks:
        raise UnsupportedLayoutError(
            f"{what}: prefill rank {src_rank}/{src_tp} and decode rank {dst_rank}/{dst_tp} share "
            "no part of the state"
        )
    return blocks
