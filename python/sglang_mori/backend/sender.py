"""MoriKVSender: SGLang's common sender; the prefill service does the transfer work."""

from __future__ import annotations

from sglang_mori.backend import room_status
from sglang_mori.backend import sglang_compat as compat
from sglang_mori.backend.sglang_compat import CommonKVSender


class MoriKVSender(CommonKVSender):
    # Our sender takes device page indices directly; the host-index path needs CUDA events.
    supports_host_tensor_indices = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # A new request (possibly a new life of a room id). Decode may have aborted it, or sent
        # bad metadata for it, before it reached this rank: claim() fails it at once then.
        if self.kv_mgr.service.claim(self.bootstrap_room) is not None:
            self.conclude_state = room_status.FAILED

    def clear(self) -> None:
        super().clear()
        self.kv_mgr.service.release(self.bootstrap_room)

    def abort(self):
        super().abort()
        # Tell decode now rather than letting it wait for a deadline.
        mgr = self.kv_mgr
        mgr.send_kv_status_message(targets=compat.room_notify_targets(mgr, self.bootstrap_room),
                                   bootstrap_room=self.bootstrap_room, status=self.conclude_state,
                                   failure_reason="Aborted on prefill")
