"""Item-indexed state components of one harness rank (KVLayout.deepseek_state): DeepSeek-V4 and
V3.2 state, QSA, MiniMax sparse state and MXFP8 KV block scales.

Each component is registered the way SGLang's `setup_state_kv_args` registers the pool's buffers
(one tensor per layer, item lengths, no layer ids) and each request's indices are the ones
prefill.py / decode.py compute for it (`_swa_payload`, `_dsa_pages_payload`, `_swa_ring_payload`,
`_request_state_payload`, `_request_row_payload`, `_dsa_tail_payload`), from the room's token
count, its pages, its request slot (the plan's state slot stands for req_pool_idx) and decode's
cached prefix:

- swa: SWA pages of the window's tokens [floor_page(max(prefix, seq - window)), seq), through a
  per-side KV page -> SWA page map (SGLang's translate_swa_indices_for_transfer);
- dsa: the KV pages after decode's cached prefix (the indexer shares the KV page ids);
- swa_ring: one row per position of the last `window` tokens, slot * ring + pos % ring;
- c128_state: the ring page holding the pending partial block, none at a block boundary;
- request_row: the request's row;
- dsa_tail: SGLang's 6-tuple [row, start, count, 0, count2, ring] for the seq % index_kpool live
  tokens of the tail ring, or [] when none are live;
- qsa_pending: the request row (get_qsa_pending_state_indices);
- qsa_compressed, minimax_dense_kv, block_scale: every KV page of the request, the cached prefix
  included (`_full_kv_pages_payload`);
- minimax_index_k: the KV pages after decode's cached prefix (minimax_index_transfer_pages);
- block_scale_swa: the SWA pages of the window, as swa (`_swa_payload`).

Every tensor is cut into "units" (an item, or one ring slot for dsa_tail), and every request's
units come out in position order on both sides, so prefill unit i of a room belongs on decode
unit i of that room whatever the two sides' slots and ring sizes. Prefill fills every unit with
the pattern keyed by (component, global tensor, prefill DP rank) and the prefill unit; the state
is whole on every TP rank of an MLA model, so all TP ranks of a DP rank hold the same bytes, as
in SGLang. Types kept as TP shards (MiniMax, block scales; equal TP only) key the pattern by the
attention-TP rank too, so a shard landing on another rank shows. Under prefill PP a stage holds
only its layers' tensors of dsa / dsa_tail (config.PP_STATE_GROUPS), keyed by their global index.
Decode checks each succeeded room unit for unit and that no unit outside its rooms was written.
"""

from __future__ import annotations

from typing import Dict, List

import numpy as np
import torch

from harness.pd import pattern as pat
from harness.pd.config import EQUAL_TP_STATE_TYPES, PP_STATE_GROUPS, DeepSeekStateSpec, HarnessConfig
from harness.pd.plan import Plan, RoomPlan

KIND_BASE = 32  # pattern kinds of these tensors: KIND_BASE + component (pattern.py uses 1..8)
_FILL_UNITS = 8192

# How each type's indices address its items (see the module docstring).
SWA_PAGES, SUFFIX_PAGES, ALL_PAGES, RING_ROWS, C128_PAGE, ROW, TAIL = (
    "swa_pages", "suffix_pages", "all_pages", "ring_rows", "c128_page", "row", "tail",
)
ADDRESSING = {
    "swa": SWA_PAGES, "block_scale_swa": SWA_PAGES,
    "dsa": SUFFIX_PAGES, "minimax_index_k": SUFFIX_PAGES,
    "qsa_compressed": ALL_PAGES, "minimax_dense_kv": ALL_PAGES, "block_scale": ALL_PAGES,
    "swa_ring": RING_ROWS, "c128_state": C128_PAGE, "request_row": ROW, "qsa_pending": ROW,
    "dsa_tail": TAIL,
}
# SGLang registers these with layer ids (QSATokenToKVPool's get_qsa_*_state_layer_ids).
LAYER_ID_TYPES = ("qsa_pending", "qsa_compressed")


def stage_tensors(spec: DeepSeekStateSpec, cfg: HarnessConfig, side: str, pp_rank: int) -> List[int]:
    """Global indices of the component's tensors this rank holds: all of them, or on a prefill
    PP stage its layers' tensors in each per-layer group."""
    pp = cfg.prefill_pp if side == "prefill" else 1
    if pp == 1:
        return list(range(len(spec.item_bytes)))
    layers, groups = cfg.layout.num_layers, PP_STATE_GROUPS[spec.state_type]
    per = layers // pp
    return [g * layers + l for g in range(groups) for l in range(pp_rank * per, (pp_rank + 1) * per)]


def ring_of(spec: DeepSeekStateSpec, side: str) -> int:
    if side == "decode" and spec.decode_ring is not None:
        return spec.decode_ring
    return spec.ring


def swa_page_map(cfg: HarnessConfig, plan: Plan, side: str) -> np.ndarray:
    """KV page -> SWA page of one side: a seeded permutation (page 0, the padding page, stays 0),
    so SWA indices differ from the KV pages as they do in SGLang's SWA pools."""
    pages = plan.prefill_pool_pages if side == "prefill" else plan.decode_pool_pages
    rng = np.random.Generator(np.random.PCG64(cfg.seed + (11 if side == "prefill" else 13)))
    return np.concatenate([[0], 1 + rng.permutation(pages - 1)]).astype(np.int64)


class ComponentGeometry:
    """Where one component's units of a room are on one side, and the indices SGLang sends."""

    def __init__(self, spec: DeepSeekStateSpec, cfg: HarnessConfig, plan: Plan, side: str):
        self.spec, self.side, self.ps = spec, side, cfg.layout.page_size
        self.ring = ring_of(spec, side)
        slots = plan.prefill_state_slots if side == "prefill" else plan.decode_state_slots
        pool_pages = plan.prefill_pool_pages if side == "prefill" else plan.decode_pool_pages
        form = self.form = ADDRESSING[spec.state_type]
        self.swa_map = swa_page_map(cfg, plan, side) if form == SWA_PAGES else None
        self.units_per_item = self.ring if form == TAIL else 1
        if form in (SWA_PAGES, SUFFIX_PAGES, ALL_PAGES):
            self.num_units = pool_pages
        elif form in (RING_ROWS, TAIL):
            self.num_units = slots * self.ring
        elif form == C128_PAGE:
            self.num_units = slots * (self.ring // spec.ratio)
        else:  # ROW
            self.num_units = slots

    def _slot(self, room: RoomPlan) -> int:
        return room.prefill_state if self.side == "prefill" else room.decode_state

    def _pages(self, room: RoomPlan) -> np.ndarray:
        return (room.prefill_pages if self.side == "prefill" else room.decode_pages).astype(np.int64)

    def units(self, room: RoomPlan) -> np.ndarray:
        """This side's units of the room, in position order (int64)."""
        spec, seq, slot = self.spec, room.tokens, self._slot(room)
        form = self.form
        if form == SWA_PAGES:
            start = max(room.prefix_pages * self.ps, seq - spec.window) // self.ps * self.ps
            return self.swa_map[self._pages(room)[start // self.ps : -(-seq // self.ps)]]
        if form == SUFFIX_PAGES:
            return self._pages(room)[room.prefix_pages :]
        if form == ALL_PAGES:
            return self._pages(room)
        if form == RING_ROWS:
            positions = np.arange(max(0, seq - spec.window), seq, dtype=np.int64)
            return slot * self.ring + positions % self.ring
        if form == C128_PAGE:
            if seq % spec.ratio == 0:
                return np.zeros(0, dtype=np.int64)
            per_request = self.ring // spec.ratio
            return np.array([slot * per_request + ((seq - 1) % self.ring) // spec.ratio], dtype=np.int64)
        if form == ROW:
            return np.array([slot], dtype=np.int64)
        live = seq % spec.ratio  # dsa_tail: tokens since the last full index_kpool group
        positions = np.arange(seq - live, seq, dtype=np.int64)
        return slot * self.ring + positions % self.ring

    def indices(self, room: RoomPlan):
        """The state indices SGLang's scheduler sends for this component and room."""
        if self.form == TAIL:
            live = room.tokens % self.spec.ratio
            if live == 0:
                return []  # get_dsa_tail_state_indices: nothing live, nothing sent
            start = (room.tokens - live) % self.ring
            first = min(live, self.ring - start)
            return [self._slot(room), start, first, 0, live - first, self.ring]
        units = self.units(room)
        return units.astype(np.int32)


class DeepSeekState:
    """The DeepSeek state tensors of one rank (empty when the layout has none)."""

    def __init__(self, cfg: HarnessConfig, plan: Plan, side: str, pp_rank: int = 0):
        self.cfg, self.plan, self.side = cfg, plan, side
        self.specs = cfg.layout.deepseek_state
        self.geometry = [ComponentGeometry(s, cfg, plan, side) for s in self.specs]
        # Per component: the global index of each tensor this rank holds, and the tensors.
        self.tensor_ids = [stage_tensors(s, cfg, side, pp_rank) for s in self.specs]
        self.tensors: List[List[torch.Tensor]] = [
            [torch.zeros((g.num_units, s.item_bytes[i]), dtype=torch.uint8) for i in ids]
            for s, g, ids in zip(self.specs, self.geometry, self.tensor_ids)
        ]
        # The scheduler hands state_indices a request slot; the harness finds the room by it.
        self._room_by_slot: Dict[int, RoomPlan] = {
            (r.prefill_state if side == "prefill" else r.decode_state): r for r in plan.rooms
        }

    def __bool__(self) -> bool:
        return bool(self.specs)

    @staticmethod
    def key(cfg: HarnessConfig, component: int, tensor: int, prefill_dp: int, tp_rank: int = 0) -> int:
        """Pattern key of global tensor `tensor`; `tp_rank` matters for TP-sharded types only."""
        sharded = cfg.layout.deepseek_state[component].state_type in EQUAL_TP_STATE_TYPES
        return pat.buffer_key(cfg.seed, KIND_BASE + component, tensor, prefill_dp * 16 + (tp_rank if sharded else 0))

    def fill(self, dp_rank: int, tp_rank: int = 0) -> None:
        for c, tensors in enumerate(self.tensors):
            for t, tensor in zip(self.tensor_ids[c], tensors):
                view, key = tensor.numpy(), self.key(self.cfg, c, t, dp_rank, tp_rank)
                for start in range(0, view.shape[0], _FILL_UNITS):
                    rows = np.arange(start, min(start + _FILL_UNITS, view.shape[0]))
                    view[rows] = pat.pattern(key, rows, np.array([0]), view.shape[1])[:, 0]

    def register(self, kv_args) -> None:
        """Append one state component per spec to kv_args, as append_state_component does."""
        from sglang.srt.disaggregation.base.conn import StateType

        for spec, geo, tensors, ids in zip(self.specs, self.geometry, self.tensors, self.tensor_ids):
            kv_args.state_types.append(StateType(spec.state_type))
            kv_args.state_data_ptrs.append([t.data_ptr() for t in tensors])
            kv_args.state_data_lens.append([t.nbytes for t in tensors])
            kv_args.state_item_lens.append([t[0].nbytes * geo.units_per_item for t in tensors])
            kv_args.state_dim_per_tensor.append([])
            kv_args.state_slice_outer_counts.append([])
            kv_args.state_layer_ids.append(list(ids) if spec.state_type in LAYER_ID_TYPES else [])
            kv_args.state_conv_shard_groups.append([])

    def indices(self, slot: int) -> list:
        room = self._room_by_slot[int(slot)]
        return [g.indices(room) for g in self.geometry]


def check_room(pool, room: RoomPlan, bad) -> int:
    """Decode: every unit of the room holds prefill's unit of the same position; bytes checked."""
    state: DeepSeekState = pool.deepseek_state
    checked = 0
    for c, (spec, geo) in enumerate(zip(state.specs, state.geometry)):
        src = ComponentGeometry(spec, pool.cfg, state.plan, "prefill")
        p_units, d_units = src.units(room), geo.units(room)
        if len(p_units) != len(d_units):
            bad(f"room#{room.index} {spec.state_type}: harness plans {len(p_units)} prefill and {len(d_units)} decode units")
            continue
        for t, tensor in zip(state.tensor_ids[c], state.tensors[c]):
            view = tensor.numpy()
            # Equal TP for the sharded types: decode rank r holds prefill rank r's shard.
            key = state.key(pool.cfg, c, t, room.prefill_dp, pool.attn_rank)
            want = pat.pattern(key, p_units, np.array([0]), view.shape[1])[:, 0]
            got = view[d_units]
            checked += got.nbytes
            wrong = np.flatnonzero(~(got == want).all(axis=1))
            if len(wrong):
                i = int(wrong[0])
                what = "zeros (never written)" if not got[i].any() else "foreign bytes"
                bad(
                    f"room#{room.index} {spec.state_type} (state component {c}) tensor {t}: {len(wrong)} of "
                    f"{len(d_units)} units differ; decode unit {d_units[i]} (prefill unit {p_units[i]}) holds {what}"
                )
    return checked


def check_untouched(pool, rooms, bad) -> None:
    """Decode: units no room of this rank uses are still zero."""
    state: DeepSeekState = pool.deepseek_state
    for c, (spec, geo) in enumerate(zip(state.specs, state.geometry)):
        used = np.zeros(geo.num_units, dtype=bool)
        for room in rooms:
            used[geo.units(room)] = True
        for t, tensor in zip(state.tensor_ids[c], state.tensors[c]):
            dirty = np.flatnonzero(tensor.numpy()[~used].any(axis=1))
            if len(dirty):
                unit = int(np.flatnonzero(~used)[dirty[0]])
                bad(f"{spec.state_type} (state component {c}) tensor {t}: {len(dirty)} unassigned units written, e.g. {unit}")


def deepseek_v4_state(page_size: int):
    """DeepSeek-V4's state components at small scale: a SWA window over pages with a partial
    page, ring rows of a 6-token window, a c128-like ring (ratio 4, so rooms hit block
    boundaries and send nothing) and the draft's request row."""
    return (
        DeepSeekStateSpec("swa", item_bytes=(32, 48), window=2 * page_size + 3),
        DeepSeekStateSpec("swa_ring", item_bytes=(24, 40), window=6, ring=8),
        DeepSeekStateSpec("c128_state", item_bytes=(64, 64), ring=8, ratio=4),
        DeepSeekStateSpec("request_row", item_bytes=(8,)),
    )


# DeepSeek-V3.2's DSA index cache and tail at small scale: index_kpool 4 (the tail holds seq % 4
# live tokens), and decode's tail ring has 2 extra slots (SGLang's tail_extra_slots).
DEEPSEEK_V32_DSA_STATE = (
    DeepSeekStateSpec("dsa", item_bytes=(40, 40)),
    DeepSeekStateSpec("dsa_tail", item_bytes=(16, 16), ring=4, ratio=4, decode_ring=6),
)
