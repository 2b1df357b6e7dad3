"""One PULL socket read by two threads, never at once: our thread, and SGLang's scheduler when it polls.

A message that changes what SGLang's scheduler polls for (decode's destinations on prefill, the
Success or Failed status on decode) used to wait for our reading thread to wake and take the GIL
back from the scheduler, which runs Python between short releases; on the H200 that was 0.4-1.4 ms
per message (docs/benchmarks.md, "Where PD's 8K TTFT goes"). Now the scheduler, which holds the GIL
anyway, also reads the socket when it polls a room still waiting for such a message
(`drain_nowait`), and the reading thread stays as the reader of last resort (no room polled, a
message for a room nobody polls yet, Register, Abort, housekeeping). While a poller is active the
thread leaves every arrival to it and only looks every POLLER_ACTIVE_S (decode: every deadline
sweep interval), so it never wakes on an arrival to compete with the scheduler for the GIL.

ZMQ sockets are not thread-safe, but may be used from several threads one at a time, with a full
memory barrier between them; `lock` is that barrier. It covers each receive *and* the handling of
what was received, so messages are handled in the order they arrived (a Register before the
metadata that needs it). The scheduler only try-locks. The reading thread, while no poller is
active, waits inside one blocking receive with the lock held (one call per message: the cheapest
wait pyzmq has; waiting on `zmq.FD` with select, then receiving non-blocking, cost this thread
20-50 % more per message, issue 28). A poller starting after a quiet spell therefore wakes it
first: it sends a wake-up token into the same socket through an in-process endpoint (`inproc://`,
bound beside the socket's TCP one), the thread's receive returns it, the thread sees the poller
and lets the lock go, and from the next poll on the scheduler reads. The token is random per
inbox and dropped by whichever side reads it; a peer cannot forge it.

With `watch_arrivals` (decode) the reading thread never waits in the socket: it waits in poll(2)
on the socket's descriptor (arrival_flag.py), and a poller's look at an empty socket is a read of
the flag poll(2) writes, no system call (issue 28: the empty look was 12-27 us a step, most of
decode's Python per request at low rates). An arrival sets the flag and wakes the thread: whichever
of the two gets there first (the thread needs the GIL, which the scheduler leaves while it waits
for the GPU; the scheduler needs its next poll) drains every waiting message in one pass, the
other finds the lock taken or the socket empty. The thread then arms the flag again; every look
ends with ZMQ saying the socket is empty, after which its descriptor signals the next arrival.

With `watch_arrivals="process"` (decode, SGLANG_MORI_DECODE_ARRIVAL_FLAG=process) a child process
does that waiting instead (arrival_watcher.py): the poller's look at an empty socket reads a byte
the child writes, a real look clears it first, and no thread of ours wakes per arrival. The
reading thread keeps off-mode's rhythm (off the socket while a poller looks, a blocking receive
otherwise), writing the byte to 1 before it touches the socket, and notices the child's death at
a wake (every WATCHER_CHECK_S at most; real looks from then).
"""

from __future__ import annotations

import logging
import os
import subprocess
import threading
import time
from typing import Callable, Optional

import zmq

from sglang_mori.backend.arrival_flag import ArrivalFlag
from sglang_mori.backend.arrival_watcher import ArrivalWatcher

logger = logging.getLogger(__name__)

# A scheduler pass polls every queued room in a row; one look at the socket serves the whole pass.
POLLER_MIN_GAP_S = 20e-6
# While a poller looked at the socket this recently, it is polling a room that waits for a message and
# reads every arrival itself: the reading thread does not wait on the socket then (waking on an
# arrival would only make it take the GIL from that same scheduler), it looks again this much later.
POLLER_ACTIVE_S = 0.005
# How often the reading thread checks that the watcher process runs (at its next wake after this):
# a message that arrives after the child died waits behind its byte at most about this long.
WATCHER_CHECK_S = 0.5


def arrival_mode(value) -> str:
    """SGLANG_MORI_DECODE_ARRIVAL_FLAG as a mode: off | thread | process (booleans: True is
    thread, session 20's flag)."""
    if value is True:
        return "thread"
    if not value:
        return "off"
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on", "thread"):
        return "thread"
    if text in ("0", "false", "no", "off"):
        return "off"
    if text == "process":
        return "process"
    raise ValueError(f"arrival mode {value!r}: expected off, thread or process")


_EVENTS, _RCVMORE, _POLLIN, _NOBLOCK = int(zmq.EVENTS), int(zmq.RCVMORE), int(zmq.POLLIN), int(zmq.NOBLOCK)


class Inbox:
    def __init__(self, sock, handle: Callable[[list, bool], None], name: str,
                 poller_backoff_s: Optional[float] = None, watch_arrivals=False):
        self.sock = sock
        # handle(frames, polled): one message; `polled` when on a poller's (SGLang's) thread, which
        # must not block on a send. Must not raise (logged if it does).
        self.handle = handle
        self.name = name
        # How long the reading thread stays off the socket while a poller is active (None:
        # POLLER_ACTIVE_S). Each look is a wake-up that takes the GIL from the scheduler; a reader
        # whose every message a poller reads (decode: SGLang polls each room until it concludes)
        # can look as seldom as its own housekeeping needs.
        self.poller_backoff_s = poller_backoff_s
        self.lock = threading.Lock()
        self.closed = False
        self._last_poll = 0.0
        # The wake-up path into the reading thread's receive (made by that thread on its first
        # wait, closed by it on the way out or by close()): a PUSH socket connected to our own
        # socket's inproc endpoint, used by one thread at a time under `_wake_lock`.
        self._wake_lock = threading.Lock()
        self._waker = None
        self._token = os.urandom(16)
        self._timeout_ms = None  # RCVTIMEO as last set
        # Messages handled by a poller (the scheduler's thread) and by the reading thread: the
        # tests and the benchmark read them to see which path a message took.
        self.by_poller = 0
        self.by_thread = 0
        self.poller_looks = 0  # a poller's looks at the socket itself (the rigs: looks per message)
        self._closing = False
        self._drained = True  # the last look at the socket ended with ZMQ saying it is empty
        # Serialises the thread's waits in poll(2) with close(): the descriptors stay open meanwhile.
        self._watch_lock = threading.Lock()
        self._flag = None
        self._revents = None
        # The watcher process and its bytes (arrival_watcher.py; [0] is 0: nothing signalled since
        # this inbox's last real look, which ended empty), None without it; looks the byte
        # answered, for the reading thread to see that a poller is active (they read no clock)
        self._watcher: Optional[ArrivalWatcher] = None
        self._quiet = None
        self._quiet_looks = 0
        self._seen_looks = 0
        self._dead_watcher: Optional[ArrivalWatcher] = None
        self._watcher_check_at = 0.0  # when the reading thread next checks that the child runs
        mode = arrival_mode(watch_arrivals)
        if mode == "process":
            try:
                self._watcher = ArrivalWatcher(sock.get(zmq.FD))
                self._quiet = self._watcher.flag
            except (OSError, AttributeError, ValueError, subprocess.SubprocessError) as err:
                logger.warning("sglang-mori: %s has no arrival watcher process (%s): every poll looks "
                               "at the socket", name, err)
        elif mode == "thread":
            try:
                backoff = POLLER_ACTIVE_S if poller_backoff_s is None else poller_backoff_s
                self._flag = ArrivalFlag(sock.get(zmq.FD), backoff)
                self._revents = self._flag.revents
            except (OSError, AttributeError, ValueError) as err:  # no poll/eventfd/timerfd here
                logger.info("sglang-mori: %s looks at its socket every poll (%s)", name, err)

    # --- the scheduler's side ------------------------------------------------------------------
    def drain_nowait(self) -> int:
        """Handle what has arrived, on the calling thread, without waiting for anything: not for
        the lock (the reading thread holds it while it waits in the socket or handles a message)
        and not for the socket. At most one look per POLLER_MIN_GAP_S (with the watcher: per
        arrival its byte shows). Returns the number of
        messages handled. With the arrival flag armed (or the watcher's byte 0) and nothing
        arrived: no more than that."""
        q = self._quiet
        if q is not None:
            if not q[0]:  # the watcher process's byte: nothing arrived
                self._quiet_looks += 1
                return 0
            # The watched look: it runs once per arrival, on caches a GPU step left cold, where
            # every call and line costs about 1-4 us more than in a look that runs every step
            # (issue 28, session 22): inline here, no clock unless the lock is taken (the byte keeps
            # one scheduler pass to one look; the reading thread sees a poller by its looks,
            # counted), and a receive at once.
            lock = self.lock
            if not lock.acquire(False):
                # The reading thread waits in the socket (or handles a message): wake it, once per
                # POLLER_ACTIVE_S (a wake-up token it is not there to read costs the next drain a
                # receive), and it leaves the socket to the polls from its next look on.
                now = time.perf_counter()
                if now - self._last_poll >= POLLER_ACTIVE_S:
                    self._wake_thread()
                self._last_poll = now
                return 0
            try:
                if self.closed:
                    return 0
                self.poller_looks += 1
                if q[1]:  # (the watcher's byte, once it watches: 0 from here, the drain below ends empty)
                    q[0] = 0
                try:
                    n = self._drain_locked(True, True)
                finally:
                    if not self._drained:  # ended early (a socket error): look again
                        q[0] = 1
                self.by_poller += n
                return n
            finally:
                lock.release()
        r = self._revents
        if r is not None and not (r[3] or r[7] or r[11]):  # ArrivalFlag.quiet(), inlined
            return 0
        now = time.perf_counter()
        since = now - self._last_poll
        if since < POLLER_MIN_GAP_S:
            return 0
        self._last_poll = now
        if since >= POLLER_ACTIVE_S:
            self._wake_thread()  # it may be waiting in the socket with the lock held
        if not self.lock.acquire(blocking=False):
            return 0
        try:
            if self.closed:
                return 0
            self.poller_looks += 1
            n = self._drain_locked(polled=True)
            self.by_poller += n
            return n
        finally:
            self.lock.release()

    def _alive_checked(self, now: float) -> bool:
        # (a wait for the child is a system call and 30 us of this thread on this VM, where a
        # wake costs 50: once a WATCHER_CHECK_S, not at every wake)
        self._watcher_check_at = now + WATCHER_CHECK_S
        return self._watcher.alive()

    def _watcher_gone_locked(self, why: str) -> None:
        """From now on every poll looks at the socket (as without a watcher)."""
        watcher = self._watcher
        self._quiet = None
        self._watcher = None
        if watcher is not None:
            logger.warning("sglang-mori: the %s's arrival watcher process (pid %d) ended (%s): every "
                           "poll looks at the socket from now on", self.name, watcher.pid, why)
            self._dead_watcher = watcher  # reaped by close() (or now, when it has ended)
            watcher.alive()

    # --- the reading thread's side ----------------------------------------------------------------
    def wait_and_drain(self, timeout_ms: int) -> int:
        """Wait up to `timeout_ms` for a message and handle it (1), or return 0: on the timeout, on
        a wake-up, and at once while a poller is active (after waiting up to POLLER_ACTIVE_S
        off the socket: the poller reads every arrival; with the arrival flag, until something
        arrives, the flag's tick or a wake-up)."""
        if self._flag is not None:
            return self._watch_once()
        now = time.perf_counter()
        active = now - self._last_poll < POLLER_ACTIVE_S
        if self._watcher is not None:
            looks = self._quiet_looks + self.poller_looks
            if looks != self._seen_looks:  # a poller looked (at the byte or the socket) since this thread's last look
                self._seen_looks, active = looks, True
            if now >= self._watcher_check_at and not self._alive_checked(now):
                with self.lock:
                    if self._watcher is not None:
                        self._watcher_gone_locked("found at the reading thread's wake")
                active = False  # look now: a message may have waited behind the dead child's byte
        if active:  # a poller is active
            # Stay off the socket and the GIL until the poller may have stopped, then look again.
            backoff = POLLER_ACTIVE_S if self.poller_backoff_s is None else self.poller_backoff_s
            time.sleep(min(backoff, timeout_ms / 1000.0))
            return 0
        with self.lock:
            if self.closed:
                self._close_waker()
                return 0
            if self._waker is None:
                self._open_waker_locked()
            sock = self.sock
            q = self._quiet
            if q is not None:  # our receive may leave messages that ZMQ signals no more: polls look
                q[0] = 1
            if timeout_ms != self._timeout_ms:
                sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
                self._timeout_ms = timeout_ms
            try:
                frames = [sock.recv()]
            except zmq.Again:
                return 0
            self._drained = False  # ZMQ's descriptor now signals nothing new: drain before arming
            while sock.get(_RCVMORE):  # (as in _drain_locked: recv_multipart's layer apart)
                frames.append(sock.recv(_NOBLOCK))
            if frames[0] == self._token and len(frames) == 1:
                return 0  # a poller started (or close()): look again from the top
            try:  # a bug in one handler must not stop the reader
                self.handle(frames, False)
            except Exception:
                logger.exception("sglang-mori: handling a message on the %s failed", self.name)
        self.by_thread += 1
        return 1

    def _watch_once(self) -> int:
        """Wait in poll(2), the flag armed, until an arrival, a wake-up or the flag's tick; after
        an arrival, drain (unless a poller did: then ZMQ says empty at once). Returns the messages
        this thread handled."""
        flag = self._flag
        if not self._drained:
            # zmq.FD signals only after a look found the socket empty; one that ended otherwise
            # (a receive) would leave the next arrival unsignalled: look until empty first.
            self._drain_as_thread()
            if not self._drained:
                return 0
        with self._watch_lock:
            if self._closing:
                return 0
            flag.wait()
        return self._drain_as_thread() if flag.socket_ready() else 0

    def _drain_as_thread(self) -> int:
        with self.lock:
            if self.closed:
                return 0
            n = self._drain_locked(polled=False)
            self.by_thread += n
        return n

    def thread_done(self) -> None:
        """The reading thread is leaving: its wake-up socket goes with it."""
        self._close_waker()

    def close(self) -> None:
        """No more reads from either side (the manager closes the socket after this). Wakes the
        reading thread out of its receive (or its poll(2)) first: the socket must not be closed
        while it is in it."""
        self._closing = True
        self._wake_thread()
        flag = self._flag
        if flag is not None:
            flag.wake()
            with self._watch_lock:  # out of poll(2): its descriptors may go
                flag.close()
        with self.lock:  # (a poll holds it while it reads the watcher's byte)
            self.closed = True
            watcher, self._watcher, self._quiet = self._watcher, None, None
            dead, self._dead_watcher = self._dead_watcher, None
        for w in (watcher, dead):  # the child ends and is reaped
            if w is not None:
                w.close()
        self._close_waker()

    def _open_waker_locked(self) -> None:
        address = f"inproc://sglang-mori-inbox-{id(self):x}-{self._token.hex()[:8]}"
        self.sock.bind(address)
        waker = self.sock.context.socket(zmq.PUSH)
        waker.setsockopt(zmq.LINGER, 0)
        waker.setsockopt(zmq.SNDHWM, 4)  # one pending token wakes the thread; more add nothing
        waker.connect(address)
        with self._wake_lock:
            self._waker = waker

    def _wake_thread(self) -> None:
        with self._wake_lock:
            if self._waker is not None:
                try:
                    self._waker.send(self._token, zmq.NOBLOCK)
                except zmq.ZMQError:  # full: the thread has wake-ups pending already
                    pass

    def _close_waker(self) -> None:
        with self._wake_lock:
            if self._waker is not None:
                self._waker.close(0)
                self._waker = None

    # --- both ------------------------------------------------------------------------------------
    def _drain_locked(self, polled: bool = False, first_recv: bool = False) -> int:
        # Plain ints for the flags: `&` on pyzmq's enum flags is a Python-level __and__ (about 2 us
        # a look); recv + RCVMORE is recv_multipart without its Python layer (issue 28: a poll that
        # reads TransferStarted + Success costs 22-26 us in pyzmq this way, 30-42 before). (Frames
        # as zmq.Frame, `more` read in C, cost 16 us more in a cold look on the CPU: session 22.)
        # `first_recv`: something most likely waits (the watcher's byte): receive before asking
        # ZMQ (the receive processes ZMQ's commands as get(EVENTS) does; one call less per look,
        # an exception when nothing was there).
        sock, token, handle = self.sock, self._token, self.handle
        get, recv = sock.get, sock.recv
        n = 0
        self._drained = False  # (until ZMQ says empty below: a socket error may end the look first)
        first = None
        if first_recv:
            try:
                first = recv(_NOBLOCK)
            except zmq.Again:
                self._drained = True  # (ZMQ said empty: its descriptor signals the next arrival)
                return 0
        while first is not None or get(_EVENTS) & _POLLIN:
            frames = [first if first is not None else recv(_NOBLOCK)]  # a multipart message arrives whole
            first = None
            while get(_RCVMORE):
                frames.append(recv(_NOBLOCK))
            if frames[0] == token and len(frames) == 1:
                continue  # a wake-up meant for the reading thread, which is not in the socket now
            n += 1
            try:
                handle(frames, polled)
            except Exception:  # a bug in one handler must not stop the reader
                logger.exception("sglang-mori: handling a message on the %s failed", self.name)
        self._drained = True  # (ZMQ said empty: its descriptor signals the next arrival)
        return n
