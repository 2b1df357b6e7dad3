"""Target-side completion notifications (`enable_notification` / pop_inbound_transfer_status).

As in MORI, the initiator sends one notification per lane after a transfer's frames on that lane,
carrying (uid, number of lanes). Lanes are ordered streams, so when every lane's notification has
arrived, all bytes of the transfer have landed. Only successes are ever reported; entries are
keyed by (initiator engine key, uid) and, like MORI, popping does not erase them. Unlike MORI the
map is capped (oldest completed entries are dropped) so a long run cannot grow it forever.
"""

from __future__ import annotations

import collections
import threading

MAX_COMPLETED = 1_000_000


class InboundNotifications:
    def __init__(self):
        self._lock = threading.Lock()
        self._pending: dict = {}
        self._completed: collections.OrderedDict = collections.OrderedDict()

    def arrive(self, initiator_key: str, uid: int, total: int) -> None:
        key = (initiator_key, uid)
        with self._lock:
            if key in self._completed:
                # A uid reused by the same initiator incarnation starts a new count (mori's
                # FIXME about index wrap-around); count it again from scratch.
                del self._completed[key]
            left = self._pending.get(key, total) - 1
            if left > 0:
                self._pending[key] = left
                return
            self._pending.pop(key, None)
            self._completed[key] = True
            if len(self._completed) > MAX_COMPLETED:
                self._completed.popitem(last=False)

    def completed(self, initiator_key: str, uid: int) -> bool:
        with self._lock:
            return (initiator_key, uid) in self._completed
