"""Decode's arrival watcher: a child process that tells the step thread, through one shared byte,
that its status socket may have something to read (SGLANG_MORI_DECODE_ARRIVAL_FLAG=process).

Issue 28: the step thread's look at an empty socket (`get(zmq.EVENTS)`, a system call) was most of
decode's Python per request at low rates. Session 20's flag (arrival_flag.py) made that look a read
of memory, but the thread waiting in poll(2) for it woke in Python on every arrival and took the
GIL: more CPU than the look saved. Here the waiting is done by a child process with no GIL of ours
(arrival_watcher_child.py): the step thread reads `flag[0]` (0: armed and nothing arrived), and
after a look of its own that found the socket empty clears the byte and arms the child again with
one pipe write, once per arrival, not per step.

The byte is 0 only while every look since the last arm went through it: anything else touching the
socket (our reading thread's receive) writes 1 first, under the inbox's lock, so the step thread
looks for real until its next empty look arms again. Extra arms (one sent while the child still
polled) cost at most one extra look; a missing one would strand a message, so every empty look arms.
"""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
from pathlib import Path

CHILD = str(Path(__file__).with_name("arrival_watcher_child.py"))
# How long close() waits for the child to exit after the pipe closes before killing it.
CLOSE_WAIT_S = 2.0


class ArrivalWatcher:
    """The child watching `sock_fd` (a ZMQ socket's `zmq.FD`) and the byte it writes (`flag`).
    Raises OSError (or subprocess.SubprocessError) when the child cannot start."""

    def __init__(self, sock_fd: int):
        if not sys.executable:
            raise OSError("no Python executable to start the watcher with")
        flag_fd = os.memfd_create("sglang-mori-arrivals", os.MFD_CLOEXEC)
        arm_r = arm_w = -1
        try:
            os.ftruncate(flag_fd, 1)
            self.flag = mmap.mmap(flag_fd, 1)
            self.flag[0] = 1  # not armed: the first look is a real one, and arms
            arm_r, arm_w = os.pipe()  # both close on exec: the child gets only what pass_fds names
            self.proc = subprocess.Popen(
                [sys.executable, "-I", "-S", CHILD, str(sock_fd), str(arm_r), str(flag_fd), str(os.getpid())],
                pass_fds=(sock_fd, arm_r, flag_fd), stdin=subprocess.DEVNULL, close_fds=True)
        except BaseException:
            if arm_w >= 0:
                os.close(arm_w)
            raise
        finally:
            os.close(flag_fd)
            if arm_r >= 0:
                os.close(arm_r)
        os.set_blocking(arm_w, False)  # a stopped child must not block the step thread's arm
        self._arm_w = arm_w
        self.pid = self.proc.pid

    def arm(self) -> None:
        """After a look found the socket empty: clear the byte, then ask the child to watch.
        Raises OSError when the child is gone (its end of the pipe closed)."""
        self.flag[0] = 0
        try:
            os.write(self._arm_w, b"a")
        except BlockingIOError:  # the pipe is full of arms the child has yet to read: it will
            pass

    def alive(self) -> bool:
        """Whether the child runs (reaps it when it has ended: no zombie)."""
        return self.proc.poll() is None

    def close(self) -> None:
        """EOF on the pipe ends the child; reaped here, killed if it does not end. The byte stays
        mapped (a look may be reading it) until the last reference goes."""
        if self._arm_w >= 0:
            os.close(self._arm_w)
            self._arm_w = -1
        try:
            self.proc.wait(CLOSE_WAIT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
