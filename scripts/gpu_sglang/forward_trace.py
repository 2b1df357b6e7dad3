"""Where a prefill forward's time goes, layer by layer, on the GPU (GPU runs only; issue 27).

room_trace.py registers these hooks when SGLANG_MORI_FORWARD_TRACE=1 as well as
SGLANG_MORI_ROOM_TRACE is set (every configuration of a run alike, standalone included, so the
same marks exist on both sides of a comparison). Per extend batch of at least MIN_TOKENS tokens it
emits one `fwd` line once the batch's GPU work is done (read at the next run_batch, never waited for):

  t_enter, t_exit   wall clock when Scheduler.run_batch was entered / returned (launch done)
  gpu_attn_ms       per attention layer, GPU time from a timing event recorded at run_batch's entry
                    (on the scheduler's stream; the GPU is idle there at concurrency 1) to one
                    recorded on the forward's stream after the layer's attention returned
  cpu_attn_ms       per attention layer, wall-clock ms from t_enter to the hook (how far ahead the CPU is)
  gpu_end_ms        GPU time to an event recorded on the forward stream after run_batch returned
                    (the forward, sampling and the result's copy to the host)
  tokens            the batch's extend tokens
  on_layer_ms       layer-wise only: LayerwiseSession.on_layer's CPU, summed over the forward
  begin_t0, begin_t1  layer-wise only: wall clock around LayerwiseSession.begin_batch (our CPU in
                    the launch path before the first kernel; it may run just before t_enter)

Every line is written after a later forward was launched (the CPU is then far ahead of the GPU),
never between a forward's start and its launch.

Measurement only: an event record per layer (no synchronisation, no argument or result changed);
nothing is recorded while a stream captures a CUDA graph.
"""

from __future__ import annotations

import threading
import time

ENV = "SGLANG_MORI_FORWARD_TRACE"
MIN_TOKENS = 1024

_state = threading.local()  # .active: the batch being traced on this (scheduler) thread
_pending: list = []  # traced batches whose GPU work may still run


def _emit(ev, **fields):
    from room_trace import emit

    emit(ev, None, **fields)


def _cuda():
    try:
        import torch
    except ImportError:  # pragma: no cover - the GPU host always has torch
        return None
    if not torch.cuda.is_available() or torch.cuda.is_current_stream_capturing():
        return None
    return torch


def _timing_event(torch, stream=None):
    event = torch.cuda.Event(enable_timing=True)
    event.record(stream) if stream is not None else event.record()
    return event


def flush_done() -> None:
    """Emit every traced batch whose last event fired; keep the others for a later call."""
    keep = []
    for rec in _pending:
        end = rec["end"]
        if end is None or not end.query():
            keep.append(rec)
            continue
        base = rec["base"]
        _emit("fwd", t_enter=rec["t_enter"], t_exit=rec["t_exit"], tokens=rec["tokens"],
              gpu_attn_ms=[round(base.elapsed_time(e), 3) for e in rec["attn"]],
              cpu_attn_ms=[round((t - rec["t_enter"]) * 1e3, 3) for t in rec["attn_t"]],
              gpu_end_ms=round(base.elapsed_time(end), 3), on_layer_ms=round(rec["on_layer_s"] * 1e3, 3),
              **({"begin_t0": rec["begin_t0"], "begin_t1": rec["begin_t1"]} if "begin_t0" in rec else {}))
    _pending[:] = keep[-8:]  # bounded: a batch whose event never fires is dropped, not kept forever


def around_run_batch(original, scheduler, batch, *args, **kwargs):
    tokens = int(getattr(batch, "extend_num_tokens", 0) or 0) if batch is not None else 0
    torch = _cuda() if tokens >= MIN_TOKENS else None
    if torch is None:
        return original(scheduler, batch, *args, **kwargs)
    try:
        rec = {"t_enter": time.time(), "base": _timing_event(torch), "attn": [], "attn_t": [], "end": None,
               "tokens": tokens, "on_layer_s": 0.0, "t_exit": None}
    except Exception as exc:  # noqa: BLE001 - measurement only: the forward runs untraced
        _emit("trace_error", hook="forward_trace", error=repr(exc))
        return original(scheduler, batch, *args, **kwargs)
    _state.active = rec
    try:
        return original(scheduler, batch, *args, **kwargs)
    finally:
        _state.active = None
        rec["t_exit"] = time.time()
        try:
            rec["end"] = _timing_event(torch, getattr(scheduler, "forward_stream", None))
            begin = getattr(_state, "begin", None)
            if begin is not None and begin[0] >= rec["t_enter"] - 0.05:
                rec["begin_t0"], rec["begin_t1"] = begin
            _state.begin = None
            _pending.append(rec)
            flush_done()  # the earlier forwards: done by now at concurrency 1
        except Exception as exc:  # noqa: BLE001
            _emit("trace_error", hook="forward_trace", error=repr(exc))


def around_attention(original, *args, **kwargs):
    out = original(*args, **kwargs)
    rec = getattr(_state, "active", None)
    if rec is not None:
        torch = _cuda()
        if torch is not None:
            try:
                rec["attn"].append(_timing_event(torch))
                rec["attn_t"].append(time.time())
            except Exception as exc:  # noqa: BLE001
                _emit("trace_error", hook="forward_trace", error=repr(exc))
    return out


def around_on_layer(original, *args, **kwargs):
    t = time.perf_counter()
    try:
        return original(*args, **kwargs)
    finally:
        rec = getattr(_state, "active", None)
        if rec is not None:
            rec["on_layer_s"] += time.perf_counter() - t


def around_begin_batch(original, *args, **kwargs):
    t = time.time()
    try:
        return original(*args, **kwargs)
    finally:
        _state.begin = (t, time.time())  # joined to the forward's line by around_run_batch


HOOKS = [
    ("sglang.srt.managers.scheduler.Scheduler.run_batch", around_run_batch),
    ("sglang.srt.layers.attention.base_attn_backend.AttentionBackend.forward", around_attention),
    ("sglang_mori.backend.prefill.layerwise.session.LayerwiseSession.on_layer", around_on_layer),
    ("sglang_mori.backend.prefill.layerwise.session.LayerwiseSession.begin_batch", around_begin_batch),
]
