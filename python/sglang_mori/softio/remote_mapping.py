"""A device session's hold on a peer's allocation mapped into this process (CUDA IPC).

The mapping must live exactly as long as someone may still copy through it: unmapping while a
copy into it is queued on a stream is a use-after-free (the address may already belong to another
mapping), and never unmapping keeps the peer's whole pool allocated on its GPU after the peer died
(CUDA frees an exported allocation only when every process that mapped it has unmapped it).

So each copy batch takes the mapping (`begin`) before it is enqueued and gives it back (`end`)
once its event fired. `release` (the peer was deregistered, a region of the pair was
deregistered, the engine shuts down) refuses every later `begin` and unmaps when the last copy
in flight has ended: at once when none is, else from the completion thread that saw its event.
"""

from __future__ import annotations

import logging
import threading

logger = logging.getLogger("sglang_mori.softio")


class RemoteMapping:
    __slots__ = ("runtime", "handle", "device", "what", "_lock", "_copies", "_released", "_closed")

    def __init__(self, runtime, handle: bytes, device: int, what: str):
        self.runtime = runtime
        self.handle = handle
        self.device = device  # the device that opened it (the runtime's key for the hold)
        self.what = what  # "memory 3 of engine X", for messages
        self._lock = threading.Lock()
        self._copies = 0  # batches enqueued through this hold whose event has not fired
        self._released = False
        self._closed = False

    def begin(self) -> bool:
        """A batch is about to enqueue copies through the mapping; False once it is released."""
        with self._lock:
            if self._released:
                return False
            self._copies += 1
            return True

    def end(self) -> None:
        """That batch's copies are done (its event fired), or were never enqueued."""
        with self._lock:
            self._copies -= 1
            close = self._released and self._copies == 0 and not self._closed
            self._closed |= close
        if close:
            self._unmap()

    def release(self) -> None:
        """No new copy; unmap once the copies in flight are done. Idempotent."""
        with self._lock:
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
