"""Test-only SGLang plugin (see ../README.md): prefill forward times and decode's write log, and
optionally a pause before each attention layer of a prefill forward."""

from __future__ import annotations

import json
import os
import threading
import time

PROBE_DIR_ENV = "SGLANG_MORI_PROBE_DIR"
# Milliseconds to sleep before each attention layer of a prefill server's extend forward: a tiny
# CPU model's forward is shorter than decode's bootstrap round trip; this stretches it so that
# destinations arrive while it runs (test_pd_optimistic.py).
LAYER_DELAY_ENV = "SGLANG_MORI_PROBE_LAYER_DELAY_MS"
_in_prefill_forward = threading.local()


def _dir():
    return os.environ.get(PROBE_DIR_ENV) or None


def _layer_delay_s() -> float:
    return float(os.environ.get(LAYER_DELAY_ENV) or 0) / 1000.0


def around_run_batch(original, scheduler, batch, *args, **kwargs):
    mode = getattr(batch, "forward_mode", None)
    if mode is None or not mode.is_extend() or getattr(scheduler, "disaggregation_mode", None) is None \
            or scheduler.disaggregation_mode.value != "prefill":
        return original(scheduler, batch, *args, **kwargs)
    t0 = time.monotonic()
    _in_prefill_forward.on = True
    try:
        out = original(scheduler, batch, *args, **kwargs)
    finally:
        _in_prefill_forward.on = False
    t1 = time.monotonic()
    if not _dir():
        return out
    reqs = [{"input_len": len(r.origin_input_ids), "prefix_len": int(batch.prefix_lens[i]),
             "extend_len": int(batch.extend_lens[i])} for i, r in enumerate(batch.reqs)]
    with open(os.path.join(_dir(), "prefill_batches.jsonl"), "a") as f:
        f.write(json.dumps({"t0": t0, "t1": t1, "reqs": reqs}) + "\n")
    return out


def around_attention_forward(original, backend, *args, **kwargs):
    if getattr(_in_prefill_forward, "on", False):
        time.sleep(_layer_delay_s())
    return original(backend, *args, **kwargs)


def after_manager_init(result, mgr, *args, **kwargs):
    if getattr(mgr, "role", None) != "decode" or not _dir():
        return result
    from sglang_mori.softio.write_log import get_write_log

    path = os.path.join(_dir(), f"decode_writes_{os.getpid()}.json")

    def dump():
        while True:
            time.sleep(0.1)
            taken = time.monotonic()  # every write that landed before this is in the snapshot
            try:
                records = [list(r) for r in get_write_log(mgr.engine.engine)]
            except Exception:
                return
            tmp = path + ".tmp"
            with open(tmp, "w") as f:
                json.dump({"taken": taken, "records": records}, f)
            os.replace(tmp, path)

    threading.Thread(target=dump, name="probe-write-log", daemon=True).start()
    return result


def register():
    if not _dir() and not _layer_delay_s():
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register("sglang.srt.managers.scheduler.Scheduler.run_batch", around_run_batch, HookType.AROUND)
    HookRegistry.register("sglang_mori.backend.manager.MoriKVManager.__init__", after_manager_init, HookType.AFTER)
    if _layer_delay_s():
        HookRegistry.register("sglang.srt.layers.attention.base_attn_backend.AttentionBackend.forward",
                              around_attention_forward, HookType.AROUND)
