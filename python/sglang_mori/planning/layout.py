"""`KVLayout`: what one side's registered buffers look like, sent to the peer at registration.

It carries only shapes (lengths, item lengths, layer ids, TP position), never addresses: the
memory descriptors travel separately. Both sides build it from SGLang's `KVArgs` with
`KVLayout.from_kv_args`, and the prefill side checks the pair with `check_compatible` before
planning any transfer. It is a `msgspec.Struct`, so it can be a field of a protocol message;
a self-contradicting layout is rejected on construction (and so on decode).
"""

from __future__ import annotations

from typing import Optional, Tuple

import msgspec

from sglang_mori.planning.errors import InvalidLayoutError
from sglang_mori.planning.physical_layout import physical_kv_layout


def _ints(values) -> Tuple[int, ...]:
    return tuple(int(v) for v in (values or ()))


def _groups(per_tensor) -> Tuple[Tuple[int, ...], ...]:
    """SGLang's per-tensor conv sub-blocks (None = one block) as a tuple per tensor."""
    groups = tuple(_ints(g) for g in (per_tensor or ()))
    return groups if any(groups) else ()


class StateLayout(msgspec.Struct, frozen=True, kw_only=True):
    """One hybrid state component (SGLang `StateType`): a list of per-layer tensors."""

    state_type: str  # StateType value: "mamba", "swa", "dsa", ...
    item_lens: Tuple[int, ...]  # bytes per index, per tensor (0 = elided tensor)
    data_lens: Tuple[int, ...]  # bytes per tensor
    layer_ids: Tuple[int, ...] = ()  # global model layer per tensor, when the pool reports it
    # How a TP-sharded state tensor splits (SGLang's mamba pools report these; empty otherwise):
    # per tensor, this rank's size of the slice axis (`state_dim_per_tensor`; 0 = the tensor is
    # whole on every rank), the rows before that axis in one item (`state_slice_outer_counts`),
    # and the full sizes of independently sharded sub-blocks of the axis (GDN conv state
    # [q | k | v], `state_conv_shard_groups`; () = one block).
    slice_dims: Tuple[int, ...] = ()
    outer_counts: Tuple[int, ...] = ()
    conv_groups: Tuple[Tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        if len(self.item_lens) != len(self.data_lens):
            raise InvalidLayoutError(
                f"state {self.state_type!r}: {len(self.item_lens)} item lengths for "
                f"{len(self.data_lens)} tensors"
            )
        if self.layer_ids and len(self.layer_ids) != len(self.item_lens):
            raise InvalidLayoutError(
                f"state {self.state_type!r}: {len(self.layer_ids)} layer ids for "
                f"{len(self.item_lens)} tensors"
            )
        if any(v < 0 for v in self.item_lens + self.data_lens):
            raise InvalidLayoutError(f"state {self.state_type!r}: negative length")
        for name in ("slice_dims", "outer_counts", "conv_groups"):
            values = getattr(self, name)
            if values and len(values) != len(self.item_lens):
                raise InvalidLayoutError(
                    f"state {self.state_type!r}: {len(values)} {name} for {len(self.item_lens)} tensors"
                )
        if any(v < 0 for v in self.slice_dims) or any(v < 1 for v in self.outer_counts):
            raise InvalidLayoutError(
                f"state {self.state_type!r}: slice dims must be >= 0 and outer counts >= 1"
            )
        if any(v < 1 for groups in self.conv_groups for v in groups):
            raise InvalidLayoutError(f"state {self.state_type!r}: conv sub-block sizes must be >= 1")

    def capacities(self) -> Tuple[int, ...]:
        """Items each tensor holds (0 for an elided tensor)."""
        return tuple(d // i if i else 0 for i, d in zip(self.item_lens, self.data_lens))


class KVLayout(msgspec.Struct, frozen=True, kw_only=True):
    """Shape of one rank's KV, aux and state buffers, in registration order.

    KV buffers follow `kv_data_ptrs` order: MHA is [K per layer..., V per layer...], MLA one
    latent buffer per layer; `num_draft_entries` buffers of a draft model come last.
    """

    is_mla: bool
    tp_size: int  # attention TP size
    tp_rank: int  # attention TP rank, 0 <= tp_rank < tp_size
    page_size: int  # tokens per page; KV indices are page indices
    kv_cache_dtype: str
    kv_item_lens: Tuple[int, ...]  # bytes per page, per KV buffer
    kv_data_lens: Tuple[int, ...]  # bytes per KV buffer
    kv_layer_ids: Tuple[int, ...] = ()  # global layer id per KV buffer (hybrid pools only)
    num_draft_entries: int = 0
    start_layer: int = 0  # first model layer this PP stage holds
    kv_head_num: int = 0  # KV heads per rank (MHA; 0 = not reported)
    total_kv_head_num: int = 0  # KV heads of the model (MHA; 0 = not reported)
    kv_layout: Optional[str] = None  # SGLang's KVArgs.kv_layout (pools with several byte layouts)
    # Physical byte order of MHA KV pages ("nhd", "hnd", "vectorized_5d"; None = not reported,
    # MLA) and of the SWA sub-pool's pages (KVArgs.swa_kv_cache_layout): see physical_layout.py.
    kv_physical_layout: Optional[str] = None
    swa_physical_layout: Optional[str] = None
    aux_item_lens: Tuple[int, ...] = ()
    aux_data_lens: Tuple[int, ...] = ()
    states: Tuple[StateLayout, ...] = ()
    # Decode context parallel (SGLang --dcp-size): tokens striped over dcp_size ranks (dcp.py).
    dcp_size: int = 1
    dcp_rank: int = 0

    def __post_init__(self) -> None:
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise InvalidLayoutError(f"tp_rank={self.tp_rank} with tp_size={self.tp_size}")
        if self.dcp_size < 1 or not 0 <= self.dcp_rank < self.dcp_size:
            raise InvalidLayoutError(f"dcp_rank={self.dcp_rank} with dcp_size={self.dcp_size}")
        if self.page_size < 1:
            raise InvalidLayoutError(f"page_size must be >= 1, got {self.page_size}")
        if len(self.kv_item_lens) != len(self.kv_data_lens):
            raise InvalidLayoutError(
                f"{len(self.kv_item_lens)} KV item lengths for {len(self.kv_data_lens)} KV buffers"
            )
        if any(v <= 0 for v in self.kv_item_lens) or any(v < 0 for v in self.kv_data_lens):
            raise InvalidLayoutError("KV item lengths must be > 0 and data lengths >= 0")
        if self.kv_layer_ids and len(self.kv_layer_ids) != len(self.kv_item_lens):
            raise InvalidLayoutError(
                f"{len(self.kv_layer_ids)} KV layer ids for {len(self.kv_item_lens)} KV buffers"
            )
        if not 0 <= self.num_draft_entries <= len(self.kv_item_lens):
            raise InvalidLayoutError(
                f"num_draft_entries={self.num_draft_entries} with {len(self.kv_item_lens)} KV buffers"
            )
        if len(self.aux_item_lens) != len(self.aux_data_lens):
            raise InvalidLayoutError(
                f"{len(self.aux_item_lens)} aux item lengths for {len(self.aux_data_lens)} aux buffers"
            )
        if any(v <= 0 for v in self.aux_item_lens):
            raise InvalidLayoutError("aux item lengths must be > 0")

    @property
    def num_kv_buffers(self) -> int:
        return len(self.kv_item_lens)

    def kv_capacities(self) -> Tuple[int, ...]:
        """Pages each KV buffer holds."""
        return tuple(d // i for i, d in zip(self.kv_item_lens, self.kv_data_lens))

    def aux_capacities(self) -> Tuple[int, ...]:
        return tuple(d // i for i, d in zip(self.aux_item_lens, self.aux_data_lens))

    def total_heads(self) -> int:
        """Model KV heads as this side knows them (0 if it reports neither count)."""
        if self.total_kv_head_num > 0:
            return self.total_kv_head_num
        return self.kv_head_num * self.tp_size

    @classmethod
    def from_kv_args(cls, args, tp_size: int, tp_rank: int, is_mla: bool,
                     dcp_size: int = 1, dcp_rank: int = 0) -> "KVLayout":
        """Describe the buffers of an SGLang `KVArgs` (the plain view backend/sglang_fields.py builds
        of it), filled as prefill.py / decode.py fill it.

        `tp_size` is the attention TP size; `tp_rank` may be the global TP rank (SGLang's
        prefill `engine_rank`), it is reduced to the attention-TP rank. Attributes SGLang leaves
        unset on one side (decode has no `prefill_start_layer`, MLA no head counts) default to
        "not reported".
        """

        def attr(name, default):
            value = getattr(args, name, default)
            return default if value is None else value

        state_types = list(attr("state_types", []))
        state_item_lens = list(attr("state_item_lens", []))
        state_data_lens = list(attr("state_data_lens", []))
        state_layer_ids = list(attr("state_layer_ids", []))
        state_dims = list(attr("state_dim_per_tensor", []))
        state_outer = list(attr("state_slice_outer_counts", []))
        state_groups = list(attr("state_conv_shard_groups", []))
        if len(state_item_lens) != len(state_types) or len(state_data_lens) != len(state_types):
            raise InvalidLayoutError(
                f"KVArgs has {len(state_types)} state types but {len(state_item_lens)} item "
                f"length lists and {len(state_data_lens)} data length lists"
            )
        states = tuple(
            StateLayout(
                state_type=str(getattr(st, "value", st)),
                item_lens=_ints(state_item_lens[i]),
                data_lens=_ints(state_data_lens[i]),
                layer_ids=_ints(state_layer_ids[i]) if i < len(state_layer_ids) else (),
                slice_dims=_ints(state_dims[i]) if i < len(state_dims) else (),
                outer_counts=_ints(state_outer[i]) if i < len(state_outer) else (),
                conv_groups=_groups(state_groups[i]) if i < len(state_groups) else (),
            )
            for i, st in enumerate(state_types)
        )
        mla = bool(is_mla or attr("is_hybrid_mla_backend", False))
        return cls(
            is_mla=mla,
            tp_size=int(tp_size),
            tp_rank=int(tp_rank) % int(tp_size) if tp_size > 0 else int(tp_rank),
            page_size=int(attr("page_size", 1)),
            kv_cache_dtype=str(attr("kv_cache_dtype_str", "")),
            kv_item_lens=_ints(attr("kv_item_lens", ())),
            kv_data_lens=_ints(attr("kv_data_lens", ())),
            kv_layer_ids=_ints(attr("kv_layer_ids", ())),
            num_draft_entries=int(attr("num_draft_entries", 0)),
            start_layer=int(attr("prefill_start_layer", 0)),
            kv_head_num=int(attr("kv_head_num", 0)),
            total_kv_head_num=int(attr("total_kv_head_num", 0)),
            kv_layout=attr("kv_layout", None),
            kv_physical_layout=None if mla else physical_kv_layout(),
            swa_physical_layout=attr("swa_kv_cache_layout", None),
            aux_item_lens=_ints(attr("aux_item_lens", ())),
            aux_data_lens=_ints(attr("aux_data_lens", ())),
            states=states,
            dcp_size=int(dcp_size or 1),
            dcp_rank=int(dcp_rank or 0),
        )
