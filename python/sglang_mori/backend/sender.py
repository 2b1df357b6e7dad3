"""MoriKVSender: SGLang's common sender; our manager does the transfer work."""

from __future__ import annotations

from sglang.srt.disaggregation.common.conn import CommonKVSender


class MoriKVSender(CommonKVSender):
    # Our sender takes device page indices directly; the host-index path needs CUDA events.
    supports_host_tensor_indices = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        service = getattr(self.kv_mgr, "service", None)
        if service is not None:  # a new request (possibly reusing a finished room's id)
            service.note_sender_started(self.bootstrap_room)

    def clear(self) -> None:
        super().clear()
        service = getattr(self.kv_mgr, "service", None)
        if service is not None:  # later metadata for this room is a replay
            service.note_sender_finished(self.bootstrap_room)

    def abort(self):
        super().abort()
        # Tell decode now rather than letting it wait for a deadline.
        mgr = self.kv_mgr
        targets = mgr._room_notify_targets(self.bootstrap_room)
        mgr.send_kv_status_message(
            targets=targets,
            bootstrap_room=self.bootstrap_room,
            status=self.conclude_state,
            failure_reason="Aborted on prefill",
        )
