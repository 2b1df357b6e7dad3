"""Which decode buffer receives each prefill buffer. Computed once per peer, at registration.

Rules, in order (the same outcomes as SGLang's mori backend, without its guessing):
1. Equal buffer counts (and no conflicting layer ids): buffer i -> buffer i (both sides list
   the same PP stage).
2. Both sides report layer ids: pair by id, occurrences in order (a layer id appears once for
   its K buffer and once for its V buffer, and the K comes first on both sides).
3. Otherwise slice by layer: the decode holds more layers (all PP stages, and/or a draft model
   the prefill does not send). Prefill layer i of its stage goes to decode layer
   `prefill.start_layer - decode.start_layer + i`, per group (K and V for MHA, one for MLA);
   draft buffers, listed last on both sides, map one to one. We use the declared
   `num_draft_entries` rather than inferring draft layers from count ratios.
"""

from __future__ import annotations

from collections import defaultdict, deque
from typing import Dict, Deque, List, Sequence, Tuple

from sglang_mori.planning.errors import InvalidLayoutError, UnsupportedLayoutError, mismatch
from sglang_mori.planning.layout import KVLayout

Pairs = Tuple[Tuple[int, int], ...]


def pair_by_layer_id(src_ids: Sequence[int], dst_ids: Sequence[int], what: str) -> Pairs:
    """Pair each prefill entry with the next unused decode entry of the same layer id."""
    free: Dict[int, Deque[int]] = defaultdict(deque)
    for j, layer_id in enumerate(dst_ids):
        free[layer_id].append(j)
    pairs: List[Tuple[int, int]] = []
    for i, layer_id in enumerate(src_ids):
        if not free[layer_id]:
            raise mismatch(
                f"{what} layer {layer_id}",
                f"present ({list(src_ids).count(layer_id)} buffers)",
                f"{list(dst_ids).count(layer_id)} buffers",
                "the decode side lacks a buffer for this layer",
            )
        pairs.append((i, free[layer_id].popleft()))
    return tuple(pairs)


def map_kv_buffers(prefill: KVLayout, decode: KVLayout) -> Pairs:
    """(prefill KV buffer index, decode KV buffer index) for every prefill KV buffer."""
    n_src, n_dst = prefill.num_kv_buffers, decode.num_kv_buffers
    src_ids, dst_ids = prefill.kv_layer_ids, decode.kv_layer_ids
    if n_src == n_dst and not (src_ids and dst_ids and src_ids != dst_ids):
        return tuple((i, i) for i in range(n_src))
    if src_ids and dst_ids:
        return pair_by_layer_id(prefill.kv_layer_ids, decode.kv_layer_ids, "KV")
    if prefill.kv_layer_ids or decode.kv_layer_ids:
        raise mismatch(
            "kv_layer_ids",
            f"{len(prefill.kv_layer_ids)} ids",
            f"{len(decode.kv_layer_ids)} ids",
            "with different buffer counts both sides must report layer ids",
        )
    return _slice_by_layer(prefill, decode)


def _groups(layout: KVLayout, side: str) -> Tuple[int, int]:
    """(layers per group in the main model, groups) for one side."""
    groups = 1 if layout.is_mla else 2
    main = layout.num_kv_buffers - layout.num_draft_entries
    if main % groups or layout.num_draft_entries % groups:
        raise InvalidLayoutError(
            f"{side}: {main} main and {layout.num_draft_entries} draft KV buffers do not split "
            f"into {groups} equal groups"
        )
    return main // groups, groups


def _slice_by_layer(prefill: KVLayout, decode: KVLayout) -> Pairs:
    src_layers, groups = _groups(prefill, "prefill")
    dst_layers, _ = _groups(decode, "decode")
    offset = prefill.start_layer - decode.start_layer
    if offset < 0 or offset + src_layers > dst_layers:
        raise mismatch(
            "KV layers",
            f"[{prefill.start_layer}, {prefill.start_layer + src_layers})",
            f"[{decode.start_layer}, {decode.start_layer + dst_layers})",
            "the decode side must hold every layer of the prefill stage",
        )
    pairs = [
        (g * src_layers + i, g * dst_layers + offset + i)
        for g in range(groups)
        for i in range(src_layers)
    ]
    if prefill.num_draft_entries:
        if prefill.num_draft_entries != decode.num_draft_entries:
            raise mismatch(
                "num_draft_entries",
                prefill.num_draft_entries,
                decode.num_draft_entries,
                "the prefill sends draft-model KV the decode side does not hold",
            )
        src_main = prefill.num_kv_buffers - prefill.num_draft_entries
        dst_main = decode.num_kv_buffers - decode.num_draft_entries
        pairs += [(src_main + k, dst_main + k) for k in range(prefill.num_draft_entries)]
    return tuple(pairs)


# State types SGLang registers as one tensor per model layer of the PP stage, in layer order, in
# this many equal groups (DSATokenToKVPool's index buffers; its compress tail lists every
# layer's key buffers, then every layer's score buffers) and without layer ids. A PP stage's
# tensors then sit at its start layer in each group of a peer holding more layers, as SGLang's
# Mooncake places them (get_mla_kv_ptrs_with_pp, slice_dsa_tail_dst_ptrs_for_pp). Other
# id-less types are not laid out per model layer (a SWA pool holds only its SWA layers, whose
# global ids KVArgs does not carry), so a count mismatch stays refused for them.
PER_LAYER_GROUPS = {"dsa": 1, "dsa_tail": 2}


def map_state_tensors(
    state_type: str,
    src_ids: Sequence[int],
    dst_ids: Sequence[int],
    n_src: int,
    n_dst: int,
    layer_offset: int = 0,
) -> Pairs:
    """(prefill tensor, decode tensor) pairs of one state component. `layer_offset`: the
    prefill stage's first layer in the decode's model (prefill start_layer - decode start_layer)."""
    if n_src == n_dst and not (src_ids and dst_ids and tuple(src_ids) != tuple(dst_ids)):
        return tuple((i, i) for i in range(n_src))
    if src_ids and dst_ids:
        return pair_by_layer_id(src_ids, dst_ids, f"state {state_type!r}")
    groups = PER_LAYER_GROUPS.get(state_type)
    if groups and not src_ids and not dst_ids:
        return _per_layer_stage(state_type, groups, n_src, n_dst, layer_offset)
    raise UnsupportedLayoutError(
        f"state {state_type!r}: prefill has {n_src} tensors and decode {n_dst}; pairing them "
        "needs layer ids from both sides, and at least one side reports none"
    )


def _per_layer_stage(state_type: str, groups: int, n_src: int, n_dst: int, offset: int) -> Pairs:
    if n_src % groups or n_dst % groups:
        raise mismatch(
            f"state {state_type!r} tensors", n_src, n_dst,
            f"one tensor per layer in {groups} equal groups on each side",
        )
    src_layers, dst_layers = n_src // groups, n_dst // groups
    if offset < 0 or offset + src_layers > dst_layers:
        raise mismatch(
            f"state {state_type!r} layers",
            f"[{offset}, {offset + src_layers})",
            f"{dst_layers} layers",
            "the decode side must hold every layer of the prefill stage",
        )
    return tuple(
        (g * src_layers + i, g * dst_layers + offset + i) for g in range(groups) for i in range(src_layers)
    )
