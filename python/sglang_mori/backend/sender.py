"""MoriKVSender: SGLang's common sender; the prefill service does the transfer work."""

from __future__ import annotations

from sglang_mori.backend import room_status
from sglang_mori.backend.failure_reasons import ABORTED
from sglang_mori.backend.prefill.failures import ABORTED_ON_PREFILL
from sglang_mori.backend.sglang_compat import CommonKVSender


class MoriKVSender(CommonKVSender):
    # Our sender takes device page indices directly; the host-index path needs CUDA events.
    supports_host_tensor_indices = False
    _released = False  # this sender's room life was handed back to the service (see _release)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # A new request (possibly a new life of a room id). Decode may have aborted it, or sent
        # bad metadata for it, before it reached this rank: claim() fails it at once then.
        if self.kv_mgr.service.claim(self.bootstrap_room) is not None:
            self.conclude_state = room_status.FAILED

    def clear(self) -> None:
        super().clear()
        self._release()

    def abort(self):
        super().abort()
        if self.conclude_state != room_status.FAILED:
            return  # not this sender's room to fail (SGLang's deferred bootstrap: another owns it)
        # SGLang failed the room: through the failure door, so decode is told now rather than
        # at its deadline, and the failure is counted once.
        self.kv_mgr.service.fail(self.bootstrap_room, ABORTED_ON_PREFILL, ABORTED)
        # A request aborted in the waiting queue or a running batch gets abort() and never
        # clear() (SGLang 0.5.23's abort_request): its life ends here, or the room stays open
        # for good (one per aborted request, seen after a router restart in the chaos run).
        self._release()

    def _release(self) -> None:
        """End this sender's room life once: after abort() the same sender may still be cleared,
        and by then a new request may hold the room id."""
        if self._released:
            return
        self._released = True
        self.kv_mgr.service.release(self.bootstrap_room)
