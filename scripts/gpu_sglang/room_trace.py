"""Per-room timestamps of a PD request, from inside the real SGLang servers (GPU runs only).

An SGLang plugin (entry point `sglang.srt.plugins`, written by device_run.sh) that does nothing
unless SGLANG_MORI_ROOM_TRACE names a folder. Then every server process appends JSON lines
(`{"ev": ..., "room": ..., "t": wall-clock seconds}`) to FOLDER/trace-PID.jsonl at:

prefill  p_sender        our sender was made (the request entered SGLang's bootstrap queue)
         p_ready         decode's destinations arrived (SGLang may now schedule the prefill);
                         `reader`: scheduler (SGLang's poll read them: backend/inbox.py) or control
         p_last_chunk    SGLang handed us the request's last chunk (its forward's result was processed)
         p_submit        softio posted a batch of device copies (t, t_end of the call, bytes)
         p_copy_done     the copy event of a batch fired (the completion thread woke)
         p_last_inline   layer-wise streamed every page of the last chunk: it is tracked on the
                         scheduler's thread (service.track_last_without_writes), not by a shard
         p_success       Success decided (the status message follows); `thread` is the deciding
                         thread's name, `decider` its part: scheduler (inside SGLang's send()),
                         shard, layerwise_worker, completion (backend/prefill/success.py)
decode   d_receiver      our receiver was made (the request entered SGLang's prealloc queue)
         d_meta_sent     decode's destinations were handed to us to send
         d_status        prefill's Success was received and is being applied; `reader`: scheduler
                         (SGLang's poll read it) or status_thread
         d_poll_success  SGLang's decode scheduler first saw Success from poll()
both     req_stats       SGLang's own per-request timestamps (ReqTimeStats, made wall-clock) when it
                         logs them (--enable-request-time-stats-logging)
         fwd             per-layer GPU timing of a forward and our begin_batch's CPU, only with
                         SGLANG_MORI_FORWARD_TRACE=1 (forward_trace.py)
         process         once per process, at plugin load: the sglang_mori package it imported
                         (`sglang_mori`: its folder), so a baseline config (pd_latency.py *_cand)
                         shows it ran the candidate's code

Measurement only: the hooks time and forward, they change no argument or result.
ttft_breakdown.py joins these with the client's timestamps.
"""

from __future__ import annotations

import json
import os
import threading
import time

ENV = "SGLANG_MORI_ROOM_TRACE"
_lock = threading.Lock()
_file = None
_seen_success: set = set()


def emit(ev: str, room=None, **fields) -> None:
    global _file
    record = {"ev": ev, "t": time.time(), "room": room, **fields}
    with _lock:
        if _file is None:
            _file = open(os.path.join(os.environ[ENV], f"trace-{os.getpid()}.jsonl"), "a", buffering=1)
        _file.write(json.dumps(record) + "\n")


def _after_sender_init(result, self, *args, **kwargs):
    emit("p_sender", self.bootstrap_room)


def _before_publish(self, room, *args, **kwargs):
    emit("p_ready", room, reader=decider_of(threading.current_thread().name))


def _before_add_transfer(self, room_id, kv_indices, index_slice, is_last, **kw):
    if is_last:
        emit("p_last_chunk", room_id, tokens=len(kv_indices))


def _around_submit(original, self, dsts, srcs, sizes, statuses, *args, **kwargs):
    t = time.time()
    out = original(self, dsts, srcs, sizes, statuses, *args, **kwargs)
    emit("p_submit", None, t_end=time.time(), bytes=int(sizes.sum()), t_start=t)
    return out


def _around_synchronize(original, self, event):
    out = original(self, event)
    emit("p_copy_done", None)
    return out


def decider_of(thread_name: str) -> str:
    """The part of ours a thread is, by the names service.py and layerwise/worker.py give them;
    any other thread calling into us is SGLang's scheduler (its send())."""
    for prefix, part in (("mori-shard-", "shard"), ("mori-layerwise", "layerwise_worker"),
                         ("mori-completion", "completion"), ("mori-control", "control"),
                         ("mori-decode-status", "status_thread")):
        if thread_name.startswith(prefix):
            return part
    return "scheduler"


def _after_succeed(result, self, r, *args, **kwargs):
    if not result:  # another thread concluded the room, or it was not ready after all
        return
    name = threading.current_thread().name
    emit("p_success", r.room, thread=name, decider=decider_of(name))


def _before_track_last_inline(self, chunk, *args, **kwargs):
    emit("p_last_inline", chunk.room)


def _after_receiver_init(result, self, *args, **kwargs):
    emit("d_receiver", getattr(self, "bootstrap_room", None))


def _before_record_destination(self, *args, **kwargs):
    emit("d_meta_sent", kwargs.get("bootstrap_room"))


def _before_on_status(self, msg):
    emit("d_status", msg.room, status=msg.status, reader=decider_of(threading.current_thread().name))


def _after_poll(result, self, *args, **kwargs):
    if int(result) == 4 and self.bootstrap_room not in _seen_success:  # KVPoll.Success
        _seen_success.add(self.bootstrap_room)
        emit("d_poll_success", self.bootstrap_room)


def _before_log_time_stats(self, *args, **kwargs):
    from sglang.srt.observability.req_time_stats import convert_time_to_realtime

    stats = {k: convert_time_to_realtime(v) for k, v in vars(self.time_stats).items()
             if k.endswith("_time") and isinstance(v, float) and v > 0}
    emit("req_stats", self.bootstrap_room, rid=self.rid, input_len=len(self.origin_input_ids),
         output_len=len(self.output_ids), mode=self.time_stats.disagg_mode_str(), stats=stats)


HOOKS = [
    ("sglang_mori.backend.sender.MoriKVSender.__init__", _after_sender_init, "AFTER"),
    ("sglang_mori.backend.sglang_adapter.SGLangAdapter.publish_destinations", _before_publish, "BEFORE"),
    ("sglang_mori.backend.manager.MoriKVManager.add_transfer_request", _before_add_transfer, "BEFORE"),
    ("sglang_mori.softio.device_path.DeviceEngine.submit", _around_submit, "AROUND"),
    ("sglang_mori.softio.cuda_runtime.CudaRuntime.synchronize", _around_synchronize, "AROUND"),
    ("sglang_mori.backend.prefill.service.PrefillService.track_last_without_writes", _before_track_last_inline,
     "BEFORE"),
    ("sglang_mori.backend.prefill.rooms.PrefillRoomRegistry.succeed", _after_succeed, "AFTER"),
    ("sglang_mori.backend.receiver.MoriKVReceiver.__init__", _after_receiver_init, "AFTER"),
    ("sglang_mori.backend.decode.service.DecodeService.record_destination", _before_record_destination, "BEFORE"),
    ("sglang_mori.backend.decode.service.DecodeService.on_status", _before_on_status, "BEFORE"),
    ("sglang_mori.backend.receiver.MoriKVReceiver.poll", _after_poll, "AFTER"),
    ("sglang.srt.managers.schedule_batch.Req.log_time_stats", _before_log_time_stats, "BEFORE"),
]


def _quiet(hook, kind):
    """A hook that raises must never change the server's behaviour: BEFORE/AFTER return None."""
    if kind == "AROUND":
        return hook

    def safe(*args, **kwargs):
        try:
            hook(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - measurement only
            emit("trace_error", None, hook=hook.__name__, error=repr(exc))
        return None
    safe.__name__ = hook.__name__
    return safe


def register() -> None:
    if not os.environ.get(ENV):
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    import sglang_mori
    emit("process", None, pid=os.getpid(), sglang_mori=os.path.dirname(sglang_mori.__file__))
    for target, hook, kind in HOOKS:
        HookRegistry.register(target, _quiet(hook, kind), getattr(HookType, kind))
    if os.environ.get("SGLANG_MORI_FORWARD_TRACE") == "1":  # per-layer GPU timing (forward_trace.py)
        import forward_trace

        for target, hook in forward_trace.HOOKS:
            HookRegistry.register(target, hook, HookType.AROUND)
