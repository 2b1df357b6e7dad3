"""MoriKVReceiver: SGLang's common receiver, with our attempt ids and Abort message."""

from __future__ import annotations

import logging
from typing import Optional

from sglang_mori.backend import room_status
from sglang_mori.backend import sglang_compat as compat
from sglang_mori.backend.decode.effects import ABORTED_UNREACHABLE, DUPLICATE_ROOM
from sglang_mori.backend.failure_reasons import ABORTED, PROTOCOL
from sglang_mori.backend.messenger import Messenger

logger = logging.getLogger(__name__)


class MoriKVReceiver(compat.CompatKVReceiver):
    def __init__(self, mgr, bootstrap_addr: str, bootstrap_room=None, *args, **kwargs):
        duplicate = bootstrap_room is not None and bootstrap_room in mgr.request_status
        self.attempt: Optional[int] = None
        super().__init__(mgr, bootstrap_addr, bootstrap_room, *args, **kwargs)
        if not compat.owns_room(self) or bootstrap_room is None:
            return
        if duplicate:
            # A second live request with the same bootstrap_room. Every table is keyed by the
            # room, so neither request can be served safely: fail the room (the first request
            # with it), and never let this receiver touch the room's state -- its clear() would
            # pop the first request's status under it. SGLang does the same under its
            # prefill_complete allocation policy.
            compat.disown_room(self)
            mgr.service.fail(bootstrap_room, DUPLICATE_ROOM, PROTOCOL)
            self.conclude_state = room_status.FAILED
            return
        # Every receiver is a new attempt at its room (retract-rebootstrap reuses the room id).
        self.attempt = mgr.service.new_receiver(bootstrap_room)

    def abort(self):
        if compat.owns_room(self) and self.conclude_state != room_status.FAILED:
            # SGLang's scheduler gives up on a bootstrap server it could not reach (after 15
            # attempts) by aborting the request, which alone would read "Aborted by AbortReq.".
            # Record the real cause first; super().abort() keeps a Failed room's reason.
            reason = self.kv_mgr.bootstrap_unreachable_reason(self.bootstrap_addr)
            if reason is not None and getattr(self, "bootstrap_infos", None) is None:
                self.kv_mgr.service.fail(self.bootstrap_room, ABORTED_UNREACHABLE.format(reason=reason), ABORTED)
                self.conclude_state = room_status.FAILED
        super().abort()

    def notify_abort(self, *, force_arm: bool = False) -> None:
        mgr = self.kv_mgr
        if mgr.enable_deferred_decode_kv_release and (force_arm or self.init_time is not None):
            # Arm before sending: an immediate ACK must find the room waiting for it.
            compat.set_abort_generation(self, mgr.service.arm_abort(self.bootstrap_room))
        message = mgr.service.abort_message(self.bootstrap_room, compat.abort_generation(self), self.attempt)
        for info in self.bootstrap_infos or []:
            try:
                Messenger.send_on(compat.bootstrap_socket(self, info), message)
            except Exception as exc:  # best effort: a dead prefill cannot be told
                logger.debug("abort for room %s not delivered to %s: %s", self.bootstrap_room, info, exc)

    def before_clear(self) -> None:
        # Before SGLang drops the room's status: from here on a status naming this attempt is
        # stale, and one the status thread is applying finishes (under the registry lock) while
        # the status is still this receiver's, never a next receiver's of the same room id.
        if self.attempt is not None:
            self.kv_mgr.service.forget(self.bootstrap_room, self.attempt)

    def after_clear(self) -> None:
        self.kv_mgr.forget_bootstrap_failures(self.bootstrap_addr)
