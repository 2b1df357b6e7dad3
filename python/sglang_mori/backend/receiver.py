"""MoriKVReceiver: SGLang's common receiver, with our Abort message."""

from __future__ import annotations

import logging

from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common.conn import CommonKVReceiver

logger = logging.getLogger(__name__)


class MoriKVReceiver(CommonKVReceiver):
    def __init__(self, mgr, bootstrap_addr: str, bootstrap_room=None, *args, **kwargs):
        duplicate = bootstrap_room is not None and bootstrap_room in mgr.request_status
        super().__init__(mgr, bootstrap_addr, bootstrap_room, *args, **kwargs)
        if duplicate and self._owns_bootstrap_room:
            # A second live request with the same bootstrap_room. Every table is keyed by the
            # room, so neither request can be served safely: fail the room (the first request
            # with it), and never let this receiver touch the room's state -- its clear() would
            # pop the first request's status under it (a KeyError in the first one's poll()).
            # SGLang does the same under its prefill_complete allocation policy.
            self._owns_bootstrap_room = False
            mgr.record_failure(bootstrap_room, "Duplicate decode bootstrap room: another live request uses this id")
            mgr.update_status(bootstrap_room, KVPoll.Failed)
            self.conclude_state = KVPoll.Failed

    def abort(self):
        if self._owns_bootstrap_room and self.conclude_state != KVPoll.Failed:
            # Aborted before init: SGLang's scheduler gives up on a bootstrap server it could not
            # reach (after 15 attempts) by aborting the request, which alone would read "Aborted by
            # AbortReq.". Record the real cause first; super().abort() keeps a Failed room's reason.
            reason = self.kv_mgr.bootstrap_unreachable_reason(self.bootstrap_addr)
            if reason is not None and getattr(self, "bootstrap_infos", None) is None:
                self.kv_mgr.record_failure(self.bootstrap_room, f"Aborted: {reason}")
                self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Failed)
                self.conclude_state = KVPoll.Failed
        super().abort()

    def _send_abort_notification(self, *, force_arm: bool = False):
        mgr = self.kv_mgr
        if mgr.enable_deferred_decode_kv_release and (force_arm or self.init_time is not None):
            # Arm before sending: an immediate ACK must find the room waiting for it.
            self._abort_generation = mgr.register_deferred_abort_room(self.bootstrap_room)
        message = mgr.service.abort_message(self.bootstrap_room, self._abort_generation)
        for info in self.bootstrap_infos or []:
            try:
                sock, lock = self._connect_to_bootstrap_server(info)
                with lock:
                    sock.send_multipart(message)
            except Exception as exc:  # best effort: a dead prefill cannot be told
                logger.debug("abort for room %s not delivered to %s: %s", self.bootstrap_room, info, exc)

    def _clear(self) -> None:
        super()._clear()
        self.kv_mgr.service.forget(self.bootstrap_room)
        self.kv_mgr.forget_bootstrap_failures(self.bootstrap_addr)
