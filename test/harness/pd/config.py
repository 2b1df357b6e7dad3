"""Configuration of the multi-process PD transfer harness (see pd_harness.py).

Plain dataclasses, picklable, so the same object is handed to every worker process; each process
derives what it needs (its head range, pool sizes, the room plan) from it deterministically.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

BACKENDS = ("mori", "mooncake", "mori-builtin")
# torch dtype names we accept; the harness only moves bytes, so any fixed-width dtype works.
DTYPE_SIZES = {"bfloat16": 2, "float16": 2, "float32": 4, "int8": 1, "uint8": 1}
AUX_DTYPE_SIZES = {"int32": 4, "float32": 4, "int64": 8, "bfloat16": 2}


@dataclass(frozen=True)
class AuxBufferSpec:
    """One metadata buffer, like a field of SGLang's MetadataBuffers: [slots, width] of dtype."""

    dtype: str = "int32"
    width: int = 16


@dataclass(frozen=True)
class HybridMambaShape:
    """Qwen3-Next-shaped linear attention (GDN) next to the full-attention KV (harness/pd/mamba.py).

    Sizes are the model's, unsharded: each TP rank holds 1/TP of the key and value heads. The
    KV layout's `num_layers` counts the full-attention layers; every `full_attention_interval`-th
    model layer is one of them and the others carry this state.
    """

    full_attention_interval: int = 4
    num_key_heads: int = 2
    num_value_heads: int = 4
    head_k_dim: int = 4
    head_v_dim: int = 4
    conv_kernel: int = 4
    conv_dtype: str = "bfloat16"
    temporal_dtype: str = "float32"
    # Kimi-Linear's layout instead (KimiLinearStateShape): conv [K-1, v | k | k] per slot, sliced
    # on its second axis (K-1 rows before the slice axis), temporal [HV/TP, head_v_dim, head_v_dim].
    kimi: bool = False
    # A per-layer short-conv state whole on every TP rank after the mamba tensors (ple_state_pool's
    # ShortConvPool, a MambaPool slot sibling; slice dim 0): one elected prefill rank writes it.
    replicated_conv: bool = False


DEEPSEEK_STATE_TYPES = ("swa", "swa_ring", "c128_state", "request_row", "dsa", "dsa_tail")
# Other item-indexed state types SGLang's pools register (disaggregation/utils.py
# setup_state_kv_args): QSA (QSATokenToKVPool), MiniMax sparse (MiniMaxSparseKVPool), MXFP8 KV
# block scales (MHATokenToKVPoolMXFP8, its SWA sub-pool's). They ride in the same spec.
ITEM_STATE_TYPES = DEEPSEEK_STATE_TYPES + (
    "qsa_pending", "qsa_compressed", "minimax_index_k", "minimax_dense_kv", "block_scale", "block_scale_swa",
)
# Whole on every TP rank only in an MLA model (elsewhere their sharding differs).
MLA_ONLY_STATE_TYPES = DEEPSEEK_STATE_TYPES
# TP shards no backend reslices: the harness runs them with equal TP sizes only.
EQUAL_TP_STATE_TYPES = ("minimax_index_k", "minimax_dense_kv", "block_scale", "block_scale_swa")
# Registered one tensor per model layer of the PP stage, in this many groups (DSATokenToKVPool:
# index buffers; compress tail: keys of every layer, then scores): the only id-less types a
# prefill PP stage sends (the planner's layer_map.PER_LAYER_GROUPS).
PP_STATE_GROUPS = {"dsa": 1, "dsa_tail": 2}


@dataclass(frozen=True)
class DeepSeekStateSpec:
    """One item-indexed state component (an entry of KVArgs.state_types): DeepSeek-V4 / V3.2 state
    of an MLA model (whole on every TP rank), QSA, MiniMax sparse state or MXFP8 block scales
    (ITEM_STATE_TYPES); one tensor per entry of `item_bytes` (one per layer), registered after
    any mamba state. See ds_state.py for how each type's items are addressed. Under prefill PP,
    dsa has one tensor per model layer and dsa_tail two (PP_STATE_GROUPS).

    `item_bytes` is the bytes of one item: a SWA page (swa), a DSA index page (dsa), a ring row
    (swa_ring), a c128 ring page (c128_state), a request row (request_row), or one slot of the
    DSA tail ring (dsa_tail: SGLang's item is the whole ring row, `ring` slots of it).
    `window`: SWA window in tokens (swa, swa_ring). `ring`: ring rows per request (swa_ring),
    ring size in tokens (c128_state), tail ring slots (dsa_tail). `ratio`: c128 compression ratio
    (c128_state), index_kpool (dsa_tail). `decode_ring`: decode's ring when it differs (a
    positional match: SGLang adds tail slots for speculative decoding on one side only).
    """

    state_type: str
    item_bytes: Tuple[int, ...] = (24, 40)
    window: int = 0
    ring: int = 0
    ratio: int = 0
    decode_ring: Optional[int] = None


@dataclass(frozen=True)
class KVLayout:
    """Shape of the KV pool of one rank, as SGLang would register it.

    MHA: per layer one K and one V buffer of [slots, heads_per_rank, head_dim]; kv_data_ptrs is
    [K0..Kn-1, V0..Vn-1]. MLA: one buffer per layer of [slots, 1, head_dim], the same on every TP
    rank (MLA latent KV is not split by head).
    """

    num_layers: int = 2
    total_kv_heads: int = 4
    head_dim: int = 16
    dtype: str = "bfloat16"
    page_size: int = 1
    mla: bool = False
    aux: Tuple[AuxBufferSpec, ...] = (
        AuxBufferSpec("int32", 16),
        AuxBufferSpec("float32", 16),
        AuxBufferSpec("int64", 8),
    )
    # Mamba-like state: per state tensor one item of `state_item_bytes` per request slot. Empty
    # tuple = no state component (kv_args.state_types == []).
    state_item_bytes: Tuple[int, ...] = ()
    # Qwen3-Next-shaped hybrid: mamba state sharded over TP like SGLang's MambaPool, registered
    # with its slice metadata, so prefill and decode TP sizes may differ. Excludes
    # state_item_bytes; the KV then reports its full-attention layer ids (HybridLinearKVPool).
    mamba: Optional[HybridMambaShape] = None
    # An MTP/EAGLE draft model's KV layers, registered after the main model's on both sides
    # (KVArgs.num_draft_entries: K and V per draft layer for MHA, one latent buffer for MLA).
    draft_layers: int = 0
    # DeepSeek-V4 / V3.2 state components (MLA only), in registration order after mamba state.
    deepseek_state: Tuple[DeepSeekStateSpec, ...] = ()

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    def heads_per_rank(self, tp_size: int) -> int:
        if self.mla:
            return 1
        return self.total_kv_heads // tp_size

    def head_bytes(self) -> int:
        return self.head_dim * self.itemsize


@dataclass(frozen=True)
class RoomShape:
    """How many tokens each request carries and how it is sent."""

    min_tokens: int = 1
    max_tokens: int = 64
    # send() calls per room (page groups); the last one carries aux and state. A room with fewer
    # pages than chunks gets one chunk per page. Every chunk has at least one page: in SGLang the
    # last chunk always holds the page of the last prompt token, and the Common sender decides
    # "last" by page count (curr_idx == num_kv_indices), so a trailing empty send would be a
    # second "last" chunk that no scheduler path produces for a plain pool.
    chunks: int = 1


@dataclass
class HarnessConfig:
    """Everything one harness run needs. Field defaults give a small MHA 1->1 run."""

    # "mori": our plugin (the target); "mooncake": SGLang's Mooncake over TCP (reference);
    # "mori-builtin": SGLang's own mori backend on softio through the mori shim (benchmark baseline).
    backend: str = "mori"
    layout: KVLayout = field(default_factory=KVLayout)
    # Attention TP size of each side (per DP rank with DP attention).
    prefill_tp: int = 1
    decode_tp: int = 1
    # DP attention (--enable-dp-attention --dp-size N --tp-size N*attn_tp): DP ranks per side, each
    # with its own pools and attention TP ranks. A room runs on one prefill DP rank and one decode
    # DP rank (plan.RoomPlan.prefill_dp / decode_dp).
    prefill_dp: int = 1
    decode_dp: int = 1
    # How decode learns a room's prefill DP rank (SGLang's three ways, decode.py
    # _resolve_prefill_dp_rank): "follow_bootstrap_room" (bootstrap_room % dp, the default
    # --load-balance-method), "explicit" (the router set req.disagg_prefill_dp_rank: the sender
    # is told so and decode calls init(rank)), "query" (prefill runs --load-balance-method
    # round_robin, registers each room's DP rank with the bootstrap server, decode asks
    # /query_dp_ranks).
    prefill_dp_routing: str = "follow_bootstrap_room"
    # Pipeline-parallel stages of the prefill (decode stays PP 1): stage s holds layers
    # [s*L/pp, (s+1)*L/pp) with prefill_start_layer, its own KV buffers; aux from the last stage.
    prefill_pp: int = 1
    # Prefill context parallel (--enable-prefill-cp --attn-cp-size N): N CP ranks per (DP, attention
    # TP) rank, each holding the request's whole KV and state alike. Which of them send is SGLang's
    # choice: CP rank 0 only, or every rank with SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER=1.
    prefill_cp: int = 1
    # Decode context parallel (decode --dcp-size): decode TP ranks r and r' with r % N == r' % N
    # share a DCP rank; decode's page indices are virtual pages of page_size x N tokens, token
    # position p lives on DCP rank p % N (harness/pd/dcp.py). MLA only, prefill DCP 1. A decode
    # prefix (decode_prefix, in prefill pages) is rounded down to whole virtual pages (N pages).
    decode_dcp: int = 1
    # Decode's metadata buffers when they differ from layout.aux (an optional buffer enabled on one
    # engine only, e.g. --disaggregation-enable-kv-checksum). SGLang pairs aux buffers by
    # position and moves the leading min(prefill, decode) of them.
    decode_aux: Optional[Tuple[AuxBufferSpec, ...]] = None
    # Decode's draft-model layers when they differ from layout.draft_layers (a decode running
    # MTP/EAGLE fed by a prefill without it): the draft buffers prefill does not have stay zero.
    decode_draft_layers: Optional[int] = None
    # Decode prefix-cache hits: (plan index, pages) -- decode already holds the first pages of
    # that room, sends metadata for the rest with decode_prefix_len, and prefill sends only the
    # rest (SGLang's decode_prefix_len path). At least the last page is always sent.
    decode_prefix: Tuple[Tuple[int, int], ...] = ()
    # Independent decode servers (1P-nD), each with decode_tp ranks and its own pools; room i
    # goes to decode instance i % decode_instances.
    decode_instances: int = 1
    rooms: int = 64
    shape: RoomShape = field(default_factory=RoomShape)
    # Rooms open at once on each side; None = all of them at the start (one burst).
    max_inflight: Optional[int] = None
    # Plan indices to abort: on prefill right after the room's last send() (an AbortReq for an
    # in-flight request), on decode while still pre-allocating (after init, before send_metadata).
    prefill_abort: Tuple[int, ...] = ()
    decode_abort: Tuple[int, ...] = ()
    # When prefill aborts: "sent" (right after the last send(); its writes may not be submitted
    # yet) or "first_success" (once any room of this rank succeeded, so the aborted rooms' writes
    # are typically in flight, e.g. under a softio bandwidth cap).
    prefill_abort_trigger: str = "sent"
    # Reliability tests (see pd/control.py). `rounds`: room counts of consecutive rounds
    # (summing to `rooms`); a worker opens round k only after every room of earlier rounds is
    # finished on its side and, with `control`, once the test opened round k. `control`: serve
    # the per-worker control socket (fault injection mid-run, leftover tables, write log, engine
    # restart). `decode_abort_inflight`: decode aborts these rooms once their transfer has
    # started (mori: TransferStarted seen, which a last chunk sends only once its writes outlive
    # SGLANG_MORI_ANNOUNCE_GRACE_MS, so hold them in flight; other backends: right after send_metadata).
    # `bad_decode_pages`: these rooms send metadata naming a decode page past the pool's end.
    # `duplicate_rooms`: (a, b) pairs, room b reuses room a's bootstrap_room id.
    rounds: Tuple[int, ...] = ()
    control: bool = False
    # Decode (mori only): record every RoomStatus message per room (RankReport.statuses), e.g. to
    # see which prefill ranks sent Success and which of them carried aux.
    record_statuses: bool = False
    decode_abort_inflight: Tuple[int, ...] = ()
    bad_decode_pages: Tuple[int, ...] = ()
    duplicate_rooms: Tuple[Tuple[int, int], ...] = ()
    # Plan indices whose decode receiver is given a bootstrap address where nothing listens (a
    # port decode keeps bound but never listens on): the bootstrap server cannot be reached from
    # the start. Prefill still runs these rooms against the live bootstrap server.
    unreachable_bootstrap: Tuple[int, ...] = ()
    # Decode's "ensure parallel info" retries, as SGLang's DecodePreallocQueue._ensure_prefill_info
    # does them: one attempt per bootstrap address at most every ensure_retry_s, and after
    # ensure_max_attempts failed attempts every room still waiting on that address is aborted
    # (SGLang: 15 attempts, 1.0 s apart). 0 = retry until the run deadline (the harness default).
    ensure_max_attempts: int = 0
    ensure_retry_s: float = 0.05
    seed: int = 1234
    # Decode pages never given to any room, checked to stay zero.
    spare_decode_pages: int = 16
    # Extra environment for every worker (applied before SGLang is imported there), and per side
    # on top of it (e.g. softio fault injection on prefill only).
    env: Dict[str, str] = field(default_factory=dict)
    prefill_env: Dict[str, str] = field(default_factory=dict)
    decode_env: Dict[str, str] = field(default_factory=dict)
    host: str = "127.0.0.1"
    # Benchmarks: gc.freeze() in every worker once its manager exists, whatever the backend (what
    # an operator calling SGLang's /freeze_gc gets), to compare backends without GC pauses.
    freeze_gc_all: bool = False
    # Benchmarks: each rank reports its CPU by thread role from "go" to its last room (thread_cpu.py).
    thread_cpu: bool = False
    # Deadlines (seconds): worker start-up (imports + manager construction), all rooms terminal,
    # the whole run including teardown.
    startup_timeout_s: float = 300.0
    transfer_timeout_s: float = 120.0
    # SGLang's own bootstrap/waiting timeouts inside the workers, so a lost room fails instead of
    # hanging; they must stay below transfer_timeout_s to be observed.
    sglang_timeout_s: float = 60.0
    # Verify bytes on decode after the transfers (benchmarks may turn it off).
    verify: bool = True
    # "forkserver" shares one pre-imported SGLang between all workers of a session (fast);
    # "spawn" gives every worker a fresh interpreter.
    start_method: str = "forkserver"
    log_level: str = "WARNING"

    def validate(self) -> None:
        lay = self.layout
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if lay.dtype not in DTYPE_SIZES:
            raise ValueError(f"unsupported dtype {lay.dtype!r}; one of {sorted(DTYPE_SIZES)}")
        for spec in lay.aux:
            if spec.dtype not in AUX_DTYPE_SIZES:
                raise ValueError(f"unsupported aux dtype {spec.dtype!r}")
        if self.prefill_tp < 1 or self.decode_tp < 1:
            raise ValueError("TP sizes must be >= 1")
        if min(self.prefill_dp, self.decode_dp, self.prefill_pp, self.prefill_cp) < 1:
            raise ValueError("DP, PP and CP sizes must be >= 1")
        if self.prefill_cp > 1 and (self.prefill_pp > 1 or self.decode_dcp > 1):
            raise ValueError("the harness runs prefill CP with prefill PP 1 and decode DCP 1")
        if lay.draft_layers < 0:
            raise ValueError("draft_layers must be >= 0")
        if self.prefill_dp_routing not in ("follow_bootstrap_room", "explicit", "query"):
            raise ValueError("prefill_dp_routing must be 'follow_bootstrap_room', 'explicit' or 'query'")
        if self.prefill_pp > 1 and lay.num_layers % self.prefill_pp:
            raise ValueError(f"{lay.num_layers} layers do not split over {self.prefill_pp} PP stages")
        if self.prefill_pp > 1 and len(lay.state_item_bytes) % self.prefill_pp:
            raise ValueError("with prefill_pp > 1 the state tensors (one per layer) must split over the stages")
        if self.prefill_pp > 1 and lay.draft_layers:
            raise ValueError("SGLang runs no draft model under PP; the harness does not either")
        if self.decode_dcp > 1:
            self._validate_dcp()
        if self.decode_instances > 1 and self.decode_dp > 1:
            raise ValueError("decode_instances and decode_dp do not combine in the harness")
        big, small = max(self.prefill_tp, self.decode_tp), min(self.prefill_tp, self.decode_tp)
        if big % small:
            raise ValueError("one TP size must divide the other (SGLang's rank mapping needs it)")
        if not lay.mla and lay.total_kv_heads % big:
            raise ValueError(f"{lay.total_kv_heads} KV heads do not split over TP {big}")
        if lay.mamba is not None:
            self._validate_mamba(big)
        if lay.state_item_bytes and self.prefill_tp != self.decode_tp:
            # SGLang reslices Mamba state across TP only with per-tensor dim metadata; the harness
            # keeps state to the equal-TP case where each rank's state goes to the same rank.
            raise ValueError("state buffers need prefill_tp == decode_tp")
        for spec in lay.deepseek_state:
            _validate_deepseek_state(spec, self)
        if any(not 0 <= i < self.rooms or n < 0 for i, n in self.decode_prefix):
            raise ValueError("decode_prefix must name rooms of the plan with a page count >= 0")
        if self.decode_instances < 1:
            raise ValueError("decode_instances must be >= 1")
        if self.rooms < 1:
            raise ValueError("rooms must be >= 1")
        if not (1 <= self.shape.min_tokens <= self.shape.max_tokens):
            raise ValueError("need 1 <= min_tokens <= max_tokens")
        if any(not 0 <= i < self.rooms for i in (*self.prefill_abort, *self.decode_abort)):
            raise ValueError("abort indices must name rooms of the plan")
        if self.prefill_abort_trigger not in ("sent", "first_success"):
            raise ValueError("prefill_abort_trigger must be 'sent' or 'first_success'")
        if self.rounds and (sum(self.rounds) != self.rooms or min(self.rounds) < 1):
            raise ValueError("rounds must be positive room counts summing to rooms")
        named = [
            *self.decode_abort_inflight,
            *self.bad_decode_pages,
            *(i for p in self.duplicate_rooms for i in p),
            *self.unreachable_bootstrap,
        ]
        if any(not 0 <= i < self.rooms for i in named):
            raise ValueError("room indices of the reliability options must name rooms of the plan")
        if self.ensure_max_attempts < 0 or self.ensure_retry_s < 0:
            raise ValueError("ensure_max_attempts and ensure_retry_s must be >= 0")
        if self.shape.chunks < 1:
            raise ValueError("chunks must be >= 1")
        if self.start_method not in ("forkserver", "spawn"):
            raise ValueError("start_method must be 'forkserver' or 'spawn'")

    def _validate_mamba(self, big_tp: int) -> None:
        m = self.layout.mamba
        if self.layout.state_item_bytes:
            raise ValueError("layout.mamba and layout.state_item_bytes do not combine")
        if self.prefill_pp > 1 or self.layout.draft_layers:
            raise ValueError("the harness's hybrid mamba layout runs without PP and draft layers")
        if m.kimi and m.head_k_dim != m.head_v_dim:
            raise ValueError("Kimi-Linear's temporal state is [heads, head_dim, head_dim]: head_k_dim == head_v_dim")
        if m.num_key_heads % big_tp or m.num_value_heads % big_tp:
            raise ValueError(f"linear-attention heads ({m.num_key_heads} key, {m.num_value_heads} value) "
                             f"do not split over TP {big_tp}")
        if m.full_attention_interval < 2 or m.conv_kernel < 2:
            raise ValueError("need full_attention_interval >= 2 and conv_kernel >= 2")
        for dtype in (m.conv_dtype, m.temporal_dtype):
            if dtype not in DTYPE_SIZES:
                raise ValueError(f"unsupported state dtype {dtype!r}")

    def _validate_dcp(self) -> None:
        lay = self.layout
        if not lay.mla:
            raise ValueError("decode_dcp needs an MLA layout (SGLang relays out MLA KV only)")
        if self.decode_tp % self.decode_dcp:
            raise ValueError(f"decode_dcp {self.decode_dcp} must divide decode_tp {self.decode_tp}")
        if self.prefill_pp > 1 or self.decode_dp > 1 or self.prefill_dp > 1 or self.decode_instances > 1:
            raise ValueError("the harness runs decode_dcp without PP, DP attention and extra decode instances")
        if lay.state_item_bytes or lay.mamba is not None or lay.deepseek_state:
            raise ValueError("the harness runs decode_dcp without state components")

    def replace(self, **changes) -> "HarnessConfig":
        return dataclasses.replace(self, **changes)


def _validate_deepseek_state(spec: DeepSeekStateSpec, cfg: "HarnessConfig") -> None:
    lay = cfg.layout
    if spec.state_type not in ITEM_STATE_TYPES:
        raise ValueError(f"deepseek_state type must be one of {ITEM_STATE_TYPES}, got {spec.state_type!r}")
    if spec.state_type in MLA_ONLY_STATE_TYPES and not lay.mla:
        raise ValueError(f"deepseek_state {spec.state_type!r} needs an MLA layout")
    if spec.state_type in EQUAL_TP_STATE_TYPES and cfg.prefill_tp != cfg.decode_tp:
        raise ValueError(f"deepseek_state {spec.state_type!r} needs prefill_tp == decode_tp")
    if cfg.prefill_pp > 1:
        groups = PP_STATE_GROUPS.get(spec.state_type)
        if groups is None:
            raise ValueError(f"deepseek_state {spec.state_type!r} under prefill PP is not modelled (no layer ids)")
        if len(spec.item_bytes) != groups * lay.num_layers:
            raise ValueError(f"under prefill PP {spec.state_type!r} has {groups} tensor(s) per layer")
    if not spec.item_bytes or min(spec.item_bytes) < 1:
        raise ValueError("deepseek_state item_bytes must be positive, one per tensor")
    rings = [spec.ring] + ([] if spec.decode_ring is None else [spec.decode_ring])
    if spec.state_type in ("swa", "swa_ring", "block_scale_swa") and spec.window < 1:
        raise ValueError(f"{spec.state_type} needs window >= 1")
    if spec.state_type == "swa_ring" and min(rings) < spec.window:
        raise ValueError("swa_ring rows per request must hold the window")
    if spec.state_type == "c128_state" and (spec.ratio < 1 or any(r < spec.ratio or r % spec.ratio for r in rings)):
        raise ValueError("c128_state needs a ring that is a positive multiple of ratio")
    if spec.state_type == "dsa_tail" and (spec.ratio < 2 or min(rings) < spec.ratio):
        raise ValueError("dsa_tail needs index_kpool (ratio) > 1 and tail rings of at least that many slots")
