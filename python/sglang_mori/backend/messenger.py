"""Every message our backend sends, and the socket policy for them.

Messages to a decode or prefill rank's PULL socket go through a PUSH socket owned by the calling
thread. SGLang's shared socket cache serialises every send of every thread on one lock and polls a
monitor socket per send; with a message per chunk that lock was the hottest spot on prefill. ZMQ
sockets are single-threaded anyway; messages of one thread to one peer stay ordered, and a room's
data-bearing message (RoomStatus with aux) is a single message.

Sends are bounded (SNDTIMEO) so a dead peer cannot block a transfer thread; a failed send is logged
and reported as False, never raised.
"""

from __future__ import annotations

import logging
import threading
from typing import Iterable, Tuple

import zmq

from sglang_mori import protocol

logger = logging.getLogger(__name__)

SEND_TIMEOUT_MS = 5000


class Messenger:
    def __init__(self, zmq_ctx):
        self._ctx = zmq_ctx
        self._local = threading.local()
        self._all_sockets: list = []
        self._lock = threading.Lock()

    def send(self, endpoint: Tuple[str, int], message, *, block: bool = True) -> bool:
        """Push one protocol message to (ip, port); False (logged) when it cannot be sent.
        `block=False`: fail at once instead of waiting up to SEND_TIMEOUT_MS for room in the
        peer's queue (SGLang's scheduler thread sends this way)."""
        try:
            frames = protocol.encode(message)
            sock = self._socket(endpoint)
            flags = 0 if block else zmq.NOBLOCK
            if len(frames) == 1:  # every message but Register: one send call, not send_multipart's loop
                sock.send(frames[0], flags)
            else:
                sock.send_multipart(frames, flags)
            return True
        except Exception as exc:
            logger.warning("sglang-mori: cannot send %s to %s:%s: %s", type(message).__name__, *endpoint, exc)
            return False

    def send_all(self, endpoints: Iterable[Tuple[str, int]], message) -> None:
        for endpoint in endpoints:
            self.send(endpoint, message)

    @staticmethod
    def send_on(sock_and_lock, message) -> None:
        """Send through a socket someone else owns (SGLang's bootstrap socket cache) under its lock."""
        sock, lock = sock_and_lock
        with lock:
            sock.send_multipart(protocol.encode(message))

    def _socket(self, endpoint: Tuple[str, int]):
        """This thread's PUSH socket to (ip, port), cached by the tuple (no address string per send)."""
        cache = getattr(self._local, "cache", None)
        if cache is None:
            cache = self._local.cache = {}
        sock = cache.get(endpoint) if type(endpoint) is tuple else None
        if sock is None:
            ip, port = endpoint = tuple(endpoint)
            sock = cache.get(endpoint)
        if sock is None:
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
            sock.connect(f"tcp://{ip}:{port}")
            cache[endpoint] = sock
            with self._lock:
                self._all_sockets.append(sock)
        return sock

    def close(self) -> None:
        with self._lock:
            sockets, self._all_sockets = self._all_sockets, []
        for sock in sockets:
            try:
                sock.close(0)
            except Exception:
                pass
