"""Reads of SGLang's public fields for the layer-wise hooks, start-up and the manager's settings:
every member read here is declared in sglang_manifest.py and checked at start-up, so a renamed
field fails there instead of silently becoming a default. Defaults appear only where SGLang itself
may leave a member unset (sglang_manifest.OPTIONAL says why for each).

The rest of the package sees plain values: hooks.py hands the session views, start-up hands
assembly a `Deployment` and context_parallel a `PrefillCP`.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Optional

from sglang_mori.backend.sglang_manifest import MEMBERS


# --- scheduler, batch, request (layer-wise hooks) -------------------------------------------------

def layerwise_session(scheduler):
    """Our layer-wise session on this scheduler, or None (decode, or another backend, or off).
    SGLang sets `disagg_prefill_bootstrap_queue` to None outside prefill mode."""
    queue = scheduler.disagg_prefill_bootstrap_queue
    if queue is None:
        return None
    return getattr(queue.kv_manager, "layerwise", None)  # ours only: another backend's manager has none


def is_extend(forward_info) -> bool:
    """A ScheduleBatch's or ForwardBatch's mode is an extend (prefill) forward."""
    mode = forward_info.forward_mode
    return mode is not None and mode.is_extend()


def batch_fallback(batch) -> Optional[str]:
    """Why this batch cannot stream layer-wise, or None. `spec_algorithm` is None by default on a
    ScheduleBatch (SGLang's dataclass default)."""
    spec = batch.spec_algorithm
    if spec is not None and not spec.is_none():
        return "speculative"
    if batch.tbo_split_seq_index is not None:
        return "two_batch_overlap"
    return None


def page_size(scheduler) -> int:
    return int(scheduler.token_to_kv_pool_allocator.page_size)


def kv_pool(scheduler):
    return scheduler.token_to_kv_pool_allocator.get_kvcache()


def token_row(scheduler, req):
    """The request's row of `req_to_token` (its KV slots), or None when it holds none."""
    pool_idx = req.kv.req_pool_idx
    return None if pool_idx is None else scheduler.req_to_token_pool.req_to_token[pool_idx]


def batch_requests(batch):
    """(index, req, sender) of each request of the batch."""
    return [(i, req, req.disagg_kv_sender) for i, req in enumerate(batch.reqs)]


def request_fields(batch, i: int, req) -> dict:
    """What the session needs of request `i` of the batch (ReqView's fields but the row)."""
    return dict(
        room=int(req.bootstrap_room), prefix_len=int(batch.prefix_lens[i]), extend_len=int(batch.extend_lens[i]),
        input_len=len(req.origin_input_ids),
        # SGLang leaves both None until decode's metadata or the first send sets them.
        decode_prefix_len=int(req.disagg_decode_prefix_len or 0), start_send_idx=int(req.start_send_idx or 0),
        pending_bootstrap=bool(req.pending_bootstrap),
    )


def bootstrap_room(req) -> Optional[int]:
    room = req.bootstrap_room
    return None if room is None else int(room)


def backend_pool(backend, default):
    """The pool this attention backend writes into: its own (children of hybrid backends hold
    one) or, since the base class has none, the scheduler's (sglang_manifest.OPTIONAL)."""
    return getattr(backend, "token_to_kv_pool", None) or default


def layer_id(layer) -> int:
    return int(layer.layer_id)


def layer_tensors(pool, layer_id: int, is_mla: bool):
    """The pool's tensors of model layer `layer_id` (MLA: the latent buffer; MHA: K then V), or
    None when the pool is not of that kind or does not hold the layer."""
    names = ("kv_buffer",) if is_mla else ("k_buffer", "v_buffer")
    # Another pool kind (quantized, hybrid) has other names: the layer is unmapped.
    buffers = [getattr(pool, name, None) for name in names]
    if any(b is None for b in buffers):
        return None
    # KVCache sets start_layer (0 unless PP); a pool object that is not a KVCache has none
    # (sglang_manifest.OPTIONAL) and counts its layers from 0.
    local = layer_id - int(getattr(pool, "start_layer", 0) or 0)
    if not all(0 <= local < len(b) for b in buffers):
        return None
    return [b[local] for b in buffers]


# --- start-up ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Deployment:
    """What layer-wise start-up checks of a prefill manager and its server arguments."""

    pp_size: int = 1
    attn_cp_size: int = 1
    staging: bool = False
    kv_shard_size: int = 1
    two_batch_overlap: bool = False
    attn_tp_size: int = 1


def deployment(mgr) -> Deployment:
    return Deployment(
        pp_size=int(mgr.pp_size or 1), attn_cp_size=int(mgr.attn_cp_size or 1),
        attn_tp_size=int(mgr.attn_tp_size or 1),
        staging=bool(getattr(mgr, "enable_staging", False)),  # see sglang_manifest.OPTIONAL
        kv_shard_size=int(mgr.kv_shard_size or 1),
        two_batch_overlap=bool(mgr.server_args.enable_two_batch_overlap),
    )


def prefill_cp(mgr, parallel=None):
    """This prefill rank's place in context parallelism and KV sharding, from a CommonKVManager
    and SGLang's `get_parallel()` (the default)."""
    from sglang_mori.backend.prefill.context_parallel import PrefillCP

    if parallel is None:
        from sglang.srt.runtime_context import get_parallel

        parallel = get_parallel()
    return PrefillCP(
        cp_size=int(mgr.attn_cp_size or 1), cp_rank=int(mgr.attn_cp_rank or 0),
        all_ranks_send=bool(mgr.enable_all_cp_ranks_for_transfer),
        tp_group_sharing=bool(parallel.enable_cp_tp_group_sharing),
        dsa_layer_split=bool(parallel.enable_dsa_cache_layer_split),
        kv_shard_size=int(mgr.kv_shard_size or 1), kv_shard_rank=int(mgr.kv_shard_rank or 0),
    )


def kv_args_view(kv_args) -> SimpleNamespace:
    """The declared KVArgs fields as a plain namespace (planning reads it). KVArgs declares its
    fields without defaults and prefill.py / decode.py fill what their role has, so an unset
    field reads None here (planning treats None as "not reported")."""
    return SimpleNamespace(**{name: getattr(kv_args, name, None) for name in MEMBERS["KVArgs"]})


def kv_on_gpu() -> bool:
    try:
        from sglang.srt.runtime_context import get_device

        return get_device().device not in ("cpu",)
    except Exception:
        return True


def ib_devices_for_gpu(ib_device: str, gpu_id: int):
    """SGLang's parser of --disaggregation-ib-device (a list, a JSON map per GPU, or a file)."""
    from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import get_ib_devices_for_gpu

    return get_ib_devices_for_gpu(ib_device, gpu_id)
