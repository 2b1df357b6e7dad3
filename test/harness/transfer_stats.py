"""KV bytes moved and transfer time per request, for the demo and the PD latency benchmark.

HOOK (backend-facing): this reads the backend's Prometheus counters from the prefill server's
/metrics (the prefill needs --enable-metrics): `sglang_mori_transfer_bytes_total` and
`sglang_mori_transfer_latency_seconds_sum`, before and after one request; the difference is that
request's KV traffic. It is exact only when requests run one at a time, as in the demo. If the
backend later reports per-request figures in `meta_info` (for example `kv_transfer_bytes` and
`kv_transfer_ms`), read them in `from_meta_info` below and prefer them: they are exact under
concurrency too. Other backends (mooncake_tcp) have no such counters: the figures are then None.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import requests

BYTES_METRIC = "sglang_mori_transfer_bytes_total"
SECONDS_METRIC = "sglang_mori_transfer_latency_seconds_sum"


@dataclass
class KVTransfer:
    nbytes: int
    seconds: float

    def describe(self) -> str:
        size = f"{self.nbytes / 1024:.1f} KiB" if self.nbytes < 1 << 20 else f"{self.nbytes / (1 << 20):.2f} MiB"
        return f"{size} in {self.seconds * 1000:.1f} ms"


def from_meta_info(meta: Dict) -> Optional[KVTransfer]:
    """Per-request figures if the backend puts them in meta_info (not yet: keys are provisional)."""
    if "kv_transfer_bytes" in meta and "kv_transfer_ms" in meta:
        return KVTransfer(int(meta["kv_transfer_bytes"]), float(meta["kv_transfer_ms"]) / 1000)
    return None


def _scrape(url: str) -> Optional[Dict[str, float]]:
    """Sum every series of our two metrics (labels are ranks; one rank here).

    Empty before the first transfer (the collectors appear with it); None if /metrics is unreachable.
    """
    try:
        text = requests.get(f"{url}/metrics", timeout=5).text
    except requests.RequestException:
        return None
    totals: Dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in (BYTES_METRIC, SECONDS_METRIC):
            totals[name] = totals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return totals


class TransferProbe:
    """Counter snapshot around one request: `before()`, run the request, `after()`."""

    def __init__(self, prefill_url: str):
        self.prefill_url = prefill_url
        self._start: Optional[Dict[str, float]] = None

    def before(self) -> None:
        self._start = _scrape(self.prefill_url)

    def after(self, meta: Optional[Dict] = None) -> Optional[KVTransfer]:
        exact = from_meta_info(meta or {})
        if exact is not None:
            return exact
        end = _scrape(self.prefill_url)
        if self._start is None or not end or BYTES_METRIC not in end:
            return None  # unreachable, or a backend without these counters
        return KVTransfer(int(end[BYTES_METRIC] - self._start.get(BYTES_METRIC, 0.0)),
                          end.get(SECONDS_METRIC, 0.0) - self._start.get(SECONDS_METRIC, 0.0))
