"""A prefill that dies for good is avoided within seconds, and the other keeps serving, with the
router settings scripts/launch_pd.sh gives (issue 29: 5 s before an open breaker half-opens instead
of the router's 60 s, health checks every 2 s instead of 60 s).

Two prefill servers, one decode server, sglang_router with harness.router_settings' launch_pd
flags, the tiny model. Both prefills serve; then one is SIGKILLed for good. Under steady traffic
(CLIENTS requests at a time, one after another):

- within 10 s of the kill the router no longer picks the dead prefill: its breaker is open or its
  health check has marked it unhealthy (the router's smg_worker_cb_state / smg_worker_health);
- every request sent meanwhile comes back (served after the router's retry, or failed with a
  cause), none hangs;
- from then on every request is served, by the other prefill, with the tokens it was given
  before the kill (greedy).

A request the router sends to the dead prefill is not refused at once: decode waits for that
prefill's bootstrap server (SGLang retries it for about 14 s) before the attempt fails, so it is
the health check, not the breaker, that takes the dead prefill out this fast (measured: 4.3 s, by
its health; with 5 s health checks the router logged the third miss 11 s after the kill). The test
guards that behaviour of the settings we ship; it does not show the 60 s breaker problem of issue
29, which only a decode or link fault brings out (scripts/chaos_pd.py).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional

import pytest
import requests

from harness import client
from harness.failure_env import FAILURE_ENV
from harness.multi_prefill import MultiPrefillPD
from harness.router_settings import router_flags

pytestmark = [pytest.mark.e2e, pytest.mark.own_servers]

AVOIDED_WITHIN_S = 10.0
TOKENS = 4
PROMPTS = [f"Request {i}: the weather report for town number {i} says" for i in range(12)]
CLIENTS = 4
REQUEST_S = 60.0  # bound of one request: the router's retries after a ~14 s bootstrap give-up fit
CB_OPEN = 1.0  # smg_worker_cb_state: 0 closed, 1 open, 2 half-open


@pytest.fixture(scope="module")
def two_prefills(e2e_backend, server_options, tmp_path_factory, active_deployments):
    opts = dataclasses.replace(server_options, extra_args=list(server_options.extra_args) + ["--enable-metrics"])
    dep = MultiPrefillPD(opts, e2e_backend, tmp_path_factory.mktemp("breaker-logs"), prefills=2,
                         env=FAILURE_ENV, router_args=router_flags("launch_pd"))
    active_deployments.append(dep)
    try:
        started = time.monotonic()
        dep.start().wait_ready(300.0)
        print(f"\ntwo-prefill deployment up in {time.monotonic() - started:.0f} s")
        yield dep
    finally:
        active_deployments.remove(dep)
        dep.stop()


def router_gauge(dep: MultiPrefillPD, name: str, port: int) -> Optional[float]:
    """The router's gauge `name` for the worker on `port` (None if the router has no such series)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(f"{dep.metrics_url}/metrics", timeout=5).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and any(f":{port}" in v for v in s.labels.values()):
                return s.value
    return None


def avoided(dep: MultiPrefillPD, port: int) -> bool:
    return (router_gauge(dep, "smg_worker_cb_state", port) == CB_OPEN
            or router_gauge(dep, "smg_worker_health", port) == 0.0)


def test_a_dead_prefill_is_avoided_within_seconds_and_the_other_keeps_serving(two_prefills):
    dep = two_prefills
    before: Dict[str, List[int]] = {}
    for p in PROMPTS:
        g = client.generate(dep.router_url, p, TOKENS, timeout_s=60)
        assert g.ok, g.error
        before[p] = g.output_ids
    served = [client.metric_total(url, "sglang:prompt_tokens_total") for url in dep.prefill_urls]
    assert all(n > 0 for n in served), f"both prefills should have served before the kill: {served}"
    assert not avoided(dep, dep.prefill_ports[0])

    dep.kill("prefill0")
    killed = time.monotonic()
    stop = threading.Event()
    during: List[client.Generation] = []

    def traffic(worker: int) -> None:
        i = worker
        while not stop.is_set():
            during.append(client.generate(dep.router_url, PROMPTS[i % len(PROMPTS)], TOKENS, timeout_s=REQUEST_S))
            i += CLIENTS

    with ThreadPoolExecutor(CLIENTS) as pool:
        for w in range(CLIENTS):
            pool.submit(traffic, w)
        try:
            while not avoided(dep, dep.prefill_ports[0]) and time.monotonic() - killed < AVOIDED_WITHIN_S:
                time.sleep(0.2)  # poll interval of the router's metrics
            took = time.monotonic() - killed
        finally:
            stop.set()  # the requests in flight finish (each bounded by REQUEST_S)
    state = {m: router_gauge(dep, m, dep.prefill_ports[0]) for m in ("smg_worker_cb_state", "smg_worker_health")}
    print(f"\ndead prefill avoided {took:.1f} s after the kill ({state}); {len(during)} requests meanwhile, "
          f"{sum(g.ok for g in during)} served: {sorted({g.error[:100] for g in during if not g.ok})}")
    assert took < AVOIDED_WITHIN_S, f"the dead prefill is still picked {took:.0f} s after the kill: {state}"
    hung = [g for g in during if g.status == 0 and "Timeout" in g.error]
    assert not hung, [g.error for g in hung]
    assert all(g.ok or g.error for g in during)

    after = {p: client.generate(dep.router_url, p, TOKENS, timeout_s=60) for p in PROMPTS}
    failed = {p: (g.status, g.error[:200]) for p, g in after.items() if not g.ok}
    assert not failed, failed
    assert {p: g.output_ids for p, g in after.items()} == before
    assert dep.procs["prefill1"].alive() and dep.procs["decode"].alive()
