"""A flag in our memory that the kernel sets when a ZMQ socket may have something to read.

Decode's step thread looks at its inbox every step (SGLang polls every waiting room; the first poll
of a step reads our socket: inbox.py). Asking ZMQ whether a message waits (`get(zmq.EVENTS)`) is a
system call and cost 3 us alone, 12-27 us between steps (issue 28), at every step, message or not.
Here the inbox's reading thread waits, with the GIL released, in poll(2) called through ctypes on
the socket's descriptor (`zmq.FD`), plus an eventfd (wake-ups) and a timerfd (the thread's
periodic work). poll(2) writes each descriptor's `revents` into an array we own before it returns,
without the GIL, so the step thread learns of an arrival by reading three shorts: `quiet()` is True
only while the thread is inside poll(2) (armed: all zero) and nothing has happened since. Any
return writes a non-zero `revents` (a timeout would write none: the timerfd replaces it; signals,
which would interrupt it with none, are blocked in the waiting thread), and only the thread clears
them, right before it waits again; so from any return until the next wait, `quiet()` is False and
the step thread looks at the socket for real.

zmq.FD signals new commands to the socket (a pipe that went from empty to not), not messages: it
stays readable until a receive or `get(zmq.EVENTS)` processes them, and signals again only after a
look found the socket empty. The inbox therefore re-arms only after a look that started after the
arrival has been looked at (inbox.py), and every look drains until ZMQ says nothing is left.
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading

POLLIN = 0x1
_CLOCK_MONOTONIC = 1
_TFD_NONBLOCK, _TFD_CLOEXEC = os.O_NONBLOCK, os.O_CLOEXEC
# revents of the socket, the wake-up eventfd and the timerfd, as indexes of shorts (struct pollfd is
# an int and two shorts: fd, events, revents)
_SOCK, _WAKE, _TICK = 3, 7, 11


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


class _PollFd(ctypes.Structure):
    _fields_ = [("fd", ctypes.c_int), ("events", ctypes.c_short), ("revents", ctypes.c_short)]


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)  # CDLL: the GIL is released around each call
    libc.poll.argtypes, libc.poll.restype = [ctypes.c_void_p, ctypes.c_ulong, ctypes.c_int], ctypes.c_int
    libc.timerfd_create.argtypes, libc.timerfd_create.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    libc.timerfd_settime.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    libc.timerfd_settime.restype = ctypes.c_int
    return libc


class ArrivalFlag:
    """poll(2) on a socket's descriptor, an eventfd and a periodic timerfd, its result readable
    without a system call. One thread waits (`wait`); any thread reads `quiet`.
    Raises OSError where the platform has no poll/eventfd/timerfd (the inbox then looks as before)."""

    def __init__(self, sock_fd: int, period_s: float):
        self._libc = _libc()
        self.wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.tick_fd = self._libc.timerfd_create(_CLOCK_MONOTONIC, _TFD_NONBLOCK | _TFD_CLOEXEC)
        if self.tick_fd < 0:
            os.close(self.wake_fd)
            raise OSError(ctypes.get_errno(), "timerfd_create")
        sec, nsec = int(period_s), int(round((period_s - int(period_s)) * 1e9))
        period = _Timespec(sec, max(nsec, 1) if sec == 0 else nsec)
        if self._libc.timerfd_settime(self.tick_fd, 0, ctypes.byref(_Itimerspec(period, period)), None) != 0:
            self.close()
            raise OSError(ctypes.get_errno(), "timerfd_settime")
        # The array poll(2) writes, in a bytearray so that a memoryview of shorts reads it (a view
        # of a ctypes array cannot be cast). revents start non-zero: not armed.
        self._raw = bytearray(24)
        fds = (_PollFd * 3).from_buffer(self._raw)
        for i, fd in enumerate((sock_fd, self.wake_fd, self.tick_fd)):
            fds[i].fd, fds[i].events, fds[i].revents = fd, POLLIN, 0
        self._fds = fds
        self._fds_addr = ctypes.addressof(fds)
        self.revents = memoryview(self._raw).cast("h")
        self.revents[_WAKE] = 1
        self._blocked_in = None  # the thread whose signals we blocked

    def quiet(self) -> bool:
        """True while the waiting thread is in poll(2) and nothing arrived, woke it or ticked."""
        r = self.revents
        return not (r[_SOCK] or r[_WAKE] or r[_TICK])

    def socket_ready(self) -> bool:
        return self.revents[_SOCK] != 0

    def disarm(self) -> None:
        """The waiting thread is not in poll(2) and will not be soon: lookers look for real."""
        self.revents[_WAKE] = 1

    def wait(self) -> None:
        """Arm, then wait until the socket signals, a wake-up or a tick (GIL released). Callers
        serialise it with close()."""
        self._block_signals()
        r = self.revents
        r[_SOCK] = r[_WAKE] = r[_TICK] = 0
        if self._libc.poll(self._fds_addr, 3, -1) < 0:  # interrupted (a main thread's signal)
            self.disarm()
        if r[_WAKE]:
            self._read(self.wake_fd)
        if r[_TICK]:
            self._read(self.tick_fd)

    def wake(self) -> None:
        try:
            os.eventfd_write(self.wake_fd, 1)
        except (OSError, ValueError):  # closed (a late waker after close()), or the counter full
            pass

    def close(self) -> None:
        for fd in (self.wake_fd, self.tick_fd):
            if fd >= 0:
                os.close(fd)
        self.wake_fd = self.tick_fd = -1
        self.disarm()

    def _block_signals(self) -> None:
        # A signal would end poll(2) with no revents written (quiet, not waiting): the process's
        # signals go to its other threads; Python runs handlers on the main thread anyway.
        me = threading.get_ident()
        if self._blocked_in != me and threading.current_thread() is not threading.main_thread():
            signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
            self._blocked_in = me

    @staticmethod
    def _read(fd: int) -> None:
        try:
            os.read(fd, 8)
        except (BlockingIOError, OSError):
            pass
