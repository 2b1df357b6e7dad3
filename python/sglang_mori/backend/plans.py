"""Glue between SGLang's KVArgs, the registered descriptors and `sglang_mori.planning`."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import msgspec

from sglang_mori.engine.transfer_engine import WriteBatch, WritePair
from sglang_mori.planning import InvalidLayoutError, KVLayout, PlanError, TransferPlanner, UnsupportedLayoutError
from sglang_mori.planning.kv_shard import SHARDED_STATE_TYPE, owned_pages
from sglang_mori.planning.transfer_plan import TransferPlan

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LocalBuffers:
    """This rank's registered descriptors, in KVArgs order (None for a zero-length buffer)."""

    kv: list
    aux: list
    state: list  # one list per state component


def local_layout(kv_args, attn_tp_size: int, attn_tp_rank: int, is_mla: bool,
                 dcp_size: int = 1, dcp_rank: int = 0) -> KVLayout:
    return KVLayout.from_kv_args(kv_args, attn_tp_size, attn_tp_rank, bool(is_mla), dcp_size, dcp_rank)


def encode_layout(layout: KVLayout) -> bytes:
    return msgspec.msgpack.encode(layout)


def decode_layout(blob: bytes) -> KVLayout:
    try:
        return msgspec.msgpack.decode(blob, type=KVLayout)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise InvalidLayoutError(f"unreadable layout from decode: {exc}") from None


class KVPlanner:
    """Per-decode-peer planners for one prefill rank."""

    # Whether chunks into a decode with context parallelism (token relayout) are planned here.
    supports_dcp_relayout = True

    def __init__(self, layout: KVLayout, local: LocalBuffers, kv_shard: tuple = (0, 1)):
        self.layout = layout
        self.local = local
        # (kv_shard_rank, kv_shard_size) of a KV-sharded prefill: state striped like the KV pages
        # (DSA) is narrowed to this rank's pages here; SGLang narrows the KV pages itself.
        self.kv_shard = (int(kv_shard[0]), int(kv_shard[1]))
        self._planners: dict[str, TransferPlanner] = {}
        # engine key -> (planner, peer's KV descs, local column, remote column): the descriptor
        # columns of a chunk's engine call, the same list objects for every chunk to that peer.
        self._kv_desc_columns: dict = {}

    def accept_peer(self, key: str, layout_blob: bytes, kv, aux, state, dcp=None) -> KVLayout:
        """Check a registering decode rank; raise a PlanningError naming both sides' values.

        `dcp`: the decode's (dcp_size, dcp_rank) from its Register message, which wins over the
        layout's (a layout from an older decode does not carry them)."""
        remote = decode_layout(layout_blob)
        if dcp is not None:
            # Validated like any layout (InvalidLayoutError for a rank outside the size).
            remote = msgspec.structs.replace(remote, dcp_size=int(dcp[0]), dcp_rank=int(dcp[1]))
        planner = TransferPlanner(self.layout, remote)
        if planner.dcp_relayout and not self.supports_dcp_relayout:
            raise UnsupportedLayoutError(
                f"decode context parallel (prefill dcp_size={self.layout.dcp_size}, decode "
                f"dcp_size={remote.dcp_size} dcp_rank={remote.dcp_rank}) is not planned in layer-wise "
                "mode with SGLANG_MORI_LAYERWISE=on; run the prefill with SGLANG_MORI_LAYERWISE=auto (chunk-wise "
                "to this decode) or off"
            )
        if len(kv) != remote.num_kv_buffers:
            raise InvalidLayoutError(
                f"decode sent {len(kv)} KV descriptors for a layout of {remote.num_kv_buffers} buffers"
            )
        for i, (desc, size) in enumerate(zip(kv, remote.kv_data_lens)):
            if int(desc.size) != int(size):
                raise InvalidLayoutError(f"decode KV descriptor {i} is {desc.size} bytes, layout says {size}")
        if len(aux) != len(remote.aux_item_lens):
            raise InvalidLayoutError(
                f"aux buffers: decode registered {len(aux)} descriptors for {len(remote.aux_item_lens)} buffers"
            )
        self._planners[key] = planner
        return remote

    def forget_peer(self, key: str) -> None:
        self._planners.pop(key, None)
        self._kv_desc_columns.pop(key, None)

    def registered_planner(self, peer) -> TransferPlanner:
        """The planner of a peer; PlanError when it was forgotten (replaced or pruned) after the
        caller looked the peer up."""
        planner = self._planners.get(peer.engine_key)
        if planner is None:
            raise PlanError(f"decode engine {peer.engine_key} is no longer registered with this prefill rank")
        return planner

    def check_destination(self, peer, target) -> Optional[str]:
        """Validate a room's decode indices against the peer's buffers; the reason if invalid.
        Indices found within every decode KV buffer mark the target as checked by this planner
        (`kv_checked_by`): its chunks skip that bound check when they are planned (write_batch),
        on the send path, as long as the peer's planner is still this one."""
        planner = self._planners.get(peer.engine_key) if peer is not None else None
        if planner is None:
            return None
        kv_pages, aux_slots = planner.decode_capacity_floors
        if target.kv_indices.size and kv_pages is not None:
            low, high = int(target.kv_indices.min()), int(target.kv_indices.max())
            if low < 0 or high >= kv_pages:
                return (f"decode page index out of range: indices span {low}..{high}, "
                        f"decode KV buffers hold {kv_pages} pages")
            target.kv_checked_by = planner
        if target.aux_index is not None and aux_slots is not None:
            if not 0 <= target.aux_index < aux_slots:
                return f"decode aux index {target.aux_index} out of range"
        return None

    def write_batch(self, peer, chunk, target) -> WriteBatch:
        """Every write of one chunk to one decode rank, as one engine call's columns: the KV of
        all layers from arrays planned once per distinct geometry, no object per pair."""
        planner = self.registered_planner(peer)
        columns = None if planner.dcp_relayout else planner.plan_kv_columns(
            chunk.kv_indices, target.kv_indices[chunk.index_slice], target.kv_checked_by is planner)
        if columns is None:  # decode context parallel, an empty chunk, or a pair with no range
            return WriteBatch.of_pairs(self.write_pairs(peer, chunk, target))
        local, remote = self._desc_columns(peer, planner)
        state = self._state_pairs(planner, peer, chunk, target)
        if not state:
            return WriteBatch(local, remote, *columns, sessions_key=id(remote))
        return WriteBatch(local + [w.local for w in state], remote + [w.remote for w in state],
                          columns[0] + [w.local_offsets for w in state],
                          columns[1] + [w.remote_offsets for w in state], columns[2] + [w.sizes for w in state])

    def _desc_columns(self, peer, planner) -> tuple:
        cached = self._kv_desc_columns.get(peer.engine_key)
        if cached is None or cached[0] is not planner or cached[1] is not peer.kv_descs:
            local = [self.local.kv[i] for i, _ in planner.kv_pairs]
            remote = [peer.kv_descs[j] for _, j in planner.kv_pairs]
            cached = self._kv_desc_columns[peer.engine_key] = (planner, peer.kv_descs, local, remote)
        return cached[2], cached[3]

    def write_pairs(self, peer, chunk, target) -> list:
        """Every (local region, remote region) write of one chunk to one decode rank."""
        planner = self.registered_planner(peer)
        if planner.dcp_relayout:
            # Decode's virtual pages are not paired with prefill's: the whole list, and where
            # the chunk starts, place its tokens.
            kv_plan = planner.plan_kv_dcp(
                chunk.kv_indices, target.kv_indices, page_offset=chunk.index_slice.start or 0,
                decode_prefix_len=target.decode_prefix_len or 0, num_tokens=chunk.num_kv_tokens)
        else:
            kv_plan = planner.plan_kv(chunk.kv_indices, target.kv_indices[chunk.index_slice])
        return to_pairs(kv_plan, self.local.kv, peer.kv_descs) + self._state_pairs(planner, peer, chunk, target)

    def _state_pairs(self, planner, peer, chunk, target) -> list:
        """The state writes of a last chunk (none for other chunks)."""
        pairs: list = []
        if chunk.is_last and chunk.state_indices is not None and target.state_indices is not None:
            if len(chunk.state_indices) != len(target.state_indices):
                raise PlanError(
                    f"state components: prefill sent {len(chunk.state_indices)}, decode expects "
                    f"{len(target.state_indices)}"
                )
            for comp, (src, dst_state) in enumerate(zip(chunk.state_indices, target.state_indices)):
                if src is None or dst_state is None:
                    continue
                if self.kv_shard[1] > 1 and self.layout.states[comp].state_type == SHARDED_STATE_TYPE:
                    src, dst_state = owned_pages(src, dst_state, *self.kv_shard)
                    if src.size == 0:
                        continue
                plan = planner.plan_state(comp, src, dst_state)
                if plan.dropped:
                    # Decode gave fewer state slots than prefill has items: those never move.
                    logger.warning("sglang-mori: state component %d: %d item(s) beyond decode's slots not sent",
                                   comp, plan.dropped)
                pairs += to_pairs(plan, self.local.state[comp], peer.state_descs[comp])
        return pairs


def to_pairs(plan: TransferPlan, local_descs, remote_descs) -> list:
    """The plan's pairs with its (read-only, often shared) arrays: the engine wrapper turns them
    into lists only for an engine that needs lists (TransferEngine.takes_arrays)."""
    return [
        WritePair(local_descs[t.local_index], remote_descs[t.remote_index], t.local_offsets, t.remote_offsets,
                  t.sizes)
        for t in plan
    ]
