"""One PULL socket read by two threads, never at once: our thread, and SGLang's scheduler when it polls.

A message that changes what SGLang's scheduler polls for (decode's destinations on prefill, the
Success or Failed status on decode) used to wait for our reading thread to wake and take the GIL
back from the scheduler, which runs Python between short releases; on the H200 that was 0.4-1.4 ms
per message (docs/benchmarks.md, "Where PD's 8K TTFT goes"). Now the scheduler, which holds the GIL
anyway, also reads the socket when it polls a room still waiting for such a message
(`drain_nowait`), and the reading thread stays as the reader of last resort (no room polled, a
message for a room nobody polls yet, Register, Abort, housekeeping). While a poller is active the
thread leaves every arrival to it and only looks every POLLER_ACTIVE_S, so it never wakes on an
arrival to compete with the scheduler for the GIL; a poller starting after a quiet spell wakes the
thread out of its wait on the socket through a pipe (once, before the awaited message arrives).

ZMQ sockets are not thread-safe, but may be used from several threads one at a time, with a full
memory barrier between them; `lock` is that barrier. It covers each receive *and* the handling of
what was received, so messages are handled in the order they arrived (a Register before the
metadata that needs it). The reading thread never blocks inside the socket while holding the lock:
it waits on the socket's file descriptor (`zmq.FD`, readable when the socket has commands, e.g. a
message arriving on an empty pipe), then takes the lock and empties the socket. Every holder
empties the socket before it lets the lock go (until `zmq.EVENTS` shows no POLLIN), so a message
that arrives afterwards makes the descriptor readable again and the wait never misses one.
"""

from __future__ import annotations

import logging
import os
import select
import threading
import time
from typing import Callable

import zmq

logger = logging.getLogger(__name__)

# A scheduler pass polls every queued room in a row; one look at the socket serves the whole pass.
POLLER_MIN_GAP_S = 20e-6
# While a poller looked at the socket this recently, it is polling a room that waits for a message and
# reads every arrival itself: the reading thread does not wait on the socket then (waking on an
# arrival would only make it take the GIL from that same scheduler), it looks again this much later.
POLLER_ACTIVE_S = 0.005


class Inbox:
    def __init__(self, sock, handle: Callable[[list, bool], None], name: str):
        self.sock = sock
        # handle(frames, polled): one message; `polled` when on a poller's (SGLang's) thread, which
        # must not block on a send. Must not raise (logged if it does).
        self.handle = handle
        self.name = name
        self.lock = threading.Lock()
        self.closed = False
        self._last_poll = 0.0
        # The reading thread's wake-up pipe (made by that thread, closed by it on the way out): a
        # poller that starts after a quiet spell writes to it, so the thread leaves its wait on the
        # socket and the coming arrivals to the poller.
        self._wake_r = self._wake_w = None
        # Messages handled by a poller (the scheduler's thread) and by the reading thread: the
        # tests and the benchmark read them to see which path a message took.
        self.by_poller = 0
        self.by_thread = 0

    # --- the scheduler's side ------------------------------------------------------------------
    def drain_nowait(self) -> int:
        """Handle what has arrived, on the calling thread, without waiting for anything: not for
        the lock (the reading thread holding it is handling messages right now) and not for the
        socket. At most one look per POLLER_MIN_GAP_S. Returns the number of messages handled."""
        now = time.perf_counter()
        since = now - self._last_poll
        if since < POLLER_MIN_GAP_S:
            return 0
        self._last_poll = now
        if not self.lock.acquire(blocking=False):
            return 0
        try:
            if self.closed:
                return 0
            if since >= POLLER_ACTIVE_S:
                self._wake_thread_locked()
            n = self._drain_locked(polled=True)
            self.by_poller += n
            return n
        finally:
            self.lock.release()

    # --- the reading thread's side ----------------------------------------------------------------
    def wait_and_drain(self, timeout_ms: int) -> int:
        """Wait up to `timeout_ms` for the socket to signal, then handle what has arrived. Returns
        the number of messages handled here (0 also when a poller took them first). While a
        poller is active it only waits: the poller reads every arrival."""
        if self._poller_active():
            # Stay off the socket and the GIL until the poller may have stopped, then look again.
            time.sleep(min(POLLER_ACTIVE_S, timeout_ms / 1000.0))
            return 0
        with self.lock:
            if self.closed:
                self._close_wake_pipe_locked()
                return 0
            if self._wake_r is None:
                self._wake_r, self._wake_w = os.pipe()
                os.set_blocking(self._wake_r, False)
                os.set_blocking(self._wake_w, False)
            # Empty first: the descriptor signals new arrivals only, not messages already queued.
            n = self._drain_locked()
            fd = self.sock.getsockopt(zmq.FD)
            wake = self._wake_r
        if n:
            self.by_thread += n
            return n
        try:
            readable, _, _ = select.select([fd, wake], [], [], timeout_ms / 1000.0)
        except (OSError, ValueError):  # the socket was closed under us (teardown)
            return 0
        with self.lock:
            if wake in readable:
                self._empty_wake_pipe_locked()
            if self.closed:
                self._close_wake_pipe_locked()
                return 0
            if self._poller_active():
                return 0  # a poller started meanwhile: this arrival, if any, is its to read
            n = self._drain_locked()
        self.by_thread += n
        return n

    def thread_done(self) -> None:
        """The reading thread is leaving: its wake-up pipe goes with it."""
        with self.lock:
            self._close_wake_pipe_locked()

    def _poller_active(self) -> bool:
        return time.perf_counter() - self._last_poll < POLLER_ACTIVE_S

    def close(self) -> None:
        """No more reads from either side (the manager closes the socket after this)."""
        with self.lock:
            self.closed = True
            self._wake_thread_locked()  # out of its wait now, not at its timeout

    def _wake_thread_locked(self) -> None:
        if self._wake_w is not None:
            try:
                os.write(self._wake_w, b"w")
            except BlockingIOError:  # full: the thread has wake-ups pending already
                pass

    def _empty_wake_pipe_locked(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def _close_wake_pipe_locked(self) -> None:
        if self._wake_r is not None:
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._wake_r = self._wake_w = None

    # --- both ------------------------------------------------------------------------------------
    def _drain_locked(self, polled: bool = False) -> int:
        sock = self.sock
        n = 0
        while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            frames = sock.recv_multipart(zmq.NOBLOCK)  # a multipart message arrives whole
            n += 1
            try:
                self.handle(frames, polled)
            except Exception:  # a bug in one handler must not stop the reader
                logger.exception("sglang-mori: handling a message on the %s failed", self.name)
        return n
