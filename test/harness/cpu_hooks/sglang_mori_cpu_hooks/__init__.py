"""Test-only SGLang plugin (see ../README.md): the overlap scheduler and TP > 1 on a CPU-only host."""

from __future__ import annotations


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def around_cached_prefix_send(original, scheduler, req, *args, **kwargs):
    # The event SGLang records here only orders the early send against a GPU forward stream; on CPU the
    # previous forward already ran to completion in this thread, so the send needs no event.
    if _cuda() or not getattr(scheduler, "enable_overlap", False):
        return original(scheduler, req, *args, **kwargs)
    scheduler.enable_overlap = False
    try:
        return original(scheduler, req, *args, **kwargs)
    finally:
        scheduler.enable_overlap = True


def around_init_model_parallel_group(original, *args, **kwargs):
    # use_pynccl is the 4th positional parameter; only the default (None, decided by SGLang) is replaced.
    if not _cuda() and len(args) < 4 and kwargs.get("use_pynccl") is None:
        kwargs["use_pynccl"] = False
    return original(*args, **kwargs)


def register():
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(
        "sglang.srt.disaggregation.prefill.SchedulerDisaggregationPrefillMixin.maybe_send_cached_prefix_chunk",
        around_cached_prefix_send, HookType.AROUND)
    HookRegistry.register("sglang.srt.distributed.parallel_state.init_model_parallel_group",
                          around_init_model_parallel_group, HookType.AROUND)
