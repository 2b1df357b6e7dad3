"""Prometheus metrics of the MORI-IO transfer backend (names prefixed ``sglang_mori_``).

The backend makes one ``TransferMetrics`` per KV manager and calls it at a handful of points::

    m = create_transfer_metrics(enabled, engine_type="prefill", tp_rank=0)
    t0 = m.transfer_started(peer_key)                 # a chunk of a room is submitted to a peer
    m.transfer_finished(peer_key, nbytes, time.monotonic() - t0, ok=False, reason="timeout")
    m.request_finished(ok=False, reason="peer_dead")  # a room reached Success or Failed
    m.retry("submit_error"); m.set_queue_depth(n); m.peer_up(key); m.peer_down(key)
    m.writes_held(nbytes); m.writes_dropped(nbytes)   # the per-peer byte budget held / dropped a write
    m.set_open_rooms(n)                               # each pass of the completion / status thread

Failures are counted at two levels that never overlap: ``sglang_mori_transfer_failures_total``
(each failed transfer, from ``transfer_finished``) and ``sglang_mori_failures_total`` (each failed
request, from ``request_finished(ok=False, reason=...)`` or ``failure(reason)``; call one of the two
per failed request). A room whose transfer failed therefore shows once in each.

Why it looks the way it does:

* SGLang runs with prometheus-client's *multiprocess mode* when ``--enable-metrics`` is on: it sets
  ``PROMETHEUS_MULTIPROC_DIR`` in the launcher before starting the scheduler processes, the
  schedulers (where KV managers live) write samples to mmap files there, and the HTTP server
  process merges those files on ``/metrics``. prometheus-client chooses its value store when
  ``prometheus_client.values`` is first imported, so this module imports prometheus-client only when
  metrics are created, never at import time (the plugin is loaded before SGLang sets the variable).
* In that mode a Gauge needs a ``multiprocess_mode``. We use ``mostrecent``, as SGLang's own
  scheduler gauges do, and give every series the rank labels SGLang uses, so each scheduler
  process owns distinct series and a restarted process simply overwrites its predecessor's
  (``livesum`` would need ``mark_process_dead``, which SGLang never calls). ``mostrecent`` forbids
  ``inc``/``dec``, so gauges are computed here and written with ``set``.
* Creating a metric twice in one registry raises "Duplicated timeseries". The collectors are
  therefore created once per registry and remembered *on the registry object*, so two managers in
  one process (role switch), or this module imported twice under different names, share them.
* Label values are bounded: failure and retry reasons are folded into ``FAILURE_REASONS``; peers
  are never a label (engine keys carry a pid and a uuid), only counted.
"""

from __future__ import annotations

import threading
import time
from collections import Counter as _Tally
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Set, Tuple

from sglang_mori.backend import failure_reasons

PREFIX = "sglang_mori_"

# The only values the "reason" label may take: the failure causes of backend/failure_reasons.py (anything
# else is counted as "other").
FAILURE_REASONS = failure_reasons.ALL

# The only values the layer-wise fallback "reason" label may take (anything else is "other").
LAYERWISE_FALLBACK_REASONS = (
    "deployment",  # streaming unsupported by this deployment (PP, CP, staging, hybrid state, ...)
    "speculative",  # speculative decoding: draft forwards share the batch
    "two_batch_overlap",  # TBO splits a batch: a layer's hook fires once per micro-batch
    "pending_bootstrap",  # optimistic prefill: the request's destination is not known yet
    "not_ready",  # the room takes no writes now (no metadata yet, concluded, rejected peer)
    "below_min_tokens",  # fewer new tokens than SGLANG_MORI_LAYERWISE_MIN_TOKENS
    "short_batch",  # the batch computes fewer tokens than SGLANG_MORI_LAYERWISE_MIN_BATCH_TOKENS
    "unaligned_prefix",  # decode's prefix length is not page-aligned
    "decode_context_parallel",  # a decode rank of the room relays tokens out (DCP): sent chunk-wise
    "unmapped_pool",  # a layer's KV tensors are not among the registered buffers
    "no_layer_hook",  # the forward never called the attention hook (e.g. a graph without it)
    "other",
)

# Rank labels, named as in SGLang's scheduler metrics so the two can be joined in queries.
RANK_LABELS = ("engine_type", "tp_rank", "pp_rank", "dp_rank")

# KV transfers span ~50 us (a few pages over XGMI) to tens of seconds (long prompts, slow peers).
LATENCY_BUCKETS_S = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)

_REGISTRY_ATTR = "_sglang_mori_collectors"
_CREATE_LOCK = threading.Lock()


def normalize_reason(reason: Optional[str]) -> str:
    """Fold a free-form reason into the bounded label set (case-insensitive, '-' == '_')."""
    if not reason:
        return "other"
    key = str(reason).strip().lower().replace("-", "_")
    return key if key in FAILURE_REASONS else "other"


@dataclass
class _SeriesState:
    """What one label set's gauges are computed from; shared by managers with the same labels."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    inflight_by_peer: _Tally = field(default_factory=_Tally)
    peers: Set[str] = field(default_factory=set)


class _Collectors:
    """The prometheus objects of one registry, created once."""

    def __init__(self, registry: Any) -> None:
        # Imported here, not at module import: see the module docstring.
        from prometheus_client import Counter, Gauge, Histogram

        kw = {"registry": registry}
        gauge_kw = {"registry": registry, "multiprocess_mode": "mostrecent"}
        self.transfers = Counter(
            PREFIX + "transfers", "KV transfers (one chunk of a room to one peer) by outcome.",
            RANK_LABELS + ("outcome",), **kw)
        self.bytes = Counter(
            PREFIX + "transfer_bytes", "Bytes of KV cache written by successful transfers.",
            RANK_LABELS, **kw)
        self.requests = Counter(
            PREFIX + "requests", "KV requests (rooms) that reached a terminal state, by outcome.",
            RANK_LABELS + ("outcome",), **kw)
        self.latency = Histogram(
            PREFIX + "transfer_latency_seconds",
            "Submit-to-completion time of successful transfers.",
            RANK_LABELS, buckets=LATENCY_BUCKETS_S, **kw)
        self.failures = Counter(
            PREFIX + "failures", "KV requests (rooms) that failed, by reason.",
            RANK_LABELS + ("reason",), **kw)
        self.transfer_failures = Counter(
            PREFIX + "transfer_failures", "Transfers that failed, by reason.",
            RANK_LABELS + ("reason",), **kw)
        self.retries = Counter(
            PREFIX + "retries", "Transfer submissions retried, by reason.",
            RANK_LABELS + ("reason",), **kw)
        self.peer_down = Counter(
            PREFIX + "peer_down", "Peers declared down.", RANK_LABELS, **kw)
        self.layerwise_writes = Counter(
            PREFIX + "layerwise_writes", "KV writes submitted from the layer-wise hook (one per room, "
            "decode peer and layer group).", RANK_LABELS, **kw)
        self.layerwise_fallbacks = Counter(
            PREFIX + "layerwise_fallbacks", "Requests or batches of a layer-wise deployment sent chunk-wise "
            "instead, by reason.", RANK_LABELS + ("reason",), **kw)
        self.layerwise_late = Counter(
            PREFIX + "layerwise_late_destinations", "Requests of an optimistic prefill (SGLang's "
            "--optimistic-prefill-attempts) whose decode destinations arrived during their forward and "
            "that joined its layer-wise stream there (catch-up writes for the layers already computed).",
            RANK_LABELS, **kw)
        self.layerwise_late_after_hooks = Counter(
            PREFIX + "layerwise_late_after_hooks", "Of the layerwise_late_destinations joins, those made "
            "after the forward's layer hooks ran (the forward launched; the destinations arrived before "
            "SGLang's send() for the request).", RANK_LABELS, **kw)
        self.held_bytes = Counter(
            PREFIX + "held_bytes", "Bytes of KV writes held back by a decode peer's byte budget "
            "(SGLANG_MORI_MAX_INFLIGHT_BYTES_PER_PEER) before they were posted or dropped.", RANK_LABELS, **kw)
        self.dropped_bytes = Counter(
            PREFIX + "dropped_bytes", "Bytes of held KV writes never posted: their room ended (or their "
            "deadline passed) while they were held.", RANK_LABELS, **kw)
        self.inflight = Gauge(
            PREFIX + "inflight_transfers", "Transfers submitted and not yet finished.",
            RANK_LABELS, **gauge_kw)
        self.inflight_max_peer = Gauge(
            PREFIX + "inflight_max_per_peer",
            "In-flight transfers to the busiest peer (compare with SGLANG_MORI_MAX_INFLIGHT_PER_PEER).",
            RANK_LABELS, **gauge_kw)
        self.queue_depth = Gauge(
            PREFIX + "queue_depth", "Transfer chunks queued and not yet submitted.",
            RANK_LABELS, **gauge_kw)
        self.peers_up = Gauge(
            PREFIX + "peers_up", "Peers currently registered and not known to be down.",
            RANK_LABELS, **gauge_kw)
        self.open_rooms = Gauge(
            PREFIX + "open_rooms", "Rooms this rank's backend still holds, in any state (draining "
            "included); 0 once idle, so a room that is never released shows here.",
            RANK_LABELS, **gauge_kw)
        self.states: Dict[Tuple[str, ...], _SeriesState] = {}


def _collectors_for(registry: Any) -> _Collectors:
    with _CREATE_LOCK:
        found = getattr(registry, _REGISTRY_ATTR, None)
        if found is None:
            found = _Collectors(registry)
            setattr(registry, _REGISTRY_ATTR, found)
        return found


class TransferMetrics:
    """Metrics of one KV manager. Thread-safe: transfer workers may call it concurrently."""

    def __init__(self, engine_type: str, tp_rank: int = 0, pp_rank: int = 0, dp_rank: int = 0,
                 registry: Any = None) -> None:
        if registry is None:
            from prometheus_client import REGISTRY as registry  # noqa: N811 (see module docstring)
        self._c = _collectors_for(registry)
        self._labels = (str(engine_type), str(tp_rank), str(pp_rank), str(dp_rank))
        with _CREATE_LOCK:
            self._state = self._c.states.setdefault(self._labels, _SeriesState())
        self._publish_gauges()
        # Touch the outcome series so dashboards show 0 rather than "no data" before traffic.
        for outcome in ("ok", "failed"):
            self._c.transfers.labels(*self._labels, outcome)
            self._c.requests.labels(*self._labels, outcome)
        self._c.held_bytes.labels(*self._labels)
        self._c.layerwise_late.labels(*self._labels)
        self._c.layerwise_late_after_hooks.labels(*self._labels)
        self._c.dropped_bytes.labels(*self._labels)

    @property
    def labels(self) -> Dict[str, str]:
        return dict(zip(RANK_LABELS, self._labels))

    # ---- transfers ---------------------------------------------------------------------------
    def transfer_started(self, peer: str) -> float:
        """A transfer to ``peer`` was submitted. Returns ``time.monotonic()`` for the latency."""
        with self._state.lock:
            self._state.inflight_by_peer[peer] += 1
            self._publish_inflight_locked()
        return time.monotonic()

    def transfer_finished(self, peer: str, nbytes: int, seconds: float, ok: bool,
                          reason: Optional[str] = None) -> None:
        """A transfer started with ``transfer_started(peer)`` reached a terminal state."""
        with self._state.lock:
            left = self._state.inflight_by_peer[peer] - 1
            if left > 0:
                self._state.inflight_by_peer[peer] = left
            else:  # also tolerates a finish without a start: never negative
                self._state.inflight_by_peer.pop(peer, None)
            self._publish_inflight_locked()
        if ok:
            self._c.transfers.labels(*self._labels, "ok").inc()
            self._c.bytes.labels(*self._labels).inc(max(0, int(nbytes)))
            self._c.latency.labels(*self._labels).observe(max(0.0, float(seconds)))
        else:
            self._c.transfers.labels(*self._labels, "failed").inc()
            self._c.transfer_failures.labels(*self._labels, normalize_reason(reason)).inc()

    def writes_held(self, nbytes: int) -> None:
        """A write of ``nbytes`` waited for its peer's budget (posted later, or dropped)."""
        self._c.held_bytes.labels(*self._labels).inc(max(0, int(nbytes)))

    def writes_dropped(self, nbytes: int) -> None:
        """A held write of ``nbytes`` was never posted."""
        self._c.dropped_bytes.labels(*self._labels).inc(max(0, int(nbytes)))

    def failure(self, reason: Optional[str]) -> None:
        """Count one failed request by reason (use this or ``request_finished``'s reason, not both)."""
        self._c.failures.labels(*self._labels, normalize_reason(reason)).inc()

    def retry(self, reason: Optional[str]) -> None:
        self._c.retries.labels(*self._labels, normalize_reason(reason)).inc()

    def request_finished(self, ok: bool, reason: Optional[str] = None) -> None:
        """A room reached Success (ok) or Failed. With ``reason``, a failure is also counted by
        reason; without, the caller counts it with ``failure(reason)``."""
        self._c.requests.labels(*self._labels, "ok" if ok else "failed").inc()
        if not ok and reason is not None:
            self.failure(reason)

    # ---- layer-wise streaming ------------------------------------------------------------------
    def layerwise_writes(self, n: int = 1) -> None:
        if n > 0:
            self._c.layerwise_writes.labels(*self._labels).inc(n)

    def layerwise_fallback(self, reason: str, n: int = 1) -> None:
        label = reason if reason in LAYERWISE_FALLBACK_REASONS else "other"
        if n > 0:
            self._c.layerwise_fallbacks.labels(*self._labels, label).inc(n)

    def layerwise_late_destinations(self, n: int = 1) -> None:
        if n > 0:
            self._c.layerwise_late.labels(*self._labels).inc(n)

    def layerwise_late_after_hooks(self, n: int = 1) -> None:
        if n > 0:
            self._c.layerwise_late_after_hooks.labels(*self._labels).inc(n)

    # ---- queues and peers --------------------------------------------------------------------
    def set_queue_depth(self, n: int) -> None:
        self._c.queue_depth.labels(*self._labels).set(max(0, int(n)))

    def set_open_rooms(self, n: int) -> None:
        self._c.open_rooms.labels(*self._labels).set(max(0, int(n)))

    def peer_up(self, key: str) -> None:
        """Idempotent: a peer that registers twice is one peer."""
        with self._state.lock:
            self._state.peers.add(key)
            self._c.peers_up.labels(*self._labels).set(len(self._state.peers))

    def peer_down(self, key: str) -> None:
        """Counts a down event only for a peer that was up, so repeated reports count once."""
        with self._state.lock:
            was_up = key in self._state.peers
            self._state.peers.discard(key)
            self._c.peers_up.labels(*self._labels).set(len(self._state.peers))
        if was_up:
            self._c.peer_down.labels(*self._labels).inc()

    # ---- internals ---------------------------------------------------------------------------
    def _publish_inflight_locked(self) -> None:
        counts = self._state.inflight_by_peer
        self._c.inflight.labels(*self._labels).set(sum(counts.values()))
        self._c.inflight_max_peer.labels(*self._labels).set(max(counts.values(), default=0))

    def _publish_gauges(self) -> None:
        with self._state.lock:
            self._publish_inflight_locked()
            self._c.peers_up.labels(*self._labels).set(len(self._state.peers))
        self._c.queue_depth.labels(*self._labels)
        self._c.open_rooms.labels(*self._labels)


class NullTransferMetrics:
    """Same calls as ``TransferMetrics``, doing nothing: used when ``--enable-metrics`` is off,
    so the backend never branches on it and never imports prometheus-client needlessly."""

    @property
    def labels(self) -> Dict[str, str]:
        return {}

    def transfer_started(self, peer: str) -> float:
        return time.monotonic()

    def transfer_finished(self, peer: str, nbytes: int, seconds: float, ok: bool,
                          reason: Optional[str] = None) -> None:
        pass

    def writes_held(self, nbytes: int) -> None:
        pass

    def writes_dropped(self, nbytes: int) -> None:
        pass

    def failure(self, reason: Optional[str]) -> None:
        pass

    def retry(self, reason: Optional[str]) -> None:
        pass

    def request_finished(self, ok: bool, reason: Optional[str] = None) -> None:
        pass

    def layerwise_writes(self, n: int = 1) -> None:
        pass

    def layerwise_fallback(self, reason: str, n: int = 1) -> None:
        pass

    def layerwise_late_destinations(self, n: int = 1) -> None:
        pass

    def layerwise_late_after_hooks(self, n: int = 1) -> None:
        pass

    def set_queue_depth(self, n: int) -> None:
        pass

    def set_open_rooms(self, n: int) -> None:
        pass

    def peer_up(self, key: str) -> None:
        pass

    def peer_down(self, key: str) -> None:
        pass


def create_transfer_metrics(enabled: bool, engine_type: str, tp_rank: int = 0, pp_rank: int = 0,
                            dp_rank: int = 0, registry: Any = None):
    """``TransferMetrics`` when metrics are on (SGLang's ``--enable-metrics``), else a no-op twin."""
    if not enabled:
        return NullTransferMetrics()
    return TransferMetrics(engine_type, tp_rank, pp_rank, dp_rank, registry=registry)
