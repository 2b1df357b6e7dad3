"""Forcing one interleaving of two threads without sleeping: a registry lock wrapper that runs an
action right after a given thread lets the lock go, so whatever that thread read under the lock
is stale by the time it acts on it."""

from __future__ import annotations

import threading


class AfterRelease:
    """Stands in for a registry's lock (a Lock or an RLock). `action` runs once, on the thread
    that built the wrapper, right after that thread next lets the lock go entirely."""

    def __init__(self, lock, action):
        self.lock, self.action, self.owner, self.depth = lock, action, threading.get_ident(), 0

    def acquire(self, *args, **kwargs):
        got = self.lock.acquire(*args, **kwargs)
        if got and threading.get_ident() == self.owner:
            self.depth += 1
        return got

    def release(self):
        self.lock.release()
        if threading.get_ident() == self.owner:
            self.depth -= 1
            if self.depth == 0 and self.action is not None:
                action, self.action = self.action, None
                action()

    def locked(self):
        return self.lock.locked()

    __enter__ = acquire

    def __exit__(self, *exc):
        self.release()
