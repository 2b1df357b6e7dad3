"""MoriKVSender: SGLang's common sender; the prefill service does the transfer work."""

from __future__ import annotations

from sglang_mori.backend import room_status
from sglang_mori.backend.failure_reasons import ABORTED
from sglang_mori.backend.prefill.failures import ABORTED_ON_PREFILL
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
        # SGLang failed the room: through the failure door, so decode is told now rather than
        # at its deadline, and the failure is counted once.
        if self.conclude_state == room_status.FAILED:
            self.kv_mgr.service.fail(self.bootstrap_room, ABORTED_ON_PREFILL, ABORTED)
