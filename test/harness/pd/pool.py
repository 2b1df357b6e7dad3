"""CPU tensors standing in for one rank's KV pool, metadata buffers and state, and its KVArgs.

The KVArgs are filled the way SGLang's schedulers fill them (prefill.py / decode.py
`_init_kv_manager` for a plain MHA or MLA pool): page-sized item lengths, `kv_layer_ids == []`
(plain pools report no ids, so peers pair buffers by position), and `kv_head_num` /
`total_kv_head_num` set on prefill only for MHA. The decode scheduler sets the head counts only
when heterogeneous-TP staging is on, so a backend must not rely on them there.
"""

from __future__ import annotations

from typing import List, Optional

import numpy as np
import torch

from harness.pd import mamba
from harness.pd import pattern as pat
from harness.pd.config import HarnessConfig
from harness.pd.ds_state import DeepSeekState
from harness.pd.plan import Plan

_FILL_SLOTS = 4096  # bound the temporary hash arrays while filling a large pool


def _torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


class RankPool:
    """Buffers of one prefill or decode rank. Decode buffers start zeroed.

    `tp_rank` is the rank in the side's whole TP group (SGLang's tp_rank: with DP attention,
    dp_rank * attention-TP size + attention-TP rank); `pp_rank` the prefill's PP stage, which
    holds only its stage's layers.
    """

    def __init__(self, cfg: HarnessConfig, plan: Plan, side: str, tp_rank: int, pp_rank: int = 0):
        lay = cfg.layout
        self.cfg, self.side, self.tp_rank, self.pp_rank = cfg, side, tp_rank, pp_rank
        self.tp_size = cfg.prefill_tp if side == "prefill" else cfg.decode_tp  # attention TP
        self.dp_size = cfg.prefill_dp if side == "prefill" else cfg.decode_dp
        self.pp_size = cfg.prefill_pp if side == "prefill" else 1
        # SGLang orders the TP group as (DP, CP, attention TP); CP ranks hold the same KV.
        cp = cfg.prefill_cp if side == "prefill" else 1
        self.dp_rank, self.attn_rank = tp_rank // (self.tp_size * cp), tp_rank % self.tp_size
        self.heads = lay.heads_per_rank(self.tp_size)
        self.head_offset = 0 if lay.mla else self.attn_rank * self.heads
        # This stage's model layers [start_layer, start_layer + num_layers); draft layers last.
        self.num_layers = lay.num_layers // self.pp_size
        self.start_layer = pp_rank * self.num_layers
        pages = plan.prefill_pool_pages if side == "prefill" else plan.decode_pool_pages
        self.num_slots = pages * lay.page_size
        dtype = _torch_dtype(lay.dtype)
        shape = (self.num_slots, self.heads, lay.head_dim)
        groups = 1 if lay.mla else 2  # (K, V) per layer for MHA
        self.draft_layers = lay.draft_layers
        if side == "decode" and cfg.decode_draft_layers is not None:
            self.draft_layers = cfg.decode_draft_layers
        self._entries = self._entry_keys(groups)
        # Decode context parallel (decode side only): SGLang's attn_dcp_rank = tp_rank % dcp_size.
        # A target page holds page_size tokens of this DCP rank, a draft page a whole virtual
        # page (page_size x dcp_size tokens), as SGLang sizes the draft pool under DCP.
        self.dcp_size = cfg.decode_dcp if side == "decode" else 1
        self.dcp_rank = tp_rank % self.dcp_size
        self.entry_page_tokens = [
            lay.page_size * (self.dcp_size if self.is_draft_entry(e) else 1) for e in range(len(self._entries))
        ]
        self.kv = [
            torch.zeros((pages * tokens, *shape[1:]), dtype=dtype) for tokens in self.entry_page_tokens
        ]
        self.num_draft_entries = groups * self.draft_layers
        aux_slots = plan.prefill_aux_slots if side == "prefill" else plan.decode_aux_slots
        specs = lay.aux if side == "prefill" or cfg.decode_aux is None else cfg.decode_aux
        self.aux = [torch.zeros((aux_slots, s.width), dtype=_torch_dtype(s.dtype)) for s in specs]
        st_slots = plan.prefill_state_slots if side == "prefill" else plan.decode_state_slots
        # Mamba-like state: tensor i is layer i's; a PP stage holds its share of the tensors, in
        # order, and reports their global layer ids (decode holds them all).
        per_stage = len(lay.state_item_bytes) // self.pp_size
        self.state_layer_ids = list(range(pp_rank * per_stage, (pp_rank + 1) * per_stage))
        self.state = [torch.zeros((st_slots, lay.state_item_bytes[i]), dtype=torch.uint8) for i in self.state_layer_ids]
        # Item-indexed state components (ds_state.py: DeepSeek-V4 / V3.2, QSA, MiniMax, MXFP8
        # block scales), registered after the mamba state.
        self.deepseek_state = DeepSeekState(cfg, plan, side, pp_rank)
        # Qwen3-Next-shaped hybrid: this rank's TP shard of every mamba layer's conv and temporal
        # state (replaces the layer-per-tensor rows above, which exist only without it).
        self.mamba_specs = []
        self.kv_layer_ids: List[int] = []
        if lay.mamba is not None:
            attention, _ = mamba.layer_ids(lay.mamba, lay.num_layers)
            self.kv_layer_ids = attention if lay.mla else attention * 2
            self.mamba_specs = mamba.state_tensors(lay.mamba, lay.num_layers)
            self.state_layer_ids = [s.layer for s in self.mamba_specs]
            self.state = [s.allocate(st_slots, self.tp_size) for s in self.mamba_specs]

    def _entry_keys(self, groups: int):
        """(pattern kind, global layer or draft layer) of each KV entry, in kv_data_ptrs order:
        [K per layer..., V per layer..., draft K..., draft V...] or [latent per layer..., draft...]."""
        layers = range(self.start_layer, self.start_layer + self.num_layers)
        drafts = range(self.draft_layers)
        if groups == 1:
            return [(pat.KIND_MLA, l) for l in layers] + [(pat.KIND_DRAFT_MLA, d) for d in drafts]
        main = [(pat.KIND_K, l) for l in layers] + [(pat.KIND_V, l) for l in layers]
        draft = [(pat.KIND_DRAFT_K, d) for d in drafts] + [(pat.KIND_DRAFT_V, d) for d in drafts]
        return main + draft

    def is_draft_entry(self, entry: int) -> bool:
        return self._entries[entry][0] in (pat.KIND_DRAFT_K, pat.KIND_DRAFT_V, pat.KIND_DRAFT_MLA)

    def sent_by_prefill(self, entry: int) -> bool:
        """Whether the prefill has this KV entry to send (a draft layer the prefill does not run
        has nothing to send, and must stay zero on decode)."""
        kind, index = self._entries[entry]
        draft = kind in (pat.KIND_DRAFT_K, pat.KIND_DRAFT_V, pat.KIND_DRAFT_MLA)
        return not draft or index < self.cfg.layout.draft_layers

    # -- content -------------------------------------------------------------------------------

    def kv_key(self, entry: int, prefill_dp: Optional[int] = None) -> int:
        """Pattern key of kv entry `entry` (position in kv_data_ptrs) as prefill DP rank
        `prefill_dp` holds it (default: this rank's own DP rank)."""
        kind, layer = self._entries[entry]
        dp = self.dp_rank if prefill_dp is None else prefill_dp
        return pat.buffer_key(self.cfg.seed, kind, layer, dp)

    def aux_key(self, i: int, prefill_dp: Optional[int] = None, prefill_pp: Optional[int] = None) -> int:
        """Aux buffer i as prefill DP rank `prefill_dp`, PP stage `prefill_pp` holds it (default:
        this rank's own); every stage fills its aux, decode must get the last stage's."""
        dp = self.dp_rank if prefill_dp is None else prefill_dp
        pp = self.pp_rank if prefill_pp is None else prefill_pp
        return pat.buffer_key(self.cfg.seed, pat.KIND_AUX, i, dp * 16 + pp)

    def state_key(self, i: int, prefill_rank: int, prefill_dp: int = 0) -> int:
        """State tensor i of attention-TP rank `prefill_rank` of prefill DP rank `prefill_dp`."""
        return pat.buffer_key(self.cfg.seed, pat.KIND_STATE, i, prefill_dp * 16 + prefill_rank)

    def mamba_positions(self, i: int) -> np.ndarray:
        """Global positions (along the sliced axis) of mamba state tensor i this rank holds."""
        return self.mamba_specs[i].positions(self.tp_size, self.attn_rank)

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
        for spec, t in zip(self.mamba_specs, self.state):
            view = mamba.rows_view(t, spec)
            rows = np.arange(view.shape[0])
            positions = spec.positions(self.tp_size, self.attn_rank)
            view[:] = spec.content(self.cfg.seed, self.dp_rank, rows, positions)
        for i, t in enumerate([] if self.mamba_specs else self.state):
            view = self.byte_view(t)
            rows = np.arange(view.shape[0])
            key = self.state_key(self.state_layer_ids[i], self.attn_rank, self.dp_rank)
            view[:] = pat.pattern(key, rows, np.array([0]), view.shape[1])[:, 0]
        self.deepseek_state.fill(self.dp_rank, self.attn_rank)

    # -- SGLang registration -------------------------------------------------------------------

    def kv_args(self, kv_args_class):
        """A KVArgs for this rank, field by field as SGLang's scheduler fills it."""
        from sglang.srt.disaggregation.base.conn import StateType

        lay, ps = self.cfg.layout, self.cfg.layout.page_size
        a = kv_args_class()
        # prefill.py: engine_rank = tp_rank (the whole TP group's rank, also with DP attention);
        # decode.py: tp_rank % attn_tp_size.
        a.engine_rank = self.tp_rank if self.side == "prefill" else self.attn_rank
        a.pp_rank = self.pp_rank
        # get_parallel().dp_rank: the DP controller's rank, None without one.
        a.system_dp_rank = self.dp_rank if self.dp_size > 1 else None
        a.rust_http_port = None
        a.kv_cache_dtype_str = lay.dtype
        a.kv_layout = None
        a.prefill_start_layer = self.start_layer
        a.prefill_end_layer = self.start_layer + self.num_layers
        a.kv_data_ptrs = [t.data_ptr() for t in self.kv]
        a.kv_data_lens = [t.nbytes for t in self.kv]
        a.kv_item_lens = [t[0].nbytes * tokens for t, tokens in zip(self.kv, self.entry_page_tokens)]
        a.num_draft_entries = self.num_draft_entries
        # build_kv_layer_ids: [] for plain pools; HybridLinearKVPool reports its full-attention
        # layers' global ids (K then V for MHA).
        a.kv_layer_ids = list(self.kv_layer_ids)
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
        if self.mamba_specs:
            # setup_state_kv_args for a HybridLinearKVPool: one MAMBA component with MambaPool's
            # slice metadata, so a peer of another TP size can slice it.
            a.is_hybrid_mla_backend = lay.mla
            a.state_types.append(StateType.MAMBA)
            a.state_data_ptrs.append([t.data_ptr() for t in self.state])
            a.state_data_lens.append([t.nbytes for t in self.state])
            a.state_item_lens.append([t[0].nbytes for t in self.state])
            a.state_dim_per_tensor.append([s.slice_dim(self.tp_size) for s in self.mamba_specs])
            a.state_slice_outer_counts.append([s.outer for s in self.mamba_specs])
            a.state_layer_ids.append(list(self.state_layer_ids))
            a.state_conv_shard_groups.append([mamba.conv_shard_groups(s) for s in self.mamba_specs])
        elif self.state:
            a.state_types.append(StateType.MAMBA)
            a.state_data_ptrs.append([t.data_ptr() for t in self.state])
            a.state_data_lens.append([t.nbytes for t in self.state])
            a.state_item_lens.append([t[0].nbytes for t in self.state])
            a.state_dim_per_tensor.append([])
            a.state_slice_outer_counts.append([])
            a.state_layer_ids.append(list(self.state_layer_ids))
            a.state_conv_shard_groups.append([])
        self.deepseek_state.register(a)
        return a

    def state_indices(self, slot: int) -> List:
        """state_indices as the scheduler builds them: one entry per state component."""
        # _mamba_payload: a list holding the request's Mamba slot as a numpy array.
        out = [[np.array(slot, dtype=np.int32)]] if self.state else []
        return out + (self.deepseek_state.indices(slot) if self.deepseek_state else [])
