"""Decode peers as seen by one prefill rank: registration, fail-fast after a failure, and the
in-flight write budget per peer (write batches and bytes)."""

from __future__ import annotations

import collections
import enum
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional


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
    # (local region id, remote region id) pairs whose engine session (dial, QPs, remote memory
    # lookup) is open: each is opened before the first write that uses it, never inside one.
    open_pairs: set = field(default_factory=set, repr=False, compare=False)
    session_lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    last_seen: Optional[float] = None  # registration (stamped by PeerRegistry.add) or room metadata


class PeerRegistry:
    """Thread-safe table of decode peers keyed by engine key.

    A decode rank that restarts comes back with a new engine key at the same endpoint: the new key
    replaces the old one, so the restarted peer is served without restarting this side, and rooms
    still bound to the old key fail with a reason.
    """

    def __init__(self, fail_fast_s: float, budget: Optional["InflightBudget"] = None,
                 clock: Callable[[], float] = time.monotonic):
        self._lock = threading.Lock()
        self.budget = budget if budget is not None else InflightBudget(1 << 30)
        self._by_key: dict[str, DecodePeer] = {}
        self._key_by_endpoint: dict[tuple, str] = {}
        self.fail_fast_s = fail_fast_s
        self._clock = clock

    def use_clock(self, clock: Callable[[], float]) -> None:
        """The service's clock, for this registry and its budget (PrefillParts shares its own)."""
        self._clock = clock
        self.budget.use_clock(clock)

    def add(self, peer: DecodePeer) -> Optional[DecodePeer]:
        """Insert `peer`; return the peer it replaced at the same endpoint, if any."""
        with self._lock:
            replaced = None
            old_key = self._key_by_endpoint.get(peer.endpoint)
            if old_key is not None and old_key != peer.engine_key:
                replaced = self._by_key.pop(old_key, None)
            if peer.last_seen is None:
                peer.last_seen = self._clock()
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
            peer.failed_at = peer.broken_at = self._clock()
            return news

    def touch(self, key: str) -> None:
        """The peer spoke (room metadata): it is not gone, whatever its connection's state."""
        with self._lock:
            peer = self._by_key.get(key)
            if peer is not None:
                peer.last_seen = self._clock()

    def prune_dead(self, retention_s: float) -> list:
        """Remove and return peers whose connection broke and that have been silent since, for
        `retention_s`, with nothing in flight.

        A decode that restarts on new ports (SGLang binds random ones) leaves its old engine key
        here for good otherwise: one entry, planner and engine registration per restart.
        """
        now = self._clock()
        removed = []
        with self._lock:
            for key, peer in list(self._by_key.items()):
                if peer.broken_at is None or self.budget.count(key):
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
                if self._clock() - peer.failed_at < self.fail_fast_s:
                    return f"decode engine {key} failed recently: {peer.failed_reason}"
                # Past the fail-fast window: try again (a transient fault may have cleared).
                peer.failed_reason = None
                peer.failed_at = None
            return None


class Admission(enum.Enum):
    """What `InflightBudget.acquire` decided for one write batch; truthy when it may be posted."""

    ADMITTED = "admitted"  # posted at once: nothing held for the peer and it fits
    ADMITTED_AFTER_HOLD = "admitted_after_hold"  # held, then posted once earlier writes finished
    TIMED_OUT = "timed_out"  # held until its deadline: never posted
    ABANDONED = "abandoned"  # held, and its room ended meanwhile: never posted (dropped)

    def __bool__(self) -> bool:
        return self in (Admission.ADMITTED, Admission.ADMITTED_AFTER_HOLD)

    @property
    def held(self) -> bool:
        return self is not Admission.ADMITTED


class InflightBudget:
    """Per decode peer, at most `limit` write batches and `byte_limit` bytes (0: no byte bound)
    posted and not yet terminal; one condition guards every count.

    A posted write cannot be withdrawn (neither MORI-IO nor softio has a cancel), and a peer's
    writes share ordered lanes: every byte posted toward a peer is sent before anything posted
    after it, also the bytes of a room decode has aborted meanwhile. The byte bound keeps what a
    newer room can find ahead of it to about `byte_limit`; a batch past it is held, not posted, and
    a held batch whose room ended is dropped without a byte sent (docs/reliability.md, issue 29).
    A batch larger than the bound is posted alone when nothing is in flight to the peer, so it
    never waits forever.

    The byte bound binds only for a stalled peer: one with writes in flight none of which has
    finished for `stall_s` (0: it always binds). A healthy link keeps finishing writes, and holding
    its batches back would only cost pipelining depth (a batch larger than the bound, as long chunks
    of large models on GPUs are, would go out one at a time); a slow or dead link stops finishing
    them, and from then on at most `byte_limit` more bytes are posted toward it.

    Held batches are admitted first come, first served per peer (a queue of tickets), so a large
    batch is not overtaken for ever by small ones. The submitter (a shard thread or the layer-wise
    worker) acquires, waiting up to its deadline; the completion thread gives back through the
    effects applier when the write is terminal (or given up on); the fast path, nothing held for
    the peer and room left, is a few dict reads under the condition."""

    def __init__(self, limit: int, clock: Callable[[], float] = time.monotonic, byte_limit: int = 0,
                 stall_s: float = 0.0):
        self.limit = limit
        self.byte_limit = byte_limit
        self.stall_s = stall_s
        self.use_clock(clock)
        # Held directly where nothing waits or is woken (`with self._mutex`): Condition's own
        # __enter__/__exit__ are two Python calls more a hold, on a lone request's way to the post.
        self._mutex = threading.RLock()
        self._cond = threading.Condition(self._mutex)
        self._counts: dict[str, int] = {}
        self._bytes: dict[str, int] = {}
        # peer -> when it last made progress: a write of it finished, or one was posted to it idle
        self._progress: dict[str, float] = {}
        self._held: dict[str, collections.deque] = {}  # peer -> tickets of held batches, oldest first
        # Held batches of every peer. Read without the lock by `wake` (a stale 0 is harmless: a
        # holder counts itself before it checks whether its room ended).
        self.holding = 0

    @classmethod
    def from_config(cls, cfg) -> "InflightBudget":
        """The budget a MoriConfig asks for (SGLANG_MORI_MAX_INFLIGHT_PER_PEER, _BYTES_PER_PEER)."""
        return cls(cfg.max_inflight_per_peer, byte_limit=cfg.max_inflight_bytes_per_peer,
                   stall_s=cfg.peer_stall_ms / 1000.0)

    def use_clock(self, clock: Callable[[], float]) -> None:
        self._clock = clock

    def _fits_locked(self, key: str, nbytes: int) -> bool:
        if self._counts.get(key, 0) >= self.limit:
            return False
        if not self.byte_limit:
            return True
        posted = self._bytes.get(key, 0)
        if posted == 0 or posted + nbytes <= self.byte_limit:
            return True
        return self.stall_s > 0 and self._clock() - self._progress.get(key, 0.0) < self.stall_s

    def stalled(self, key: str) -> bool:
        """Writes in flight to `key` and none finished for `stall_s` (the byte bound binds)."""
        with self._mutex:
            if not self._counts.get(key):
                return False
            return self.stall_s <= 0 or self._clock() - self._progress.get(key, 0.0) >= self.stall_s

    def _take_locked(self, key: str, nbytes: int) -> None:
        if not self._counts.get(key):
            self._progress[key] = self._clock()  # an idle peer: its clock starts with this write
        self._counts[key] = self._counts.get(key, 0) + 1
        if nbytes:
            self._bytes[key] = self._bytes.get(key, 0) + nbytes

    def acquire(self, key: str, deadline: float, nbytes: int = 0,
                abandoned: Optional[Callable[[], bool]] = None) -> Admission:
        """Room for one batch of `nbytes` toward `key`, waiting (held) up to `deadline`;
        `abandoned()` (checked while held, when woken) says its room ended: give up at once."""
        with self._cond:
            if key not in self._held and self._fits_locked(key, nbytes):
                self._take_locked(key, nbytes)
                return Admission.ADMITTED
            ticket = object()
            queue = self._held.setdefault(key, collections.deque())
            queue.append(ticket)
            self.holding += 1
            try:
                while True:
                    if abandoned is not None and abandoned():
                        return Admission.ABANDONED
                    if queue[0] is ticket and self._fits_locked(key, nbytes):
                        self._take_locked(key, nbytes)
                        return Admission.ADMITTED_AFTER_HOLD
                    remaining = deadline - self._clock()
                    if remaining <= 0:
                        return Admission.TIMED_OUT
                    self._cond.wait(remaining)
            finally:
                queue.remove(ticket)
                if not queue:
                    del self._held[key]
                self.holding -= 1
                self._cond.notify_all()  # the next held batch may fit now

    def try_acquire(self, key: str, nbytes: int = 0) -> bool:
        """Room for one batch now, as `acquire` admits one at once; False (nothing taken, nothing
        queued) when `acquire` would hold it."""
        with self._mutex:
            if key not in self._held and self._fits_locked(key, nbytes):
                self._take_locked(key, nbytes)
                return True
            return False

    def release(self, key: str, count: int = 1, nbytes: int = 0) -> None:
        with self._cond:
            self._progress[key] = self._clock()
            left = self._counts.get(key, 0) - count
            if left > 0:
                self._counts[key] = left
            else:
                self._counts.pop(key, None)
            if nbytes:
                left = self._bytes.get(key, 0) - nbytes
                if left > 0:
                    self._bytes[key] = left
                else:
                    self._bytes.pop(key, None)
            self._cond.notify_all()

    def wake(self) -> None:
        """A room ended: held batches look again whether theirs was it (nothing to do when none is held)."""
        if self.holding:
            with self._cond:
                self._cond.notify_all()

    def count(self, key: str) -> int:
        with self._mutex:
            return self._counts.get(key, 0)

    def posted_bytes(self, key: str) -> int:
        with self._mutex:
            return self._bytes.get(key, 0)

    def idle(self) -> bool:
        """No write in flight to any peer, so none is stalled. Read without the lock (one
        dict's emptiness): a caller acting on an answer gone stale must tolerate a peer that
        stalls right after, as the submitter does (a held write is caught where it would wait)."""
        return not self._counts

    def total(self) -> int:
        with self._mutex:
            return sum(self._counts.values())

    def total_bytes(self) -> int:
        with self._mutex:
            return sum(self._bytes.values())

    def snapshot(self) -> dict:
        with self._mutex:
            return dict(self._counts)
