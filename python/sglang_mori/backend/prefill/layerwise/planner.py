"""Plans for layer-wise streaming: one plan per (room stream, decode peer), filtered per layer group.

`select_buffers` keeps the ranges of some local KV buffers of a plan; a plan's buffer transfers
are independent, so the layer groups of a pass joined together are exactly the full plan
(unit-tested). `LayerwisePlanner` is the service's KVPlanner with two more chunk kinds:
- `LayerChunk`: one layer group of one room stream (the layer worker's writes);
- a chunk with `kv_selection` (a `send()` of which some pages or layers were streamed already):
  only the listed (pages, buffers) parts are planned, plus the state of the last chunk.
Plain chunks are planned exactly as before.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import FrozenSet, List, Optional

import numpy as np

from sglang_mori.backend.plans import KVPlanner, to_pairs
from sglang_mori.engine import WriteBatch
from sglang_mori.backend.prefill.submitter import Chunk
from sglang_mori.planning.transfer_plan import TransferPlan


def select_buffers(plan: TransferPlan, buffers) -> TransferPlan:
    """The part of `plan` that reads local buffers `buffers` (None: the whole plan)."""
    if buffers is None:
        return plan
    keep = frozenset(buffers)
    return TransferPlan(plan.kind, tuple(t for t in plan.transfers if t.local_index in keep),
                        component=plan.component, dropped=plan.dropped)


@dataclass
class LayerChunk(Chunk):
    """One layer group of one room stream; `stream` carries the pages and the plan cache."""

    stream: object = None  # worker.RoomStream
    buffers: FrozenSet[int] = frozenset()


@dataclass
class SelectedChunk(Chunk):
    """A `send()` chunk of which only `kv_selection` parts remain: (lo, hi, buffers or None)."""

    kv_selection: List[tuple] = field(default_factory=list)

    @property
    def writes_nothing(self) -> bool:
        """Every page was streamed and no state goes with it: tracking it writes no byte."""
        return not self.kv_selection and (not self.is_last or not carries_state(self.state_indices))


class LayerwisePlanner(KVPlanner):
    """`refuse_unstreamable` (SGLANG_MORI_LAYERWISE=on): a decode whose pages the layer streams cannot
    pair one to one (decode context parallel relays tokens out) is refused at registration. Without
    it (`auto`) that decode is served chunk-wise: `stream_refusal` tells the session not to stream
    to it, and its chunks are planned exactly as KVPlanner plans them."""

    def __init__(self, layout, local, kv_shard: tuple = (0, 1), *, refuse_unstreamable: bool = False):
        super().__init__(layout, local, kv_shard)
        self.supports_dcp_relayout = not refuse_unstreamable

    def stream_refusal(self, engine_key: str) -> Optional[str]:
        """The layer-wise fallback reason for rooms to this decode rank, or None if they may stream.
        A forgotten peer streams like any other: its writes fail as its chunks would."""
        planner = self._planners.get(engine_key)
        if planner is not None and planner.dcp_relayout:
            return "decode_context_parallel"
        return None

    def stream_plan(self, peer, stream, target) -> TransferPlan:
        """The full plan of a room stream to one peer, made once and reused by every layer group."""
        plan = stream.plans.get(peer.engine_key)
        if plan is None:
            dst = target.kv_indices[stream.dst_slice]
            plan = stream.plans[peer.engine_key] = self.registered_planner(peer).plan_kv(stream.src_pages, dst)
        return plan

    def write_batch(self, peer, chunk, target):
        if isinstance(chunk, (LayerChunk, SelectedChunk)):
            return WriteBatch.of_pairs(self.write_pairs(peer, chunk, target))
        return super().write_batch(peer, chunk, target)

    def write_pairs(self, peer, chunk, target) -> list:
        if isinstance(chunk, LayerChunk):
            plan = select_buffers(self.stream_plan(peer, chunk.stream, target), chunk.buffers)
            return to_pairs(plan, self.local.kv, peer.kv_descs)
        if not isinstance(chunk, SelectedChunk):
            return super().write_pairs(peer, chunk, target)
        planner = self.registered_planner(peer)
        dst = target.kv_indices[chunk.index_slice]
        pairs: list = []
        for lo, hi, buffers in chunk.kv_selection:
            plan = planner.plan_kv(chunk.kv_indices[lo:hi], dst[lo:hi])
            pairs += to_pairs(select_buffers(plan, buffers), self.local.kv, peer.kv_descs)
        if chunk.is_last and chunk.state_indices is not None:
            state_only = dataclasses.replace(chunk, kv_indices=np.empty(0, dtype=np.int64), index_slice=slice(0, 0))
            pairs += super().write_pairs(peer, Chunk(**{f.name: getattr(state_only, f.name)
                                                        for f in dataclasses.fields(Chunk)}), target)
        return pairs


def carries_state(state_indices) -> bool:
    """A last chunk's state indices name something to write. SGLang builds them as one entry per
    state type of the model (`_send_kv_chunk`): a model without state (a plain Llama) hands an
    empty list, not None, and a component it has no payload for is None; neither writes a byte
    (`KVPlanner._state_pairs` skips both)."""
    return state_indices is not None and any(component is not None for component in state_indices)


def selected_chunk(room: int, kv_indices, index_slice: slice, is_last: bool, parts: List[tuple],
                   **kw) -> Optional[Chunk]:
    """The chunk `send()` must still submit given the streamed `parts`, or None when nothing is left."""
    kv_indices = np.asarray(kv_indices, dtype=np.int64)
    n = index_slice.stop - index_slice.start
    common = dict(room=room, kv_indices=kv_indices, index_slice=index_slice, is_last=is_last,
                  aux_index=kw.get("aux_index"), state_indices=kw.get("state_indices"),
                  wait_event=kw.get("wait_event"))
    if parts == [(0, n, None)]:
        return Chunk(**common)
    if not parts and not is_last:
        return None
    return SelectedChunk(**common, kv_selection=list(parts))
