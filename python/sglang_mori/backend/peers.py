"""Decode peers as seen by one prefill rank: registration, validation, fail-fast after a failure."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Optional


@dataclass
class DecodePeer:
    engine_key: str
    endpoint: tuple  # (ip, port) of the decode rank's ZMQ PULL socket
    attn_tp_size: int
    attn_tp_rank: int
    kv_descs: list
    aux_descs: list
    state_descs: list
    layout: object  # planning.KVLayout
    # Set when the peer's layout cannot be served; every room from it fails with this reason.
    rejected: Optional[str] = None
    failed_reason: Optional[str] = None
    failed_at: Optional[float] = None
    # Last transport failure; unlike failed_at it is not cleared when the fail-fast window ends,
    # because MORI never rebuilds a broken connection: only a new engine key brings the peer back.
    broken_at: Optional[float] = None
    inflight: int = 0
    registered_at: float = field(default_factory=time.monotonic)
    last_seen: float = field(default_factory=lambda: time.monotonic())  # registration or room metadata


class PeerRegistry:
    """Thread-safe table of decode peers keyed by engine key.

    A decode rank that restarts comes back with a new engine key at the same endpoint: the new key
    replaces the old one, so the restarted peer is served without restarting this side, and rooms
    still bound to the old key fail with a reason.
    """

    def __init__(self, fail_fast_s: float):
        self._lock = threading.Lock()
        self._by_key: dict[str, DecodePeer] = {}
        self._key_by_endpoint: dict[tuple, str] = {}
        self.fail_fast_s = fail_fast_s

    def add(self, peer: DecodePeer) -> Optional[DecodePeer]:
        """Insert `peer`; return the peer it replaced at the same endpoint, if any."""
        with self._lock:
            replaced = None
            old_key = self._key_by_endpoint.get(peer.endpoint)
            if old_key is not None and old_key != peer.engine_key:
                replaced = self._by_key.pop(old_key, None)
            self._by_key[peer.engine_key] = peer
            self._key_by_endpoint[peer.endpoint] = peer.engine_key
            return replaced

    def get(self, key: str) -> Optional[DecodePeer]:
        with self._lock:
            return self._by_key.get(key)

    def keys(self) -> list:
        with self._lock:
            return list(self._by_key)

    def mark_failed(self, key: str, reason: str) -> bool:
        """Record a failure; True if this is news (the peer was not already failed)."""
        with self._lock:
            peer = self._by_key.get(key)
            if peer is None:
                return False
            news = peer.failed_reason is None
            peer.failed_reason = reason
            peer.failed_at = peer.broken_at = time.monotonic()
            return news

    def touch(self, key: str) -> None:
        """The peer spoke (room metadata): it is not gone, whatever its connection's state."""
        with self._lock:
            peer = self._by_key.get(key)
            if peer is not None:
                peer.last_seen = time.monotonic()

    def prune_dead(self, retention_s: float) -> list:
        """Remove and return peers whose connection broke and that have been silent since, for
        `retention_s`, with nothing in flight.

        A decode that restarts on new ports (SGLang binds random ones) leaves its old engine key
        here for good otherwise: one entry, planner and engine registration per restart.
        """
        now = time.monotonic()
        removed = []
        with self._lock:
            for key, peer in list(self._by_key.items()):
                if peer.broken_at is None or peer.inflight:
                    continue
                if now - max(peer.broken_at, peer.last_seen) < retention_s:
                    continue
                del self._by_key[key]
                if self._key_by_endpoint.get(peer.endpoint) == key:
                    del self._key_by_endpoint[peer.endpoint]
                removed.append(peer)
        return removed

    def unusable_reason(self, key: str) -> Optional[str]:
        """Why rooms to `key` must fail now, or None when it can be used."""
        with self._lock:
            peer = self._by_key.get(key)
            if peer is None:
                return f"decode engine {key} has not registered with this prefill rank"
            if peer.rejected:
                return peer.rejected
            if peer.failed_reason is not None:
                if time.monotonic() - peer.failed_at < self.fail_fast_s:
                    return f"decode engine {key} failed recently: {peer.failed_reason}"
                # Past the fail-fast window: try again (a transient fault may have cleared).
                peer.failed_reason = None
                peer.failed_at = None
            return None

    def up_count(self) -> int:
        with self._lock:
            return sum(1 for p in self._by_key.values() if p.failed_reason is None and not p.rejected)
