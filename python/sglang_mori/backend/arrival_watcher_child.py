"""The arrival watcher's child process (arrival_watcher.py starts it: `python -I -S` this file).

Standard library only, no site-packages: it starts in tens of milliseconds and imports nothing of
the decode process. argv: the socket's descriptor (ZMQ's `zmq.FD`, inherited), the read end of the
arm pipe, a memfd holding the one shared byte, the parent's pid.

Loop: wait for an arm (a byte on the pipe; several pending are one arm), then poll(2) the socket's
descriptor until it is readable and write 1 into the shared byte. The parent clears the byte and
arms again only after a look of its own found the socket empty (ZMQ's descriptor signals only then),
so one arrival costs this process one wake and the parent one pipe write, and no thread of the
parent wakes for it. Ends at EOF on the pipe (the parent closed it, or died: every writer gone),
on a hang-up seen while polling, or by PR_SET_PDEATHSIG when the parent dies.
"""

import mmap
import os
import select
import signal
import sys


def main(argv) -> int:
    sock_fd, arm_fd, flag_fd, parent = (int(a) for a in argv[1:5])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's ^C is the parent's to handle
    try:  # die with the parent even while some other process holds the pipe's write end (a fork)
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError, ImportError):
        pass
    if os.getppid() != parent:  # the parent died before the prctl
        return 0
    flag = mmap.mmap(flag_fd, 1)
    os.close(flag_fd)
    poller = select.poll()
    poller.register(sock_fd, select.POLLIN)
    poller.register(arm_fd, 0)  # no events asked: poll still reports a hang-up (the parent is gone)
    while True:
        if not os.read(arm_fd, 4096):  # EOF: the parent closed the pipe (close(), or it died)
            return 0
        while True:
            events = poller.poll()
            if any(fd == arm_fd for fd, _ in events):
                return 0
            if events:
                break
        flag[0] = 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
