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

A "position" is one entry along the sliced axis (the trailing axes are its bytes). The harness's
pattern is keyed by the *global* position, so a decode rank can compute what its shard must
hold from the unsharded model, whatever either side's TP size.
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

    kind: int  # pattern kind: pat.KIND_CONV or pat.KIND_TEMPORAL
    layer: int  # global model layer id (KVArgs.state_layer_ids)
    groups: Tuple[int, ...]  # full sizes of the sub-blocks along the sliced axis
    inner: Tuple[int, ...]  # shape of one position (the axes after the sliced one)
    dtype: str

    @property
    def is_conv(self) -> bool:
        return self.kind == pat.KIND_CONV

    @property
    def position_bytes(self) -> int:
        return int(np.prod(self.inner)) * DTYPE_SIZES[self.dtype]

    def local_dim(self, tp: int) -> int:
        return sum(self.groups) // tp

    def positions(self, tp: int, rank: int) -> np.ndarray:
        """Global positions rank `rank` of TP `tp` holds, in its local order: its part of each
        sub-block, sub-block after sub-block."""
        parts, base = [], 0
        for full in self.groups:
            part = full // tp
            parts.append(np.arange(base + rank * part, base + (rank + 1) * part))
            base += full
        return np.concatenate(parts)

    def contiguous_positions(self, tp: int, rank: int) -> np.ndarray:
        """What rank `rank` would hold if the axis were cut as one block, ignoring the
        sub-blocks: the shard a backend unaware of `conv_shard_groups` moves (self-checks)."""
        part = sum(self.groups) // tp
        return np.arange(rank * part, (rank + 1) * part)

    def allocate(self, slots: int, tp: int) -> torch.Tensor:
        return torch.zeros((slots, self.local_dim(tp), *self.inner), dtype=getattr(torch, self.dtype))

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
    """The registered tensors in MambaPool's order: conv of every mamba layer, then temporal."""
    _, mamba = layer_ids(shape, attention_layers)
    key_dim = shape.num_key_heads * shape.head_k_dim
    value_dim = shape.num_value_heads * shape.head_v_dim
    conv = [
        StateTensor(pat.KIND_CONV, layer, (key_dim, key_dim, value_dim), (shape.conv_kernel - 1,),
                    shape.conv_dtype)
        for layer in mamba
    ]
    temporal = [
        StateTensor(pat.KIND_TEMPORAL, layer, (shape.num_value_heads,),
                    (shape.head_v_dim, shape.head_k_dim), shape.temporal_dtype)
        for layer in mamba
    ]
    return conv + temporal


def rows_view(t: torch.Tensor) -> np.ndarray:
    """Writable uint8 [slots, local positions, position bytes] view of a state tensor."""
    return t.view(torch.uint8).numpy().reshape(t.shape[0], t.shape[1], -1)


def conv_shard_groups(spec: StateTensor) -> Optional[List[int]]:
    """KVArgs.state_conv_shard_groups entry: the full q/k/v sizes for conv, None otherwise."""
    return list(spec.groups) if spec.is_conv else None
