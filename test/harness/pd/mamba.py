"""Qwen3-Next-shaped linear-attention (GDN) state, laid out on each TP rank as SGLang's MambaPool
lays it out, and the global positions each rank's shard holds.

SGLang (configs/qwen3_next.py, configs/mamba_utils.py Mamba2StateShape.create, mem_cache
memory_pool.py MambaPool) gives every linear-attention layer two per-request tensors:

- conv state [conv_dim / TP, K-1], conv_dim = cat(q, k, v) = key_dim + key_dim + value_dim; each
  of q, k and v is head-sharded over TP on its own (`conv_shard_groups` = [key_dim, key_dim,
  value_dim], full sizes), so rank r holds [r*F/TP, (r+1)*F/TP) of each sub-block, in q, k, v
  order: not one contiguous slice of the full axis.
- temporal (SSM) state [HV / TP, head_v_dim, head_k_dim], sharded on its value heads.

MambaPool registers them field-major, layer-minor ([conv of every mamba layer..., temporal of
every mamba layer...]) with, per tensor, the slice axis' local size (`state_dim_per_tensor`),
rows before it (`state_slice_outer_counts`, 1 here) and the conv sub-blocks (None for temporal).

Kimi-Linear (configs/mamba_utils.py KimiLinearStateShape) transposes the conv state to
[K-1, v | k | k]: the slice axis is the second one, after K-1 "outer" rows. A slot sibling such
as ple_state_pool's ShortConvPool adds state whole on every rank (slice dim 0).

A "position" is one entry of the sliced axis within one outer row (the trailing axes are its
bytes); its global number is outer_row * full_axis + global index along the axis. The harness's
pattern is keyed by that global position, so a decode rank can compute what its shard must hold
from the unsharded model, whatever either side's TP size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy as np
import torch

from harness.pd import pattern as pat
from harness.pd.config import DTYPE_SIZES, HybridMambaShape


@dataclass(frozen=True)
class StateTensor:
    """One registered state tensor (one field of one mamba layer), sizes unsharded."""

    kind: int  # pattern kind: pat.KIND_CONV, KIND_TEMPORAL or KIND_SHORT_CONV
    layer: int  # global model layer id (KVArgs.state_layer_ids)
    groups: Tuple[int, ...]  # full sizes of the sub-blocks along the sliced axis
    inner: Tuple[int, ...]  # shape of one position (the axes after the sliced one)
    dtype: str
    outer: int = 1  # rows before the sliced axis (Kimi's conv: K-1)
    replicated: bool = False  # whole on every TP rank (KVArgs slice dim 0)

    @property
    def is_conv(self) -> bool:
        return self.kind == pat.KIND_CONV

    @property
    def name(self) -> str:
        return {pat.KIND_CONV: "conv", pat.KIND_TEMPORAL: "temporal"}.get(self.kind, "short conv")

    @property
    def position_bytes(self) -> int:
        return int(np.prod(self.inner)) * DTYPE_SIZES[self.dtype]

    @property
    def full(self) -> int:
        return sum(self.groups)

    def local_dim(self, tp: int) -> int:
        return self.full if self.replicated else self.full // tp

    def slice_dim(self, tp: int) -> int:
        """KVArgs.state_dim_per_tensor entry: 0 marks a tensor whole on every rank."""
        return 0 if self.replicated else self.local_dim(tp)

    def positions(self, tp: int, rank: int) -> np.ndarray:
        """Global positions rank `rank` of TP `tp` holds, in its local (memory) order: outer row
        after outer row, in each its part of each sub-block, sub-block after sub-block."""
        if self.replicated:
            return np.arange(self.outer * self.full)
        parts, base = [], 0
        for full in self.groups:
            part = full // tp
            parts.append(np.arange(base + rank * part, base + (rank + 1) * part))
            base += full
        row = np.concatenate(parts)
        return (np.arange(self.outer)[:, None] * self.full + row[None, :]).ravel()

    def allocate(self, slots: int, tp: int) -> torch.Tensor:
        rows = (self.outer,) if self.outer > 1 else ()
        shape = (slots, *rows, self.local_dim(tp), *self.inner)
        return torch.zeros(shape, dtype=getattr(torch, self.dtype))

    def key(self, seed: int, prefill_dp: int) -> int:
        return pat.buffer_key(seed, self.kind, self.layer, prefill_dp)

    def content(self, seed: int, prefill_dp: int, slots: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """uint8 [len(slots), len(positions), position_bytes]: the prefill's bytes there."""
        return pat.pattern(self.key(seed, prefill_dp), slots, positions, self.position_bytes)


def layer_ids(shape: HybridMambaShape, attention_layers: int) -> Tuple[List[int], List[int]]:
    """(full-attention layer ids, mamba layer ids) of the model: every
    `full_attention_interval`-th layer is full attention (Qwen3-Next: 3 linear, then 1 full)."""
    total = attention_layers * shape.full_attention_interval
    attention = [i for i in range(total) if (i + 1) % shape.full_attention_interval == 0]
    return attention, [i for i in range(total) if (i + 1) % shape.full_attention_interval]


def state_tensors(shape: HybridMambaShape, attention_layers: int) -> List[StateTensor]:
    """The registered tensors in MambaPool's order: conv of every mamba layer, then temporal,
    then a slot sibling's (the replicated short conv) if configured."""
    _, mamba = layer_ids(shape, attention_layers)
    key_dim = shape.num_key_heads * shape.head_k_dim
    value_dim = shape.num_value_heads * shape.head_v_dim
    window = shape.conv_kernel - 1
    if shape.kimi:  # [K-1, v | k | k]: K-1 outer rows of 1-element positions
        conv_groups, conv_inner, conv_outer = (value_dim, key_dim, key_dim), (), window
    else:  # GDN [q | k | v, K-1]
        conv_groups, conv_inner, conv_outer = (key_dim, key_dim, value_dim), (window,), 1
    conv = [StateTensor(pat.KIND_CONV, layer, conv_groups, conv_inner, shape.conv_dtype, conv_outer)
            for layer in mamba]
    temporal = [
        StateTensor(pat.KIND_TEMPORAL, layer, (shape.num_value_heads,),
                    (shape.head_v_dim, shape.head_k_dim), shape.temporal_dtype)
        for layer in mamba
    ]
    short_conv = [
        StateTensor(pat.KIND_SHORT_CONV, layer, (value_dim,), (window,), shape.conv_dtype, replicated=True)
        for layer in (mamba if shape.replicated_conv else ())
    ]
    return conv + temporal + short_conv


def rows_view(t: torch.Tensor, spec: StateTensor) -> np.ndarray:
    """Writable uint8 [slots, local positions, position bytes] view of a state tensor."""
    per_slot = spec.outer * (t.shape[2] if spec.outer > 1 else t.shape[1])
    return t.view(torch.uint8).numpy().reshape(t.shape[0], per_slot, -1)


def conv_shard_groups(spec: StateTensor) -> Optional[List[int]]:
    """KVArgs.state_conv_shard_groups entry: the full q/k/v sizes for conv, None otherwise."""
    return list(spec.groups) if spec.is_conv else None
