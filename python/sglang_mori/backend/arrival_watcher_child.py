"""The arrival watcher's child process (arrival_watcher.py starts it: `python -I -S` this file).

Standard library only, no site-packages: it starts in tens of milliseconds and imports nothing of
the decode process. argv: the socket's descriptor (ZMQ's `zmq.FD`, inherited), the read end of a
pipe whose write end only the parent holds, a memfd holding the shared bytes (0: the arrival byte;
1: set once this process watches), the parent's pid.

It waits in epoll, edge-triggered, on the socket's descriptor, and writes 1 into the shared byte at
every event. ZMQ's descriptor is written once per batch of commands that reach a socket whose last
look found it empty (a message's arrival after such a look is one), and an edge-triggered epoll
reports every such write, whether or not the descriptor was still readable: so no re-arming is
needed, and the parent's only part is clearing the byte before a look of its own (inbox.py). One
arrival costs this process one wake and the parent nothing beyond the look it makes anyway.
Ends on the pipe's hang-up (the parent closed it, or died: every writer gone), or by
PR_SET_PDEATHSIG when the parent dies while some other process holds the pipe (a fork).
"""

import mmap
import os
import select
import signal
import sys


def main(argv) -> int:
    sock_fd, pipe_fd, flag_fd, parent = (int(a) for a in argv[1:5])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's ^C is the parent's to handle
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError, ImportError):
        pass
    if os.getppid() != parent:  # the parent died before the prctl
        return 0
    flag = mmap.mmap(flag_fd, 2)
    os.close(flag_fd)
    ep = select.epoll()
    # (registering reports the descriptor once if it is readable already: an arrival before this
    # child started is shown too)
    ep.register(sock_fd, select.EPOLLIN | select.EPOLLET)
    ep.register(pipe_fd, select.EPOLLIN)  # readable at EOF only: the parent writes nothing
    flag[1] = 1  # watching: from now on the parent may trust a 0 it writes (arrival_watcher.py)
    while True:
        events = ep.poll()
        for fd, _ in events:
            if fd == pipe_fd:
                return 0
        if events:
            flag[0] = 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
