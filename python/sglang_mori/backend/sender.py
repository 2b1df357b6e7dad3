"""MoriKVSender: SGLang's common sender; our manager does the transfer work."""

from __future__ import annotations

from sglang.srt.disaggregation.common.conn import CommonKVSender


class MoriKVSender(CommonKVSender):
    # Our sender takes device page indices directly; the host-index path needs CUDA events.
    supports_host_tensor_indices = False

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
