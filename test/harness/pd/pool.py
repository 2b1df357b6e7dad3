"""CPU tensors standing in for one rank's KV pool, metadata buffers and state, and its KVArgs.

The KVArgs are filled the way SGLang's schedulers fill them (prefill.py / decode.py
`_init_kv_manager` for a plain MHA or MLA pool): page-sized item lengths, `kv_layer_ids == []`
(plain pools report no ids, so peers pair buffers by position), and `kv_head_num` /
`total_kv_head_num` set on prefill only for MHA. The decode scheduler sets the head counts only
when heterogeneous-TP staging is on, so a backend must not rely on them there.
"""

from __future__ import annotations

from typing import List

import numpy as np
import torch

from harness.pd import pattern as pat
from harness.pd.config import HarnessConfig
from harness.pd.plan import Plan

_FILL_SLOTS = 4096  # bound the temporary hash arrays while filling a large pool


def _torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


class RankPool:
    """Buffers of one prefill or decode TP rank. Decode buffers start zeroed."""

    def __init__(self, cfg: HarnessConfig, plan: Plan, side: str, tp_rank: int):
        lay = cfg.layout
        self.cfg, self.side, self.tp_rank = cfg, side, tp_rank
        self.tp_size = cfg.prefill_tp if side == "prefill" else cfg.decode_tp
        self.heads = lay.heads_per_rank(self.tp_size)
        self.head_offset = 0 if lay.mla else tp_rank * self.heads
        pages = plan.prefill_pool_pages if side == "prefill" else plan.decode_pool_pages
        self.num_slots = pages * lay.page_size
        dtype = _torch_dtype(lay.dtype)
        shape = (self.num_slots, self.heads, lay.head_dim)
        if lay.mla:
            self.kv = [torch.zeros(shape, dtype=dtype) for _ in range(lay.num_layers)]
        else:
            k = [torch.zeros(shape, dtype=dtype) for _ in range(lay.num_layers)]
            v = [torch.zeros(shape, dtype=dtype) for _ in range(lay.num_layers)]
            self.kv = k + v
        aux_slots = plan.prefill_aux_slots if side == "prefill" else plan.decode_aux_slots
        specs = lay.aux if side == "prefill" or cfg.decode_aux is None else cfg.decode_aux
        self.aux = [torch.zeros((aux_slots, s.width), dtype=_torch_dtype(s.dtype)) for s in specs]
        st_slots = plan.prefill_state_slots if side == "prefill" else plan.decode_state_slots
        self.state = [torch.zeros((st_slots, n), dtype=torch.uint8) for n in lay.state_item_bytes]

    # -- content -------------------------------------------------------------------------------

    def kv_key(self, entry: int) -> int:
        """Pattern key of kv entry `entry` (position in kv_data_ptrs)."""
        lay = self.cfg.layout
        if lay.mla:
            return pat.buffer_key(self.cfg.seed, pat.KIND_MLA, entry)
        kind = pat.KIND_K if entry < lay.num_layers else pat.KIND_V
        return pat.buffer_key(self.cfg.seed, kind, entry % lay.num_layers)

    def aux_key(self, i: int) -> int:
        return pat.buffer_key(self.cfg.seed, pat.KIND_AUX, i)

    def state_key(self, i: int, prefill_rank: int) -> int:
        return pat.buffer_key(self.cfg.seed, pat.KIND_STATE, i, prefill_rank)

    def global_heads(self) -> np.ndarray:
        return np.arange(self.head_offset, self.head_offset + self.heads)

    def byte_view(self, t: torch.Tensor) -> np.ndarray:
        """Writable uint8 numpy view: [rows, heads, head_bytes] for KV, [rows, row_bytes] else."""
        arr = t.view(torch.uint8).numpy()
        if t.dim() == 3:
            return arr.reshape(t.shape[0], t.shape[1], -1)
        return arr.reshape(t.shape[0], -1)

    def fill_prefill(self) -> None:
        """Write the pattern into every slot of every buffer (prefill side only)."""
        heads = self.global_heads()
        for entry, t in enumerate(self.kv):
            view, key = self.byte_view(t), self.kv_key(entry)
            for start in range(0, self.num_slots, _FILL_SLOTS):
                slots = np.arange(start, min(start + _FILL_SLOTS, self.num_slots))
                view[slots] = pat.pattern(key, slots, heads, view.shape[2])
        for i, t in enumerate(self.aux):
            view = self.byte_view(t)
            rows = np.arange(view.shape[0])
            view[:] = pat.pattern(self.aux_key(i), rows, np.array([0]), view.shape[1])[:, 0]
        for i, t in enumerate(self.state):
            view = self.byte_view(t)
            rows = np.arange(view.shape[0])
            key = self.state_key(i, self.tp_rank)
            view[:] = pat.pattern(key, rows, np.array([0]), view.shape[1])[:, 0]

    # -- SGLang registration -------------------------------------------------------------------

    def kv_args(self, kv_args_class):
        """A KVArgs for this rank, field by field as SGLang's scheduler fills it."""
        from sglang.srt.disaggregation.base.conn import StateType

        lay, ps = self.cfg.layout, self.cfg.layout.page_size
        a = kv_args_class()
        a.engine_rank = self.tp_rank  # == tp_rank % attn_tp_size without attention DP
        a.pp_rank = 0
        a.system_dp_rank = None  # get_parallel().dp_rank is None without a DP controller
        a.rust_http_port = None
        a.kv_cache_dtype_str = lay.dtype
        a.kv_layout = None
        a.prefill_start_layer = 0
        a.prefill_end_layer = lay.num_layers
        a.kv_data_ptrs = [t.data_ptr() for t in self.kv]
        a.kv_data_lens = [t.nbytes for t in self.kv]
        a.kv_item_lens = [t[0].nbytes * ps for t in self.kv]
        a.num_draft_entries = 0
        a.kv_layer_ids = []
        if self.side == "prefill" and not lay.mla:
            a.kv_head_num = self.heads
            a.total_kv_head_num = lay.total_kv_heads
        a.page_size = ps
        a.aux_data_ptrs = [t.data_ptr() for t in self.aux]
        a.aux_data_lens = [t.nbytes for t in self.aux]
        a.aux_item_lens = [t[0].nbytes for t in self.aux]
        a.ib_device = None
        a.gpu_id = 0
        # setup_state_kv_args defaults, plus one Mamba-like component when configured.
        a.state_types, a.state_data_ptrs, a.state_data_lens = [], [], []
        a.state_item_lens, a.state_dim_per_tensor, a.state_slice_outer_counts = [], [], []
        a.state_layer_ids, a.state_conv_shard_groups = [], []
        a.is_hybrid_mla_backend = False
        a.swa_kv_cache_layout = None
        a.mla_compression_ratios = None
        if self.state:
            a.state_types.append(StateType.MAMBA)
            a.state_data_ptrs.append([t.data_ptr() for t in self.state])
            a.state_data_lens.append([t.nbytes for t in self.state])
            a.state_item_lens.append([t[0].nbytes for t in self.state])
            a.state_dim_per_tensor.append([])
            a.state_slice_outer_counts.append([])
            a.state_layer_ids.append(list(range(len(self.state))))
            a.state_conv_shard_groups.append([])
        return a

    def state_indices(self, slot: int) -> List:
        """state_indices as the scheduler builds them: one entry per state component."""
        if not self.state:
            return []
        # _mamba_payload: a list holding the request's Mamba slot as a numpy array.
        return [[np.array(slot, dtype=np.int32)]]
