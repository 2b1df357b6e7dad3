"""MoriKVSender: SGLang's common sender; our manager does the transfer work."""

from __future__ import annotations

from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common.conn import CommonKVSender


class MoriKVSender(CommonKVSender):
    # Our sender takes device page indices directly; the host-index path needs CUDA events.
    supports_host_tensor_indices = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        service = getattr(self.kv_mgr, "service", None)
        # A new request (possibly reusing a finished room's id). Decode may have aborted it before
        # it reached this rank: fail now rather than wait for metadata until the bootstrap timeout.
        if service is not None and service.note_sender_started(self.bootstrap_room):
            self.kv_mgr.record_failure(self.bootstrap_room, "Aborted by decode before the request reached prefill")
            self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Failed)

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
