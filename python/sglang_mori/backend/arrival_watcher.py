"""Decode's arrival watcher: a child process that tells the step thread, through one shared byte,
that its status socket may have something to read (SGLANG_MORI_DECODE_ARRIVAL_FLAG=process).

Issue 28: the step thread's look at an empty socket (`get(zmq.EVENTS)`, a system call) was most of
decode's Python per request at low rates. Session 20's flag (arrival_flag.py) made that look a read
of memory, but the thread waiting in poll(2) for it woke in Python on every arrival and took the
GIL: more CPU than the look saved. Here the waiting is done by a child process with no GIL of ours
(arrival_watcher_child.py, edge-triggered epoll on the socket's descriptor): it writes 1 into the
byte at every signal of the descriptor; the step thread reads `flag[0]` (0: nothing signalled since
its last real look) and writes 0 right before a real look, whose drain then ends with ZMQ saying
the socket is empty. A message whose command came before that 0 is seen by the drain; one after it
signals (the look found the socket empty, so ZMQ's descriptor signals the next command) and the
child writes 1 after the 0. A signal of a message the drain read anyway costs one extra look.
Looks write that 0 only once the child watches (it sets `flag[1]` after setting up its epoll): a
0 written during its start-up would hide an arrival until the child ran (28 ms once on this VM).
Anything else that reads the socket (a foreign `get(zmq.EVENTS)`) would take the signal the child
waits for: only the inbox may touch it.

The byte is 0 only while our real looks are the only readers of the socket: our reading thread
writes 1 before its own receive (under the inbox's lock), which may leave a message behind without
ZMQ signalling again. (An earlier shape armed the child with a pipe write after each empty look:
12 us a look on this project's CPU host, waking the child; the edge-triggered wait needs no arm.)
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
        hup_r = hup_w = -1
        try:
            os.ftruncate(flag_fd, 2)
            # [0]: the arrival byte; [1]: the child watches (set by it once its epoll is set up:
            # until then a 0 written by a look would hide what arrives, so looks leave [0] at 1)
            self.flag = mmap.mmap(flag_fd, 2)
            self.flag[0] = 1  # the first looks are real ones
            # The child's end-of-parent signal: nothing is written; its hang-up ends the child.
            hup_r, hup_w = os.pipe()  # both close on exec: the child gets only what pass_fds names
            self.proc = subprocess.Popen(
                [sys.executable, "-I", "-S", CHILD, str(sock_fd), str(hup_r), str(flag_fd), str(os.getpid())],
                pass_fds=(sock_fd, hup_r, flag_fd), stdin=subprocess.DEVNULL, close_fds=True)
        except BaseException:
            if hup_w >= 0:
                os.close(hup_w)
            raise
        finally:
            os.close(flag_fd)
            if hup_r >= 0:
                os.close(hup_r)
        self._hup_w = hup_w
        self.pid = self.proc.pid

    def alive(self) -> bool:
        """Whether the child runs (reaps it when it has ended: no zombie)."""
        return self.proc.poll() is None

    def close(self) -> None:
        """The pipe's hang-up ends the child; reaped here, killed if it does not end. The byte stays
        mapped (a look may be reading it) until the last reference goes."""
        if self._hup_w >= 0:
            os.close(self._hup_w)
            self._hup_w = -1
        try:
            self.proc.wait(CLOSE_WAIT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
