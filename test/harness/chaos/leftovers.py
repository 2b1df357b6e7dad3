"""What a server still holds once the load is over: requests, our backend's in-flight state, open
descriptors, memory, and connections across the prefill-decode link.

Requests come from SGLang's /v1/loads (every queue, PD bootstrap and transfer queues included),
our in-flight writes and queued chunks from the backend's gauges on /metrics (`--enable-metrics`;
absent for other backends), descriptors and RSS from /proc for every process of the server's
process group (the HTTP server, its scheduler and detokenizer), connections with `ss` inside the
server's network namespace.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

from harness import client
from harness.chaos.hosts import Host

# Our gauges each role exports (the transfer shards, hence in-flight writes and queued chunks, are
# the prefill's).
OUR_GAUGES = {
    "prefill": ("sglang_mori_inflight_transfers", "sglang_mori_queue_depth", "sglang_mori_open_rooms"),
    "decode": ("sglang_mori_open_rooms",),
}


def group_pids(pgid: int) -> List[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                # pid (comm) state ppid pgrp ...; comm may hold spaces, so split after its ')'.
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid:
            pids.append(int(entry))
    return pids


def _fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def _rss_mib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return 0.0


def connections_to(host: Host, peer_addr: str) -> int:
    """Established TCP connections on `host` whose remote end is `peer_addr`."""
    done = subprocess.run(host.prefix() + ["ss", "-Htn", "state", "established", "dst", peer_addr],
                          capture_output=True, text=True, timeout=30)
    return len([ln for ln in done.stdout.splitlines() if ln.strip()])


def our_gauges(url: str, names: Sequence[str]) -> Dict[str, float]:
    """Our backend's gauges on `url`/metrics, summed over ranks; NaN for one that is not exported
    (a missing series must not read as 0)."""
    import requests
    from prometheus_client.parser import text_string_to_metric_families

    found: Dict[str, float] = {}
    try:
        r = requests.get(f"{url}/metrics", timeout=10)
        r.raise_for_status()
        for family in text_string_to_metric_families(r.text):
            for s in family.samples:
                if s.name in names:
                    found[s.name] = found.get(s.name, 0.0) + s.value
    except Exception:
        pass
    return {name: found.get(name, float("nan")) for name in names}


@dataclass
class Snapshot:
    pid: Optional[int]
    requests: int = -1  # -1: the server did not answer
    gauges: Dict[str, float] = field(default_factory=dict)
    fds: int = 0
    rss_mib: float = 0.0
    link_conns: int = 0

    def idle(self) -> bool:
        """No request held and none of our gauges above 0 (or missing)."""
        return self.requests == 0 and all(v == 0 for v in self.gauges.values())


def snapshot(role: str, url: str, pgid: Optional[int], host: Host, peer_addr: str, ours: bool) -> Snapshot:
    snap = Snapshot(pgid)
    try:
        snap.requests = client.requests_in_server(url)
    except Exception:
        snap.requests = -1
    if ours:
        snap.gauges = our_gauges(url, OUR_GAUGES[role])
    pids = group_pids(pgid) if pgid else []
    snap.fds = sum(_fds(p) for p in pids)
    snap.rss_mib = sum(_rss_mib(p) for p in pids)
    snap.link_conns = connections_to(host, peer_addr)
    return snap


@dataclass(frozen=True)
class Bounds:
    """What may remain after a fault, against the snapshot taken after the warm-up load."""

    fd_growth: int = 64
    rss_growth_mib: float = 512.0
    extra_link_conns: int = 16


def leftover_problems(now: Snapshot, base: Snapshot, bounds: Bounds) -> List[str]:
    """Each way `now` exceeds the bounds (empty: no leftovers). A restarted server (another pid)
    is compared with its own fresh state only for requests and backend state."""
    problems = []
    if now.requests != 0:
        problems.append(f"{now.requests} requests held" if now.requests > 0 else "server not answering")
    for name, value in now.gauges.items():
        if value != 0:
            problems.append(f"{name}={value:g}")
    if now.pid == base.pid:
        if now.fds - base.fds > bounds.fd_growth:
            problems.append(f"fds +{now.fds - base.fds}")
        if now.rss_mib - base.rss_mib > bounds.rss_growth_mib:
            problems.append(f"RSS +{now.rss_mib - base.rss_mib:.0f} MiB")
    if now.link_conns - base.link_conns > bounds.extra_link_conns:
        problems.append(f"link connections +{now.link_conns - base.link_conns}")
    return problems
