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
- AROUND `optimistic_release_and_requeue`: before SGLang releases an optimistic request's pages
  and requeues it, a pass of it still waiting for its destinations stops waiting, and a write
  that may still read those pages blocks the next forward until it is terminal (late.py).

SGLang's scheduler, batch and request are read through backend/sglang_fields.py (its members are
declared in sglang_manifest.py); the session sees plain views.
"""

from __future__ import annotations

import logging
import threading

from sglang_mori.backend import sglang_fields as fields
from sglang_mori.backend.sglang_manifest import ATTENTION_TARGET, CHECKPOINT_TARGET, REQUEUE_TARGET, RUN_BATCH_TARGET

logger = logging.getLogger(__name__)

_current = threading.local()  # .published = (session, LayerBatch) while a published batch runs


def session_of(scheduler):
    return fields.layerwise_session(scheduler)


def batch_view(scheduler, batch):
    from sglang_mori.backend.prefill.layerwise.session import BatchView, ReqView
    from sglang_mori.backend.sender import MoriKVSender

    fallback = fields.batch_fallback(batch)
    reqs = []
    if fallback is None:
        for i, req, sender in fields.batch_requests(batch):
            if not isinstance(sender, MoriKVSender):
                continue
            row = fields.token_row(scheduler, req)
            if row is None:
                continue
            reqs.append(ReqView(row=row, **fields.request_fields(batch, i, req)))
    return BatchView(reqs, fields.page_size(scheduler), fallback)


def around_run_batch(original, scheduler, batch, *args, **kwargs):
    session = session_of(scheduler)
    if session is None or batch is None or not fields.is_extend(batch):
        return original(scheduler, batch, *args, **kwargs)
    published = None
    try:
        session.wait_hazards()
        published = session.begin_batch(batch_view(scheduler, batch))
    except Exception:
        logger.exception("sglang-mori: layer-wise publication failed; the batch goes chunk-wise")
    if published is None:
        return original(scheduler, batch, *args, **kwargs)
    published.pool = fields.kv_pool(scheduler)
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
            if fields.is_extend(forward_batch):
                # The pool this backend wrote the layer into (children of hybrid backends hold theirs).
                pool = fields.backend_pool(backend, published.pool)
                session.on_layer(published, pool, fields.layer_id(layer), _layer_event(q))
        except Exception:
            logger.exception("sglang-mori: layer-wise hook failed; the batch's remaining layers go chunk-wise")
            session.stop_batch(published, "other")
    return out


def around_checkpoint(original, scheduler, req, *args, **kwargs):
    out = original(scheduler, req, *args, **kwargs)
    session = session_of(scheduler)
    if session is not None:
        try:
            row, room = fields.token_row(scheduler, req), fields.bootstrap_room(req)
            if row is not None and room is not None:
                session.after_checkpoint(room, row, fields.page_size(scheduler))
        except Exception:
            logger.exception("sglang-mori: layer-wise checkpoint guard failed")
    return out


def around_requeue(original, scheduler, req, *args, **kwargs):
    session = session_of(scheduler)
    if session is not None:
        try:
            room = fields.bootstrap_room(req)
            if room is not None:
                session.requeued(room)
        except Exception:
            logger.exception("sglang-mori: layer-wise requeue guard failed")
    return original(scheduler, req, *args, **kwargs)
