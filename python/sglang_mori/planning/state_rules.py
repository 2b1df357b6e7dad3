"""Which hybrid state components we transfer, and how. Decided at registration (fail fast).

Every SGLang 0.5.23 `StateType` has a rule: how its indices address items, and what a
different attention-TP size on the two sides means for it. The index forms (from what
prefill.py / decode.py send per type):

- SINGLE: exactly one slot per request (mamba).
- PAGED: an index list like KV pages; lists of unequal length are cut to the common prefix, as
  both SGLang backends do (swa, dsa, minimax_index_k, block_scale, block_scale_swa).
- EXACT: positional rows (request rows, ring rows, c128 items); a length mismatch fails the
  request instead of shifting rows (qsa_pending, qsa_compressed, swa_ring, c128_state,
  request_row, minimax_dense_kv). Empty on both sides moves nothing.
- TAIL: dsa_tail's 6-tuple ring descriptor (state_tail.py).

TP rules, when the sizes differ:
- WHOLE: the same bytes on every rank (DSA index cache and its tail, MLA): copied whole.
- MLA_WHOLE: whole on every rank of an MLA model (DeepSeek-V4's swa_ring, c128_state,
  request_row); on a non-MLA model their sharding is unknown: refused.
- HEADS: SWA KV: copied whole for MLA, head-sliced like MHA KV otherwise.
- REPLICA: whole on every rank of a non-MLA model (QSA): one elected prefill rank writes it.
- DIMS: mamba: sliced along each tensor's TP axis (state_slice.py).
- EQUAL: equal TP only (MiniMax state, MXFP8 block scales): refused, naming both sizes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Tuple

from sglang_mori.planning.compatibility import mha_head_slice, pair_head_slice
from sglang_mori.planning.errors import UnsupportedLayoutError, mismatch
from sglang_mori.planning.layer_map import map_state_tensors
from sglang_mori.planning.layout import KVLayout, StateLayout
from sglang_mori.planning.physical_layout import head_major
from sglang_mori.planning.state_slice import mamba_slice_blocks, writes_replica
from sglang_mori.planning.state_tail import TailRows

SINGLE = "single"
PAGED = "paged"
EXACT = "exact"
TAIL = "tail"

WHOLE = "whole"
MLA_WHOLE = "mla_whole"
HEADS = "heads"
REPLICA = "replica"
DIMS = "dims"
EQUAL = "equal"

# state type -> (index form, TP rule)
STATE_RULES = {
    "mamba": (SINGLE, DIMS),
    "swa": (PAGED, HEADS),
    "dsa": (PAGED, WHOLE),
    "dsa_tail": (TAIL, WHOLE),
    "qsa_pending": (EXACT, REPLICA),
    "qsa_compressed": (EXACT, REPLICA),
    "swa_ring": (EXACT, MLA_WHOLE),
    "c128_state": (EXACT, MLA_WHOLE),
    "request_row": (EXACT, MLA_WHOLE),
    "minimax_index_k": (PAGED, EQUAL),
    "minimax_dense_kv": (EXACT, EQUAL),
    "block_scale": (PAGED, EQUAL),
    "block_scale_swa": (PAGED, EQUAL),
}
STATE_KINDS = {name: form for name, (form, _) in STATE_RULES.items()}


@dataclass(frozen=True)
class StatePlanSpec:
    """Everything `plan_state` needs for one component, fixed at registration."""

    component: int
    state_type: str
    kind: str  # index form: SINGLE, PAGED, EXACT or TAIL
    pairs: Tuple[Tuple[int, int], ...]  # (prefill tensor, decode tensor) this rank writes
    # Per pair: an item length (whole items), a HeadSlice, a SliceBlocks or a TailRows.
    geometries: Tuple[Hashable, ...]
    src_capacities: Tuple[int, ...]  # per pair: items in the prefill tensor
    dst_capacities: Tuple[int, ...]  # per pair: items in the decode tensor


def _refuse_tp(component: int, state_type: str, prefill: KVLayout, decode: KVLayout, why: str):
    return UnsupportedLayoutError(
        f"state type {state_type!r} (state component {component}) needs equal attention TP "
        f"sizes: prefill={prefill.tp_size} decode={decode.tp_size} ({why})"
    )


def _whole_item_pairs(state_type: str, src: StateLayout, dst: StateLayout, pairs):
    """Pairs copied item for item: both sides' items must be the same size."""
    pairs = tuple((i, j) for i, j in pairs if src.item_lens[i] and dst.item_lens[j])
    for i, j in pairs:
        if src.item_lens[i] != dst.item_lens[j]:
            raise mismatch(
                f"state {state_type!r} tensor {i}->{j} item_len", src.item_lens[i], dst.item_lens[j]
            )
    return pairs, tuple(src.item_lens[i] for i, _ in pairs)


def _tail_pairs(src: StateLayout, dst: StateLayout, pairs):
    """dsa_tail rows may differ in size (ring sizes differ); elided (0-byte) on both or neither."""
    kept = []
    for i, j in pairs:
        if bool(src.item_lens[i]) != bool(dst.item_lens[j]):
            raise mismatch(f"state 'dsa_tail' tensor {i}->{j} item_len", src.item_lens[i],
                           dst.item_lens[j], "one side elides this layer's tail, the other not")
        if src.item_lens[i]:
            kept.append((i, j))
    return tuple(kept), tuple(TailRows(src.item_lens[i], dst.item_lens[j]) for i, j in kept)


def state_plan_spec(component: int, prefill: KVLayout, decode: KVLayout) -> StatePlanSpec:
    src: StateLayout = prefill.states[component]
    dst: StateLayout = decode.states[component]
    state_type = src.state_type
    rule = STATE_RULES.get(state_type)
    if rule is None:
        raise UnsupportedLayoutError(
            f"state type {state_type!r} (state component {component}) is not supported by "
            f"sglang-mori: only {', '.join(sorted(STATE_RULES))} state can be transferred"
        )
    kind, tp_rule = rule
    pairs = map_state_tensors(
        state_type, src.layer_ids, dst.layer_ids, len(src.item_lens), len(dst.item_lens),
        prefill.start_layer - decode.start_layer,
    )
    tp_differs = prefill.tp_size != decode.tp_size
    if tp_differs and tp_rule == EQUAL:
        raise _refuse_tp(component, state_type, prefill, decode,
                         "SGLang's backends do not reslice it either")
    if tp_differs and tp_rule == MLA_WHOLE and not prefill.is_mla:
        raise _refuse_tp(component, state_type, prefill, decode,
                         "outside an MLA model its TP sharding is unknown")
    if kind == TAIL:
        pairs, geometries = _tail_pairs(src, dst, pairs)
    elif tp_differs and tp_rule == DIMS:
        pairs = tuple((i, j) for i, j in pairs if src.item_lens[i] and dst.item_lens[j])
        geometries = tuple(mamba_slice_blocks(component, i, j, prefill, decode) for i, j in pairs)
    elif tp_differs and tp_rule == HEADS and not prefill.is_mla:
        geometries = _swa_head_slices(component, prefill, decode, src, dst, pairs)
    else:
        pairs, geometries = _whole_item_pairs(state_type, src, dst, pairs)
        if tp_differs and tp_rule == REPLICA and not writes_replica(prefill, decode):
            pairs, geometries = (), ()  # another prefill rank of this group writes it
    src_caps, dst_caps = src.capacities(), dst.capacities()
    return StatePlanSpec(
        component=component,
        state_type=state_type,
        kind=kind,
        pairs=tuple(pairs),
        geometries=tuple(geometries),
        src_capacities=tuple(src_caps[i] for i, _ in pairs),
        dst_capacities=tuple(dst_caps[j] for _, j in pairs),
    )


def _swa_head_slices(component, prefill, decode, src, dst, pairs):
    """Non-MLA SWA KV is [K per layer..., V per layer...] pages sharded by heads like MHA KV.

    The head geometry is the KV's (SGLang slices SWA state with the model's KV head count too);
    a SWA pool with its own head count shows up as an item length that does not split.
    """
    order = head_major(prefill.swa_physical_layout)
    if order is None:
        raise UnsupportedLayoutError(
            f"state type 'swa' (state component {component}): head slicing for prefill TP "
            f"{prefill.tp_size} and decode TP {decode.tp_size} cannot cut pages of the "
            f"{prefill.swa_physical_layout!r} layout"
        )
    base = mha_head_slice(prefill, decode)
    return tuple(
        pair_head_slice(base, i, j, src.item_lens[i], dst.item_lens[j], "state 'swa' tensor")
        .with_head_major(order)
        for i, j in pairs
    )
