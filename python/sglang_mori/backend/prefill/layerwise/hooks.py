"""The HookRegistry hooks of layer-wise streaming (registered by plugin.py when
SGLANG_MORI_LAYERWISE is on or auto; no other patching).

- AROUND `Scheduler.run_batch`: on a prefill rank whose manager has a layer-wise session and for
  an extend batch, wait out checkpoint hazards, publish the batch (session.begin_batch), run it
  with the publication visible to the attention hook, then mark its end (session.end_batch).
- AROUND `AttentionBackend.forward` (hybrid and TBO backends delegate to their children, which
  reach this one): after an extend layer returns, its KV is in the pool. On CPU the forward is
  synchronous, so the return is the point; on a GPU a device event recorded on the current
  stream marks it and the worker waits on it before posting.
- AROUND `checkpoint_disagg_prefill`: after SGLang's radix checkpoint, detect a streamed page
  that moved (dedup frees the old one) while a write from it may still run (session.py).

Everything SGLang-specific about reading a batch or a request is here; the session sees plain views.
"""

from __future__ import annotations

import logging
import threading

logger = logging.getLogger(__name__)

RUN_BATCH_TARGET = "sglang.srt.managers.scheduler.Scheduler.run_batch"
ATTENTION_TARGET = "sglang.srt.layers.attention.base_attn_backend.AttentionBackend.forward"
CHECKPOINT_TARGET = "sglang.srt.disaggregation.prefill.SchedulerDisaggregationPrefillMixin.checkpoint_disagg_prefill"

_current = threading.local()  # .published = (session, LayerBatch) while a published batch runs


def session_of(scheduler):
    queue = getattr(scheduler, "disagg_prefill_bootstrap_queue", None)
    mgr = getattr(queue, "kv_manager", None)
    return getattr(mgr, "layerwise", None)


def _is_extend(batch) -> bool:
    mode = getattr(batch, "forward_mode", None)
    return mode is not None and mode.is_extend()


def batch_view(scheduler, batch):
    from sglang_mori.backend.prefill.layerwise.session import BatchView, ReqView
    from sglang_mori.backend.sender import MoriKVSender

    fallback = None
    spec = getattr(batch, "spec_algorithm", None)
    if spec is not None and not spec.is_none():
        fallback = "speculative"
    elif getattr(batch, "tbo_split_seq_index", None) is not None:
        fallback = "two_batch_overlap"
    page_size = int(scheduler.token_to_kv_pool_allocator.page_size)
    req_to_token = scheduler.req_to_token_pool.req_to_token
    reqs = []
    if fallback is None:
        for i, req in enumerate(batch.reqs):
            if not isinstance(getattr(req, "disagg_kv_sender", None), MoriKVSender):
                continue
            pool_idx = req.kv.req_pool_idx
            if pool_idx is None:
                continue
            reqs.append(ReqView(
                room=int(req.bootstrap_room), prefix_len=int(batch.prefix_lens[i]),
                extend_len=int(batch.extend_lens[i]), input_len=len(req.origin_input_ids),
                decode_prefix_len=int(req.disagg_decode_prefix_len or 0),
                start_send_idx=int(req.start_send_idx or 0), row=req_to_token[pool_idx],
                pending_bootstrap=bool(getattr(req, "pending_bootstrap", False)),
            ))
    return BatchView(reqs, page_size, fallback)


def around_run_batch(original, scheduler, batch, *args, **kwargs):
    session = session_of(scheduler)
    if session is None or batch is None or not _is_extend(batch):
        return original(scheduler, batch, *args, **kwargs)
    published = None
    try:
        session.wait_hazards()
        published = session.begin_batch(batch_view(scheduler, batch))
    except Exception:
        logger.exception("sglang-mori: layer-wise publication failed; the batch goes chunk-wise")
    if published is None:
        return original(scheduler, batch, *args, **kwargs)
    published.pool = scheduler.token_to_kv_pool_allocator.get_kvcache()
    _current.published = (session, published)
    try:
        return original(scheduler, batch, *args, **kwargs)
    finally:
        _current.published = None
        session.end_batch(published)


def _layer_event(tensor):
    """A device event after this layer's KV writes (GPU), or None (CPU: the forward is synchronous)."""
    if not getattr(tensor, "is_cuda", False):
        return None
    import torch

    event = torch.cuda.Event()
    event.record()
    return event


def around_attention_forward(original, backend, q, k, v, layer, forward_batch, *args, **kwargs):
    out = original(backend, q, k, v, layer, forward_batch, *args, **kwargs)
    current = getattr(_current, "published", None)
    if current is not None and not current[1].stopped:
        session, published = current
        try:
            if forward_batch.forward_mode.is_extend():
                # The pool this backend wrote the layer into (children of hybrid backends hold theirs).
                pool = getattr(backend, "token_to_kv_pool", None) or published.pool
                session.on_layer(published, pool, int(layer.layer_id), _layer_event(q))
        except Exception:
            logger.exception("sglang-mori: layer-wise hook failed; the batch's remaining layers go chunk-wise")
            session.stop_batch(published, "other")
    return out


def around_checkpoint(original, scheduler, req, *args, **kwargs):
    out = original(scheduler, req, *args, **kwargs)
    session = session_of(scheduler)
    if session is not None:
        try:
            pool_idx = req.kv.req_pool_idx
            if pool_idx is not None and getattr(req, "bootstrap_room", None) is not None:
                session.after_checkpoint(int(req.bootstrap_room), scheduler.req_to_token_pool.req_to_token[pool_idx],
                                         int(scheduler.token_to_kv_pool_allocator.page_size))
        except Exception:
            logger.exception("sglang-mori: layer-wise checkpoint guard failed")
    return out


HOOKS = (
    (RUN_BATCH_TARGET, "around_run_batch"),
    (ATTENTION_TARGET, "around_attention_forward"),
    (CHECKPOINT_TARGET, "around_checkpoint"),
)
