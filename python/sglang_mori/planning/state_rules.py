"""Which hybrid state components we transfer, and how. Decided at registration (fail fast).

- "mamba": one state slot per request, copied whole. Its tensors are sharded by attention TP,
  so different TP sizes would need a per-tensor slice plan: unsupported.
- "swa", "dsa": page-indexed like KV; contiguous index runs per tensor pair. Non-MLA SWA is
  head-sharded like MHA KV, so it needs equal TP; MLA SWA and the DSA index cache are the same on
  every rank, so any rank pair can copy them whole (SGLang's rule too).
- Everything else (qsa_*, swa_ring, c128_state, minimax_*, dsa_tail, request_row,
  block_scale*, ...) is refused with UnsupportedLayoutError naming the type.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

from sglang_mori.planning.errors import UnsupportedLayoutError, mismatch
from sglang_mori.planning.layer_map import map_state_tensors
from sglang_mori.planning.layout import KVLayout, StateLayout

SINGLE_SLOT = "single_slot"  # exactly one index per request
PAGED = "paged"  # index lists like KV pages

STATE_KINDS = {"mamba": SINGLE_SLOT, "swa": PAGED, "dsa": PAGED}


@dataclass(frozen=True)
class StatePlanSpec:
    """Everything `plan_state` needs for one component, fixed at registration."""

    component: int
    state_type: str
    kind: str
    pairs: Tuple[Tuple[int, int], ...]  # (prefill tensor, decode tensor); elided tensors left out
    item_lens: Tuple[int, ...]  # per pair, equal on both sides
    src_capacities: Tuple[int, ...]  # per pair: items in the prefill tensor
    dst_capacities: Tuple[int, ...]  # per pair: items in the decode tensor


def state_plan_spec(
    component: int, prefill: KVLayout, decode: KVLayout
) -> StatePlanSpec:
    src: StateLayout = prefill.states[component]
    dst: StateLayout = decode.states[component]
    state_type = src.state_type
    kind = STATE_KINDS.get(state_type)
    if kind is None:
        raise UnsupportedLayoutError(
            f"state type {state_type!r} (state component {component}) is not supported by "
            f"sglang-mori: only {', '.join(sorted(STATE_KINDS))} state can be transferred; use "
            "SGLang's built-in mori or mooncake backend for this model"
        )
    if prefill.tp_size != decode.tp_size:
        if state_type == "mamba":
            raise UnsupportedLayoutError(
                f"state type 'mamba' (state component {component}) with prefill TP "
                f"{prefill.tp_size} and decode TP {decode.tp_size}: mamba state is sharded by "
                "TP and sglang-mori copies it only whole; use equal attention TP sizes"
            )
        if state_type == "swa" and not prefill.is_mla:
            raise UnsupportedLayoutError(
                f"state type 'swa' (state component {component}) of a non-MLA model with "
                f"prefill TP {prefill.tp_size} and decode TP {decode.tp_size}: the SWA cache is "
                "sharded by heads and sglang-mori copies it only whole; use equal attention TP sizes"
            )
    pairs = map_state_tensors(
        state_type, src.layer_ids, dst.layer_ids, len(src.item_lens), len(dst.item_lens)
    )
    # A 0-byte item is an elided tensor (DSA shares index caches between layers): nothing moves.
    pairs = tuple((i, j) for i, j in pairs if src.item_lens[i] and dst.item_lens[j])
    for i, j in pairs:
        if src.item_lens[i] != dst.item_lens[j]:
            raise mismatch(
                f"state {state_type!r} tensor {i}->{j} item_len", src.item_lens[i], dst.item_lens[j]
            )
    src_caps, dst_caps = src.capacities(), dst.capacities()
    return StatePlanSpec(
        component=component,
        state_type=state_type,
        kind=kind,
        pairs=pairs,
        item_lens=tuple(src.item_lens[i] for i, _ in pairs),
        src_capacities=tuple(src_caps[i] for i, _ in pairs),
        dst_capacities=tuple(dst_caps[j] for _, j in pairs),
    )
