"""Noticing that a device-path peer went away.

A peer reached over TCP or intra-host lanes is seen to die when a lane breaks. A peer reached only
through its mapped device memory has no lane: copies into a dead process's pool still succeed
(this process's mapping keeps the memory alive), so without a watch nothing would ever tell the
backend, it would never deregister the peer, and the mapping would hold the dead peer's pool on
its GPU for as long as this process lives.

What does tell: the control connection opened to look up the peer's regions. The target never
sends on it unasked and has no idle timeout, so the connection turning readable while no lookup
is in progress means its end closed it: the peer process died, its engine shut down, or a fault
dropped us. Then the peer is reported as failed (a PeerFailureEvent, as for a broken lane) and its
device sessions are dropped: their mappings close once the copies in flight are done.
"""

from __future__ import annotations

import logging
import select
import socket
import threading

logger = logging.getLogger("sglang_mori.softio")

POLL_S = 0.5  # how often the watch notices a new peer or the backend closing


class DevicePeerWatch:
    def __init__(self, backend):
        self._backend = backend
        self._lock = threading.Lock()
        self._peers: set = set()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def stop(self) -> None:
        self._stop.set()

    def watch(self, peer) -> None:
        with self._lock:
            self._peers.add(peer)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, daemon=True,
                                                name=f"softio-peer-watch-{self._backend.core.key}")
                self._thread.start()

    def _loop(self) -> None:
        backend = self._backend
        while not self._stop.is_set():
            with self._lock:
                # A deregistered peer is nobody's business any more (watched again if re-added).
                peers = [p for p in self._peers if p.broken is None and backend.peers.is_registered(p.key)]
            socks = {}
            poller = select.poll()  # not select(): a serving process easily has fds above 1024
            for peer in peers:
                sock = peer._control
                fd = sock.fileno() if sock is not None and not peer.lanes else -1
                if fd >= 0:  # a peer with lanes is watched by its lanes
                    socks[fd] = (sock, peer)
                    poller.register(fd, select.POLLIN)
            if not socks:
                self._stop.wait(POLL_S)
                continue
            try:
                ready = poller.poll(POLL_S * 1000)
            except OSError:
                ready = []
            if any(mask & select.POLLNVAL for _, mask in ready):
                self._stop.wait(POLL_S)  # a socket closed under us (our own abort): look again later
            for fd, _ in ready:
                sock, peer = socks[fd]
                verdict = _closed_by_peer(peer, sock)
                if verdict is _BUSY:
                    self._stop.wait(0.01)  # a lookup is reading its reply; look again shortly
                elif verdict is not None:
                    with self._lock:
                        self._peers.discard(peer)
                    if verdict is not _UNASKED:
                        backend.device_peer_gone(peer, verdict)
                    else:  # never happens with a softio target; stop watching rather than spin
                        logger.warning("softio: peer %s sent on its control connection unasked; not watched "
                                       "any more", peer.key)


_BUSY = "busy"
_UNASKED = "unasked"


def _closed_by_peer(peer, sock: socket.socket):
    """Why the peer's control connection ended; None if it did not, _BUSY while a lookup runs,
    _UNASKED for bytes nobody asked for."""
    if not peer._control_lock.acquire(blocking=False):
        return _BUSY  # a lookup is reading its reply: it sees a closed connection itself
    try:
        if peer._control is not sock:
            return None  # replaced or dropped meanwhile
        try:
            data = sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError, socket.timeout):
            return None
        except OSError as exc:
            return f"control connection failed: {exc}"
        return "control connection closed by the peer" if not data else _UNASKED
    finally:
        peer._control_lock.release()
