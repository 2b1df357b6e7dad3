"""Every SGLang member, function and hook target sglang-mori uses, declared in one place. At start-up
(`check_installed`, called when a manager is built) the members of the SGLang modules that process
has loaded are checked against the installed SGLang; the others are checked by the unit tests
(test/unit/test_sglang_manifest.py checks the whole manifest), not in production.

Only the SGLang-facing modules read SGLang objects: `sglang_compat.py` (private members, base
classes), `sglang_adapter.py` (the services' window onto the per-room tables), `sglang_fields.py`
(public fields the layer-wise hooks and start-up read) and the subclass shells `manager.py`,
`sender.py`, `receiver.py`, `bootstrap.py` (their inherited members). test/unit/test_sglang_manifest.py
fails when any other module touches an SGLang object, or when one of these reads a member that is
not declared here.

A member is present when the class (or a class of its MRO) has it as an attribute, a field or an
annotation, or assigns `self.<name>` in its source: SGLang creates most per-instance tables in
`__init__`. This module is pure data; it imports SGLang only when `check_installed` runs.
"""

from __future__ import annotations

import ast
import functools
import importlib
import sys
import inspect
import textwrap
from typing import Dict, List, Tuple

SUPPORTED_SGLANG_VERSION = "0.5.23"

_CONN = "sglang.srt.disaggregation.common.conn"
# Short owner name -> "module:qualname".
OWNERS: Dict[str, str] = {
    "CommonKVManager": f"{_CONN}:CommonKVManager",
    "CommonKVSender": f"{_CONN}:CommonKVSender",
    "CommonKVReceiver": f"{_CONN}:CommonKVReceiver",
    "KVArgs": "sglang.srt.disaggregation.base.conn:KVArgs",
    "KVPoll": "sglang.srt.disaggregation.base.conn:KVPoll",
    "ServerArgs": "sglang.srt.server_args:ServerArgs",
    # The fields get_parallel() publishes (runtime_context.ParallelContext reads them by name).
    "Parallel": "sglang.srt.arg_groups.fields.parallel:Parallel",
    "Scheduler": "sglang.srt.managers.scheduler:Scheduler",
    "PrefillBootstrapQueue": "sglang.srt.disaggregation.prefill:PrefillBootstrapQueue",
    "ScheduleBatch": "sglang.srt.managers.schedule_batch:ScheduleBatch",
    "Req": "sglang.srt.managers.schedule_batch:Req",
    "ReqKvInfo": "sglang.srt.managers.schedule_batch:ReqKvInfo",
    "ForwardBatch": "sglang.srt.model_executor.forward_batch_info:ForwardBatch",
    "ForwardMode": "sglang.srt.model_executor.forward_batch_info:ForwardMode",
    "SpeculativeAlgorithm": "sglang.srt.speculative.spec_info:SpeculativeAlgorithm",
    "TokenToKVPoolAllocator": "sglang.srt.mem_cache.allocator.base:BaseTokenToKVPoolAllocator",
    "ReqToTokenPool": "sglang.srt.mem_cache.memory_pool:ReqToTokenPool",
    "KVCache": "sglang.srt.mem_cache.memory_pool:KVCache",
    "MHATokenToKVPool": "sglang.srt.mem_cache.memory_pool:MHATokenToKVPool",
    "MLATokenToKVPool": "sglang.srt.mem_cache.memory_pool:MLATokenToKVPool",
    "RadixAttention": "sglang.srt.layers.radix_attention:RadixAttention",
    "AttentionBackend": "sglang.srt.layers.attention.base_attn_backend:AttentionBackend",
}

MEMBERS: Dict[str, Tuple[str, ...]] = {
    "CommonKVManager": (
        # private extension points and tables (sglang_compat.py)
        "_prefill_unique_rank", "_maybe_ack_drained_abort", "_room_notify_targets", "_encode_kv_status_message",
        "_send_abort_ack", "_start_heartbeat_checker_thread", "_zmq_ctx", "_staging_outstanding",
        "_deferred_ack_targets", "_deferred_ack_poisoned_rooms", "_deferred_abort_ack_tracker", "_heartbeat_shutdown",
        # public methods we call or override
        "update_status", "resolve_kv_replica_factor", "check_peer_aux_buffer_count", "poison_deferred_ack_room",
        "register_deferred_ack_target", "apply_prefill_status", "note_abort_ack", "register_deferred_abort_room",
        "send_kv_status_message", "try_ensure_parallel_info", "prepare_send_state_indices",
        "parse_kv_status_message", "build_receiver_registration_message", "build_receiver_metadata_message",
        "register_to_bootstrap", "defer_decode_allocation",
        # capability flags we set
        "supports_deferred_decode_kv_release", "supports_role_switch", "reports_transfer_latency",
        "kv_status_msg_carries_reason",
        # per-room tables (both roles, or one role: see sglang_compat.table_sizes)
        "request_status", "failure_records", "failure_lock", "transfer_infos", "req_to_decode_prefix_len",
        "required_prefill_response_num_table", "prefill_response_tracker", "prefill_info_table",
        "addr_to_rooms_tracker",
        # settings
        "kv_args", "server_args", "bootstrap_timeout", "enable_deferred_decode_kv_release", "attn_tp_size",
        "attn_tp_rank", "attn_cp_size", "attn_cp_rank", "dcp_size", "dcp_rank", "system_dp_rank", "pp_size",
        "pp_rank", "local_ip", "rank_port", "server_socket", "kv_shard_size", "kv_shard_rank",
        "enable_all_cp_ranks_for_transfer", "enable_staging",
    ),
    "CommonKVSender": ("kv_mgr", "bootstrap_room", "conclude_state", "clear", "abort"),
    "CommonKVReceiver": ("_send_abort_notification", "_clear", "_connect_to_bootstrap_server",
                         "_owns_bootstrap_room", "_abort_generation", "kv_mgr", "bootstrap_room", "bootstrap_addr",
                         "bootstrap_infos", "init_time", "conclude_state", "abort"),
    "KVArgs": ("ib_device", "gpu_id", "kv_data_ptrs", "kv_data_lens", "kv_item_lens", "kv_layer_ids",
               "kv_cache_dtype_str", "kv_layout", "kv_head_num", "total_kv_head_num", "page_size",
               "aux_data_ptrs", "aux_data_lens", "aux_item_lens", "state_types", "state_data_ptrs",
               "state_data_lens", "state_item_lens", "state_layer_ids", "state_dim_per_tensor",
               "state_slice_outer_counts", "state_conv_shard_groups", "swa_kv_cache_layout",
               "is_hybrid_mla_backend", "prefill_start_layer", "num_draft_entries"),
    "KVPoll": ("Failed", "Bootstrapping", "WaitingForInput", "Transferring", "Success"),
    "ServerArgs": ("enable_metrics", "enable_two_batch_overlap"),
    "Parallel": ("enable_cp_tp_group_sharing", "enable_dsa_cache_layer_split"),
    "Scheduler": ("run_batch", "disagg_prefill_bootstrap_queue", "token_to_kv_pool_allocator", "req_to_token_pool",
                  "checkpoint_disagg_prefill"),
    "PrefillBootstrapQueue": ("kv_manager",),
    "ScheduleBatch": ("forward_mode", "spec_algorithm", "tbo_split_seq_index", "reqs", "prefix_lens", "extend_lens"),
    "Req": ("disagg_kv_sender", "kv", "bootstrap_room", "origin_input_ids", "disagg_decode_prefix_len",
            "start_send_idx", "pending_bootstrap"),
    "ReqKvInfo": ("req_pool_idx",),
    "ForwardBatch": ("forward_mode",),
    "ForwardMode": ("is_extend",),
    "SpeculativeAlgorithm": ("is_none",),
    "TokenToKVPoolAllocator": ("page_size", "get_kvcache"),
    "ReqToTokenPool": ("req_to_token",),
    "KVCache": ("start_layer",),
    "MHATokenToKVPool": ("k_buffer", "v_buffer"),
    "MLATokenToKVPool": ("kv_buffer",),
    "RadixAttention": ("layer_id",),
    "AttentionBackend": ("forward",),
}

# Module-level functions and constants: "module:name" (dots in name walk attributes).
FUNCTIONS: Tuple[str, ...] = (
    "sglang.srt.runtime_context:get_parallel",
    "sglang.srt.runtime_context:get_device",
    "sglang.srt.distributed.device_communicators.mooncake_transfer_engine:get_ib_devices_for_gpu",
    "sglang.srt.disaggregation.utils:get_kv_class",
    "sglang.srt.disaggregation.utils:KVClassType.MANAGER",
    "sglang.srt.disaggregation.utils:KVClassType.SENDER",
    "sglang.srt.disaggregation.utils:KVClassType.RECEIVER",
    "sglang.srt.disaggregation.utils:KVClassType.BOOTSTRAP_SERVER",
    "sglang.srt.disaggregation.utils:TransferBackend.MORI",
    "sglang.srt.disaggregation.utils:DisaggregationMode.PREFILL",
    f"{_CONN}:AckTarget",
    f"{_CONN}:CommonKVBootstrapServer",
    "sglang.srt.plugins.hook_registry:HookRegistry.register",
    "sglang.srt.plugins.hook_registry:HookType.AROUND",
)

# HookRegistry targets (AROUND hooks), registered by plugin.py.
GET_KV_CLASS_TARGET = "sglang.srt.disaggregation.utils.get_kv_class"
RUN_BATCH_TARGET = "sglang.srt.managers.scheduler.Scheduler.run_batch"
ATTENTION_TARGET = "sglang.srt.layers.attention.base_attn_backend.AttentionBackend.forward"
CHECKPOINT_TARGET = ("sglang.srt.disaggregation.prefill.SchedulerDisaggregationPrefillMixin"
                     ".checkpoint_disagg_prefill")
REQUEUE_TARGET = ("sglang.srt.disaggregation.prefill.SchedulerDisaggregationPrefillMixin"
                  ".optimistic_release_and_requeue")
HOOK_TARGETS = (GET_KV_CLASS_TARGET, RUN_BATCH_TARGET, ATTENTION_TARGET, REQUEUE_TARGET, CHECKPOINT_TARGET)
# The layer-wise hooks: (target, function of backend/prefill/layerwise/hooks.py). Listed here, not in
# hooks.py, so that the plugin registers them without importing that module.
LAYERWISE_HOOKS = (
    (RUN_BATCH_TARGET, "around_run_batch"),
    (ATTENTION_TARGET, "around_attention_forward"),
    (REQUEUE_TARGET, "around_requeue"),
    (CHECKPOINT_TARGET, "around_checkpoint"),
)

# Members SGLang itself may leave unset, read with the default SGLang's own code implies; each
# accessor that uses one names it here and says why.
OPTIONAL: Dict[Tuple[str, str], str] = {
    ("AttentionBackend", "token_to_kv_pool"): "not on the base class; backends that own a pool set it "
                                              "(hybrid children), the others write the scheduler's pool",
    ("CommonKVManager", "enable_staging"): "set only by decode managers (False) and staging backends; "
                                           "absent on our prefill manager means off",
    ("CommonKVManager", "bootstrap_timeout"): "set only on prefill managers",
    ("CommonKVManager", "transfer_infos"): "prefill managers only",
    ("CommonKVManager", "req_to_decode_prefix_len"): "prefill managers only",
    ("CommonKVManager", "required_prefill_response_num_table"): "decode managers only",
    ("CommonKVManager", "prefill_response_tracker"): "decode managers only",
    ("CommonKVManager", "addr_to_rooms_tracker"): "decode managers only",
    ("CommonKVManager", "_heartbeat_shutdown"): "created on decode managers only",
    ("CommonKVManager", "_deferred_abort_ack_tracker"): "created on decode managers only",
    ("KVCache", "start_layer"): "a pool object that is not a KVCache has none: layers count from 0",
    ("KVArgs", "prefill_start_layer"): "decode leaves it unset (planning/layout.py)",
    ("KVArgs", "num_draft_entries"): "set only with a draft model",
}


class SGLangIncompatible(ImportError):
    pass


def names_of(owner: str) -> Tuple[str, ...]:
    """Every member of `owner` the plugin reads: declared and optional ones."""
    return MEMBERS.get(owner, ()) + tuple(n for (o, n) in OPTIONAL if o == owner)


def _resolve(spec: str):
    module, _, path = spec.partition(":")
    obj = importlib.import_module(module)
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _resolve_dotted(target: str):
    parts = target.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for part in parts[i:]:
            obj = getattr(obj, part)
        return obj
    raise ImportError(target)


@functools.lru_cache(maxsize=None)
def _self_assigned(klass: type) -> frozenset:
    """Names a class's own source assigns as `self.<name>` (its per-instance attributes)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
    except (OSError, TypeError, SyntaxError):
        return frozenset()
    out = set()
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        stack = list(targets)
        while stack:
            t = stack.pop()
            if isinstance(t, (ast.Tuple, ast.List)):
                stack.extend(t.elts)
            elif isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                out.add(t.attr)
    return frozenset(out)


def has_member(cls: type, name: str) -> bool:
    if hasattr(cls, name):
        return True
    for klass in getattr(cls, "__mro__", (cls,)):
        if name in klass.__dict__.get("__annotations__", {}) or name in _self_assigned(klass):
            return True
    return False


def _not_loaded(spec: str) -> bool:
    return spec.partition(":")[0] not in sys.modules


def missing_members(members: Dict[str, Tuple[str, ...]] = None, with_functions: bool = True,
                    loaded_only: bool = False) -> List[str]:
    """`Owner.member` for each declared member, function or hook target the installed SGLang lacks.
    `loaded_only`: check only what lives in modules this process imported already (start-up: a
    scheduler process has them all; importing the others would cost seconds and hundreds of MB in
    processes that never use them)."""
    out = []
    for owner, names in (MEMBERS if members is None else members).items():
        if loaded_only and _not_loaded(OWNERS[owner]):
            continue
        try:
            cls = _resolve(OWNERS[owner])
        except (ImportError, AttributeError):
            out.append(f"{owner} ({OWNERS[owner]})")
            continue
        out += [f"{owner}.{name}" for name in names if not has_member(cls, name)]
    if not with_functions:
        return out
    for spec in FUNCTIONS:
        if loaded_only and _not_loaded(spec):
            continue
        try:
            _resolve(spec)
        except (ImportError, AttributeError):
            out.append(spec)
    for target in HOOK_TARGETS:
        if loaded_only and target.rsplit(".", 2)[0] not in sys.modules:  # module.Class.method
            continue
        try:
            _resolve_dotted(target)
        except (ImportError, AttributeError):
            out.append(f"hook target {target}")
    return out


def incompatibility(missing: List[str], installed: str) -> str:
    return (f"sglang-mori supports SGLang {SUPPORTED_SGLANG_VERSION}; the installed SGLang {installed} lacks "
            f"{len(missing)} member(s) it uses: " + ", ".join(missing))


@functools.lru_cache(maxsize=None)
def check_installed() -> None:
    """Raise SGLangIncompatible naming every declared member the installed SGLang lacks, of the
    modules this process has loaded (the unit tests check the whole manifest)."""
    missing = missing_members(loaded_only=True)
    if missing:
        import sglang

        raise SGLangIncompatible(incompatibility(missing, getattr(sglang, "__version__", "unknown")))
