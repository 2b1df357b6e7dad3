"""A device session's hold on a peer's allocation mapped into this process (CUDA IPC).

The mapping must live exactly as long as someone may still copy through it: unmapping while a
copy into it is queued on a stream is a use-after-free (the address may already belong to another
mapping), and never unmapping keeps the peer's whole pool allocated on its GPU after the peer died
(CUDA frees an exported allocation only when every process that mapped it has unmapped it).

So each copy batch takes the mapping (`begin`) before it is enqueued and gives it back (`end`)
once its event fired. `release` (the peer was deregistered, a region of the pair was
deregistered, the engine shuts down) refuses every later `begin` and unmaps when the last copy
in flight has ended: at once when none is, else from the completion thread that saw its event.

A batch of a 61-layer model's chunk goes through 61 mappings (one per KV buffer of the peer), and
it takes them before its copies start and gives them back before its statuses complete: one lock
for all mappings, taken once per batch (`begin_all`, `end_all`), where a lock per mapping cost
61 acquisitions on each side of the copy (about 80 us each way on a shared CPU host, issue 28).
"""

from __future__ import annotations

import logging
import operator
import threading

logger = logging.getLogger("sglang_mori.softio")


# Guards every mapping's counters and flags (held for a few attribute writes at a time).
_LOCK = threading.Lock()
_RELEASED = operator.attrgetter("_released")


def begin_all(mappings) -> bool:
    """`begin` of every mapping as one step: True with all of them taken, or False with none
    (one of them is released)."""
    with _LOCK:
        if any(map(_RELEASED, mappings)):  # C-level: no generator frame per mapping (issue 28)
            return False
        for m in mappings:
            m._copies += 1
    return True


def end_all(mappings) -> None:
    """`end` of every mapping (each taken once for the batch) as one step."""
    closing = []
    with _LOCK:
        for m in mappings:
            m._copies -= 1
            if m._released and m._copies == 0 and not m._closed:
                m._closed = True
                closing.append(m)
    for m in closing:
        m._unmap()


class RemoteMapping:
    __slots__ = ("runtime", "handle", "device", "what", "_copies", "_released", "_closed")

    def __init__(self, runtime, handle: bytes, device: int, what: str):
        self.runtime = runtime
        self.handle = handle
        self.device = device  # the device that opened it (the runtime's key for the hold)
        self.what = what  # "memory 3 of engine X", for messages
        self._copies = 0  # batches enqueued through this hold whose event has not fired
        self._released = False
        self._closed = False

    def begin(self) -> bool:
        """A batch is about to enqueue copies through the mapping; False once it is released."""
        with _LOCK:
            if self._released:
                return False
            self._copies += 1
            return True

    def end(self) -> None:
        """That batch's copies are done (its event fired), or were never enqueued."""
        with _LOCK:
            self._copies -= 1
            close = self._released and self._copies == 0 and not self._closed
            self._closed |= close
        if close:
            self._unmap()

    def release(self) -> None:
        """No new copy; unmap once the copies in flight are done. Idempotent."""
        with _LOCK:
            if self._released:
                return
            self._released = True
            close = self._copies == 0
            self._closed |= close
        if close:
            self._unmap()

    @property
    def closed(self) -> bool:
        return self._closed

    def _unmap(self) -> None:
        try:
            self.runtime.close(self.handle, self.device)
        except Exception as exc:  # noqa: BLE001 - teardown: log it, the caller's work is done
            logger.warning("softio: unmapping %s failed: %s", self.what, exc)
