"""MoriKVReceiver: SGLang's common receiver, with our Abort message."""

from __future__ import annotations

import logging

from sglang.srt.disaggregation.common.conn import CommonKVReceiver

logger = logging.getLogger(__name__)


class MoriKVReceiver(CommonKVReceiver):
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
