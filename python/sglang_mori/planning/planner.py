"""`TransferPlanner`: all transfers from this prefill rank to one decode rank.

Built once when the decode rank registers (every layout check happens there and raises a
registration error); then called once per chunk with that chunk's indices.

Chunks are independent: offsets come from absolute page indices (page * item_len), so a chunk's
plan depends on nothing but its own page slice. Call `plan_kv` with exactly the pages of the
chunk (SGLang's `send(kv_indices)` slice and the matching slice of the decode's page list), and
`plan_state` only with the last chunk, where SGLang hands over state indices.
"""

from __future__ import annotations

from typing import Dict, Hashable, List, Optional, Tuple

import numpy as np

from sglang_mori.planning.compatibility import (
    check_equal_item_lens,
    check_scalar_fields,
    mha_head_slice,
    pair_head_slice,
)
from sglang_mori.planning.dcp import (
    check_dcp_item_lens,
    dcp_token_rows,
    is_draft_pair,
    needs_dcp_relayout,
    token_ranges,
)
from sglang_mori.planning.errors import PlanError
from sglang_mori.planning.head_slice import HeadSlice, head_sliced_ranges
from sglang_mori.planning.layer_map import map_kv_buffers
from sglang_mori.planning.layout import KVLayout
from sglang_mori.planning.ranges import (
    Ranges,
    as_index_array,
    check_in_range,
    check_paired,
    UnitSizes,
    contiguous_item_ranges,
    frozen_item_ranges,
)
from sglang_mori.planning.state_rules import (
    EXACT,
    PAGED,
    SINGLE,
    TAIL,
    StatePlanSpec,
    state_plan_spec,
)
from sglang_mori.planning.state_slice import SliceBlocks
from sglang_mori.planning.state_tail import TailRows, tail_pieces, tail_ranges
from sglang_mori.planning.transfer_plan import BufferTransfer, TransferPlan, frozen_int64

_umax = np.maximum.reduce  # ndarray.max without its Python wrapper


def _read_only(ranges: Ranges) -> Ranges:
    """The ranges checked (1-D, equal lengths) and frozen as int64, once per geometry; every
    pair of that geometry then shares them (BufferTransfer.of_frozen). The same checks as
    BufferTransfer's, without building one (a frozen dataclass's setattrs cost more than the
    checks: this runs on every chunk, issue 28)."""
    local, remote, sizes = (frozen_int64(a) for a in ranges)
    if not (local.shape == remote.shape == sizes.shape) or local.ndim != 1:
        raise ValueError("ranges must be 1-D and of equal length, got shapes "
                         f"{[local.shape, remote.shape, sizes.shape]}")
    return local, remote, sizes


class TransferPlanner:
    """Plans byte ranges from one prefill rank (local) to one decode rank (remote).

    Raises at construction: LayoutMismatchError, UnsupportedLayoutError, InvalidLayoutError.
    Raises per chunk: PlanError (bad or out-of-range indices) - fail that request only.
    """

    def __init__(self, prefill: KVLayout, decode: KVLayout):
        check_scalar_fields(prefill, decode)
        self.prefill = prefill
        self.decode = decode
        # Prefill DCP 1 into decode DCP N > 1 (MLA): tokens are striped over decode ranks, planned
        # by plan_kv_dcp; plan_kv refuses such a pair. Other DCP topologies raise here.
        self.dcp_relayout: bool = needs_dcp_relayout(prefill, decode)
        self.kv_pairs: Tuple[Tuple[int, int], ...] = map_kv_buffers(prefill, decode)
        base_slice = mha_head_slice(prefill, decode)
        # Which heads move (MHA with different TP sizes), else None. Its head_bytes is a
        # placeholder: each buffer pair gets its own byte geometry below (K and V may differ).
        self.head_slice: Optional[HeadSlice] = base_slice
        # One geometry key per KV pair; pairs with the same key share one set of arrays.
        self._kv_geometry: List[Hashable] = []
        self._dcp_token_bytes: Tuple[int, ...] = ()
        self._dcp_draft: Tuple[bool, ...] = ()
        if self.dcp_relayout:
            self._dcp_token_bytes = check_dcp_item_lens(prefill, decode, self.kv_pairs)
            self._dcp_draft = tuple(is_draft_pair(prefill, i) for i, _ in self.kv_pairs)
            self._kv_geometry = list(zip(self._dcp_draft, self._dcp_token_bytes))
        elif base_slice is None:
            check_equal_item_lens(
                self.kv_pairs, prefill.kv_item_lens, decode.kv_item_lens, "KV buffer"
            )
            self._kv_geometry = [prefill.kv_item_lens[i] for i, _ in self.kv_pairs]
        else:
            self._kv_geometry = [
                pair_head_slice(base_slice, i, j, prefill.kv_item_lens[i], decode.kv_item_lens[j])
                for i, j in self.kv_pairs
            ]
        # The distinct geometries, and each pair's slot among them: a chunk computes one set of
        # ranges per distinct geometry (one for MLA, one or two for MHA), shared by every pair.
        self._kv_unique_geometries: List[Hashable] = list(dict.fromkeys(self._kv_geometry))
        slot = {g: k for k, g in enumerate(self._kv_unique_geometries)}
        self._kv_geometry_slots: List[int] = [slot[g] for g in self._kv_geometry]
        src_caps, dst_caps = prefill.kv_capacities(), decode.kv_capacities()
        self._src_kv_limits = [src_caps[i] for i, _ in self.kv_pairs]
        self._dst_kv_limits = [dst_caps[j] for _, j in self.kv_pairs]
        # (pages of decode's smallest KV buffer, slots of its smallest aux buffer), None where it
        # has none: every room's destination is checked against them (plans.check_destination).
        self.decode_capacity_floors = (min(decode.kv_capacities(), default=None),
                                       min(decode.aux_capacities(), default=None))
        self._src_kv_floor = min(self._src_kv_limits, default=0)
        self._dst_kv_floor = min(self._dst_kv_limits, default=0)
        self._src_kv_names = [f"prefill KV buffer {i}" for i, _ in self.kv_pairs]
        self._dst_kv_names = [f"decode KV buffer {j}" for _, j in self.kv_pairs]
        self._unit_sizes = UnitSizes()  # the sizes of a chunk of single-page runs, shared
        self.state_specs: Tuple[StatePlanSpec, ...] = tuple(
            state_plan_spec(k, prefill, decode) for k in range(len(prefill.states))
        )

    # KV -----------------------------------------------------------------------------------

    def plan_kv(self, src_pages, dst_pages) -> TransferPlan:
        """Ranges for one chunk: prefill page src_pages[i] -> decode page dst_pages[i].

        Runs contiguous on both sides become one range per buffer pair; with MHA head slicing,
        one range per token slot (merged across slots and pages when whole tokens move).
        """
        ranges = self._kv_ranges(src_pages, dst_pages)
        if ranges is None:
            return TransferPlan("kv")
        return TransferPlan("kv", tuple(
            BufferTransfer.of_frozen(i, j, ranges[k]) for (i, j), k in zip(self.kv_pairs, self._kv_geometry_slots)))

    def plan_kv_columns(self, src_pages, dst_pages, dst_checked: bool = False) -> Optional[Tuple[list, list, list, int]]:
        """plan_kv as the columns of one engine call over every KV pair, in `kv_pairs` order:
        (local offsets, remote offsets, sizes) with one entry per pair (the same read-only
        arrays shared by every pair of a geometry) and the total bytes. No object per pair.
        None when nothing moves, or when some pair gets no range (plan_kv drops such pairs).
        `dst_checked`: the caller vouches that every decode index is within
        `decode_capacity_floors` (checked when the room's destination arrived, by this planner:
        plans.check_destination), so the per-chunk bound check on decode's side is skipped."""
        ranges, pages = self._kv_ranges_sized(src_pages, dst_pages, dst_checked)
        if ranges is None or any(r[2].size == 0 for r in ranges):
            return None
        slots = self._kv_geometry_slots
        # Whole pages move for an item-length geometry: its bytes are pages x item length, no
        # sum over its sizes on the send path (issue 28); a head slice's are summed.
        per_slot = [int(r[2].sum()) if isinstance(g, HeadSlice) else pages * int(g)
                    for r, g in zip(ranges, self._kv_unique_geometries)]
        if len(ranges) == 1:
            local, remote, sizes = ranges[0]
            n = len(slots)
            return [local] * n, [remote] * n, [sizes] * n, per_slot[0] * n
        return ([ranges[k][0] for k in slots], [ranges[k][1] for k in slots], [ranges[k][2] for k in slots],
                sum(per_slot[k] for k in slots))

    def _kv_ranges(self, src_pages, dst_pages) -> Optional[List[Ranges]]:
        """The checked, read-only ranges of each distinct KV geometry; None for no pages."""
        return self._kv_ranges_sized(src_pages, dst_pages)[0]

    def _kv_ranges_sized(self, src_pages, dst_pages, dst_checked: bool = False) -> tuple:
        """(`_kv_ranges`, the number of pages); the bound check of decode's indices skipped
        where `dst_checked` (plan_kv_columns)."""
        if self.dcp_relayout:
            raise PlanError(
                f"decode context parallel (decode dcp_size={self.decode.dcp_size}) needs the token "
                "relayout (plan_kv_dcp); pages cannot be copied page for page"
            )
        src = as_index_array(src_pages, "prefill KV page indices")
        dst = as_index_array(dst_pages, "decode KV page indices")
        check_paired(src, dst, "KV page indices")
        if src.size == 0:
            return None, 0
        # The smallest buffer bounds every index: one max each (read unsigned, a negative index
        # is above any bound), the buffer and the index named only on a miss.
        # (np.maximum.reduce: ndarray.max without its Python wrapper, on a lone request's way)
        if int(_umax(src.view(np.uint64))) >= self._src_kv_floor:
            check_in_range(src, self._src_kv_limits, self._src_kv_names, "page")
        if not dst_checked and int(_umax(dst.view(np.uint64))) >= self._dst_kv_floor:
            check_in_range(dst, self._dst_kv_limits, self._dst_kv_names, "page")
        return [_read_only(head_sliced_ranges(src, dst, g)) if isinstance(g, HeadSlice)
                else frozen_item_ranges(src, dst, g, self._unit_sizes)
                for g in self._kv_unique_geometries], int(src.size)

    def plan_kv_dcp(self, src_pages, dst_pages, *, page_offset: int, decode_prefix_len: int = 0,
                    num_tokens: Optional[int] = None) -> TransferPlan:
        """Ranges for one chunk into a decode with context parallelism (see dcp.py).

        `src_pages`: the chunk's prefill pages; `dst_pages`: decode's whole virtual page list of
        the request (not sliced); `page_offset`: the chunk's first page in prefill's page list;
        `num_tokens`: real tokens of the chunk (None = every slot of its pages).
        """
        if not self.dcp_relayout:
            raise PlanError("plan_kv_dcp called for a pair without decode context parallelism")
        src = as_index_array(src_pages, "prefill KV page indices")
        dst = as_index_array(dst_pages, "decode KV page indices")
        if src.size == 0:
            return TransferPlan("kv")
        check_in_range(src, self._src_kv_limits, self._src_kv_names, "page")
        ps, n = self.prefill.page_size, self.decode.dcp_size
        rows = {}
        for draft in sorted(set(self._dcp_draft)):
            src_rows, dst_rows = dcp_token_rows(
                src, dst, page_size=ps, dcp_size=n, dcp_rank=self.decode.dcp_rank,
                page_offset=int(page_offset), decode_prefix_len=int(decode_prefix_len or 0),
                num_tokens=None if num_tokens is None else int(num_tokens), draft=draft,
            )
            if dst_rows.size:
                used = np.unique(dst_rows // (ps * n if draft else ps))
                limits = [lim for lim, d in zip(self._dst_kv_limits, self._dcp_draft) if d == draft]
                names = [nm for nm, d in zip(self._dst_kv_names, self._dcp_draft) if d == draft]
                check_in_range(used, limits, names, "page")
            rows[draft] = (src_rows, dst_rows)
        by_geometry: Dict[Hashable, Ranges] = {}
        transfers = []
        for (i, j), geometry in zip(self.kv_pairs, self._kv_geometry):
            ranges = by_geometry.get(geometry)
            if ranges is None:
                draft, token_bytes = geometry
                ranges = by_geometry[geometry] = _read_only(token_ranges(*rows[draft], token_bytes))
            transfers.append(BufferTransfer.of_frozen(i, j, ranges))
        return TransferPlan("kv", tuple(transfers))



    def plan_state(self, component: int, src_indices, dst_indices) -> TransferPlan:
        """Ranges for state component `component` (an index into KVArgs.state_types).

        The index form follows the state type (state_rules.py): one slot (mamba), page-like
        lists cut to their common prefix with the plan's `dropped` saying by how much (swa,
        dsa, ...), positional rows that must match in length (qsa, swa_ring, c128_state, ...),
        or dsa_tail's ring descriptor. Empty lists plan nothing.
        """
        if not 0 <= component < len(self.state_specs):
            raise PlanError(
                f"state component {component} does not exist ({len(self.state_specs)} registered)"
            )
        spec = self.state_specs[component]
        kind = f"state:{spec.state_type}"
        src = as_index_array(src_indices, f"prefill {spec.state_type} state indices")
        dst = as_index_array(dst_indices, f"decode {spec.state_type} state indices")
        if spec.kind in (EXACT, TAIL) and src.size != dst.size:
            raise PlanError(
                f"{spec.state_type} state index length mismatch: prefill={src.size} "
                f"decode={dst.size} (positional rows cannot be cut)"
            )
        if src.size == 0 or dst.size == 0:
            return TransferPlan(kind, component=component, dropped=max(src.size, dst.size))
        dropped = 0
        if spec.kind == PAGED:
            common = min(src.size, dst.size)
            dropped = max(src.size, dst.size) - common
            src, dst = src[:common], dst[:common]
        elif spec.kind == SINGLE and (src.size != 1 or dst.size != 1):
            raise PlanError(
                f"{spec.state_type} state needs exactly one index per request, got "
                f"prefill={src.size} decode={dst.size}"
            )
        if spec.kind == TAIL:
            pieces = tail_pieces(src, dst)
            src_items, dst_items = src[:1], dst[:1]  # the rows
        else:
            pieces = None
            src_items, dst_items = src, dst
        check_in_range(
            src_items, spec.src_capacities,
            [f"prefill {spec.state_type} state tensor {i}" for i, _ in spec.pairs], "state",
        )
        check_in_range(
            dst_items, spec.dst_capacities,
            [f"decode {spec.state_type} state tensor {j}" for _, j in spec.pairs], "state",
        )
        by_geometry: Dict[Hashable, Ranges] = {}
        transfers = []
        for (i, j), geometry in zip(spec.pairs, spec.geometries):
            ranges = by_geometry.get(geometry)
            if ranges is None:
                ranges = by_geometry[geometry] = _read_only(
                    _state_ranges(geometry, src, dst, pieces)
                )
            transfers.append(BufferTransfer(i, j, *ranges))
        return TransferPlan(kind, tuple(transfers), component=component, dropped=dropped)


def _state_ranges(geometry, src: np.ndarray, dst: np.ndarray, pieces) -> Ranges:
    """The ranges of one state tensor pair, by the geometry fixed at registration."""
    if isinstance(geometry, HeadSlice):
        return head_sliced_ranges(src, dst, geometry)
    if isinstance(geometry, SliceBlocks):
        return geometry.ranges(int(src[0]), int(dst[0]))
    if isinstance(geometry, TailRows):
        return tail_ranges(geometry, pieces)
    return contiguous_item_ranges(src, dst, geometry)


def check_compatible(prefill: KVLayout, decode: KVLayout) -> None:
    """Run every registration check of the pair; raise the first failure (both values named)."""
    TransferPlanner(prefill, decode)
