"""KV pool shapes of the GPU rig, with real models' per-token sizes, and the registration arguments
SGLang would pass for them (KVArgs), so the planner sees a real layout.

- DeepSeek-V3 MLA: 61 layers, one latent buffer per layer, 576 bf16 values (1152 bytes) per token.
- Llama-3-8B-like GQA: 32 layers, 8 KV heads of 128 bf16 values, K of every layer then V of every
  layer (SGLang's MHA pool order), 2048 bytes per token and buffer.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from types import SimpleNamespace


@dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    is_mla: bool
    values_per_token: int  # bf16 values one token stores in one buffer (of this TP rank)
    kv_heads: int = 0  # KV heads one rank holds (MHA)
    total_kv_heads: int = 0  # the model's KV heads (MHA; 0: kv_heads, no TP slicing)
    tp_size: int = 1

    @property
    def buffers(self) -> int:
        return self.layers if self.is_mla else 2 * self.layers

    @property
    def token_bytes(self) -> int:
        return 2 * self.values_per_token

    def buffers_of_layer(self, layer: int) -> tuple:
        return (layer,) if self.is_mla else (layer, self.layers + layer)

    def sliced(self, tp_size: int) -> "Shape":
        """One attention-TP rank's share: MHA keeps kv_heads / tp_size heads of every token; MLA's
        latent is replicated on every rank."""
        if self.is_mla or tp_size == 1:
            return dataclasses.replace(self, tp_size=tp_size)
        if self.kv_heads % tp_size:
            raise ValueError(f"{self.kv_heads} KV heads do not split over TP {tp_size}")
        return dataclasses.replace(self, kv_heads=self.kv_heads // tp_size, total_kv_heads=self.kv_heads,
                                   values_per_token=self.values_per_token // tp_size, tp_size=tp_size)

    def bytes_per_token(self) -> int:
        """All layers' KV of one token (what one token costs the link)."""
        return self.buffers * self.token_bytes


SHAPES = {
    "mla": Shape("deepseek-v3-mla", layers=61, is_mla=True, values_per_token=576),
    "gqa": Shape("llama3-8b-gqa", layers=32, is_mla=False, values_per_token=8 * 128, kv_heads=8),
}


def pages_for(tokens: int, page_size: int) -> int:
    return math.ceil(tokens / page_size)


def kv_args(shape: Shape, page_size: int, kv_ptrs, kv_lens, aux_ptr: int, aux_len: int, aux_item: int):
    """What SGLang's KVArgs holds for this pool (the fields plans.local_layout reads)."""
    args = SimpleNamespace(
        kv_data_ptrs=list(kv_ptrs), kv_data_lens=list(kv_lens),
        kv_item_lens=[page_size * shape.token_bytes] * shape.buffers,
        aux_data_ptrs=[aux_ptr], aux_data_lens=[aux_len], aux_item_lens=[aux_item],
        page_size=page_size, kv_cache_dtype_str="bfloat16",
    )
    if not shape.is_mla:
        args.kv_head_num = shape.kv_heads
        args.total_kv_head_num = shape.total_kv_heads or shape.kv_heads
    return args
