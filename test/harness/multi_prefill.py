"""A PD deployment with several prefill servers, one decode server and sglang_router, on 127.0.0.1:
what the router's circuit breaker is for (one prefill dies, the others go on serving).

Each server is a named process (prefill0, prefill1, ..., decode, router) that can be killed on
its own; the router's Prometheus listener is on `metrics_url` (its per-worker breaker and health
gauges: smg_worker_cb_state, smg_worker_health).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Set

import requests

from harness import launch
from harness.deployment import Deployment, Progress
from harness.procs import wait_until


class MultiPrefillPD(Deployment):
    def __init__(self, opts: launch.ServerOptions, backend: str, log_dir: Path, prefills: int = 2,
                 env: Optional[Dict[str, str]] = None, router_args: Sequence[str] = ()):
        super().__init__(log_dir)
        if backend not in launch.BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; one of {launch.BACKENDS}")
        self.opts, self.backend = opts, backend
        self.env = launch.base_env(backend, {**opts.extra_env, **(env or {})})
        self.router_args = list(router_args)
        ports = launch.pick_free_ports(2 * prefills + 3)
        self.prefill_ports: List[int] = ports[:prefills]
        self.bootstrap_ports: List[int] = ports[prefills:2 * prefills]
        self.decode_port, self.router_port, self.metrics_port = ports[2 * prefills:]
        self.prefill_urls = [f"http://{launch.HOST}:{p}" for p in self.prefill_ports]
        self.decode_url = f"http://{launch.HOST}:{self.decode_port}"
        self.router_url = f"http://{launch.HOST}:{self.router_port}"
        self.metrics_url = f"http://{launch.HOST}:{self.metrics_port}"

    def start(self) -> "MultiPrefillPD":
        for i, (port, boot) in enumerate(zip(self.prefill_ports, self.bootstrap_ports)):
            self._spawn(f"prefill{i}", launch.prefill_argv(self.opts, port, boot, self.backend), self.env)
        self._spawn("decode", launch.decode_argv(self.opts, self.decode_port, self.backend), self.env)
        # The router with the servers, as in harness.deployment.PDDeployment: its own start-up (20 s
        # and more on the loaded 2-core host, Python imports) overlaps theirs instead of following it;
        # until its workers are up it looks for them every second (its default: every 30 s).
        argv = launch.pd_router_argv(self.router_port, list(zip(self.prefill_urls, self.bootstrap_ports)),
                                     [self.decode_url], self.metrics_port,
                                     extra=["--worker-startup-check-interval", "1", *self.router_args])
        self._spawn("router", argv, self.env)
        return self

    def wait_ready(self, deadline_s: float = 300.0, progress: Progress = None) -> None:
        end = time.monotonic() + deadline_s
        for i, url in enumerate(self.prefill_urls):
            self._wait_http(f"prefill{i}", f"{url}/health", end - time.monotonic(), progress)
        self._wait_http("decode", f"{self.decode_url}/health", end - time.monotonic(), progress)
        # /readiness turns 200 once the router sees healthy prefill and decode workers.
        self._wait_http("router", f"{self.router_url}/readiness", max(30.0, end - time.monotonic()), progress)
        # It finds each worker on its own retry schedule, so readiness may come with one prefill
        # only: wait until every prefill is a healthy worker of it (tests expect each one to serve).
        wait_until(lambda: self.healthy_workers() >= set(self.prefill_ports), max(30.0, end - time.monotonic()),
                   "router lists every prefill as healthy", alive=self.procs["router"].alive)

    def healthy_workers(self) -> Set[int]:
        """Ports of the servers the router lists as healthy workers (its smg_worker_health gauge)."""
        from prometheus_client.parser import text_string_to_metric_families

        try:
            text = requests.get(f"{self.metrics_url}/metrics", timeout=5).text
        except requests.RequestException:
            return set()
        ports = set(self.prefill_ports) | {self.decode_port}
        return {port for family in text_string_to_metric_families(text) for s in family.samples
                if s.name == "smg_worker_health" and s.value == 1.0
                for port in ports if any(f":{port}" in v for v in s.labels.values())}

    def kill(self, name: str) -> None:
        """SIGKILL the process group of server `name`: a crash, nothing cleaned up."""
        self.procs[name].kill_hard()
