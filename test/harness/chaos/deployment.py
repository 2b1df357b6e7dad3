"""A PD deployment spread over the chaos hosts: prefill, decode and sglang_router each on its own
network host (hosts.py), each bound to its host's address, started and restarted by role.

Every server is told its own address (SGLANG_HOST_IP for SGLang's bootstrap and Mooncake,
SGLANG_MORI_HOST for our engine descriptor) and a node id of its own (MORI_NODE_ID): softio then
treats the peer as another machine and carries KV over TCP lanes across the prefill-decode link,
not through the shared-memory path it takes between processes of one node.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Dict, Optional, Sequence

from harness import launch
from harness.chaos.hosts import ADDRS, Topology
from harness.deployment import Deployment, Progress, http_ok

ROLES = ("prefill", "decode", "router")


class NetnsPD(Deployment):
    def __init__(self, opts: launch.ServerOptions, backend: str, log_dir: Path, topo: Topology,
                 env: Optional[Dict[str, str]] = None, router_args: Sequence[str] = ()):
        super().__init__(log_dir)
        self.router_args = list(router_args)  # failure-handling flags (harness.router_settings)
        if backend not in launch.BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; one of {launch.BACKENDS}")
        self.opts, self.backend, self.topo = opts, backend, topo
        self.extra_env = dict(env or {})
        # Each host is a fresh namespace: any port is free there; distinct ones keep logs readable.
        (self.prefill_port, self.bootstrap_port, self.decode_port, self.router_port,
         self.metrics_port) = launch.pick_free_ports(5)
        self.prefill_url = f"http://{ADDRS['prefill']}:{self.prefill_port}"
        self.decode_url = f"http://{ADDRS['decode']}:{self.decode_port}"
        self.router_url = f"http://{ADDRS['router']}:{self.router_port}"

    def _env(self, role: str) -> Dict[str, str]:
        addr = ADDRS[role]
        return launch.base_env(self.backend, {**self.opts.extra_env, **self.extra_env,
                                              "SGLANG_HOST_IP": addr, "SGLANG_MORI_HOST": addr,
                                              "MORI_NODE_ID": f"chaos-{role}-host"})

    def _argv(self, role: str):
        if role == "prefill":
            return launch.prefill_argv(self.opts, self.prefill_port, self.bootstrap_port, self.backend,
                                       host=ADDRS["prefill"])
        if role == "decode":
            return launch.decode_argv(self.opts, self.decode_port, self.backend, host=ADDRS["decode"])
        return launch.router_argv(self.router_port, self.prefill_port, self.bootstrap_port,
                                  self.decode_port, self.metrics_port, host=ADDRS["router"],
                                  prefill_host=ADDRS["prefill"], decode_host=ADDRS["decode"],
                                  # It may start before its workers are up (start()): it then looks
                                  # for them every second (its default: every 30 s) until they are.
                                  extra=["--worker-startup-check-interval", "1", *self.router_args])

    def _ready_url(self, role: str) -> str:
        if role == "router":  # 200 once it sees healthy prefill and decode workers
            return f"{self.router_url}/readiness"
        return f"{self.prefill_url if role == 'prefill' else self.decode_url}/health"

    # -- lifecycle ----------------------------------------------------------------------------
    def start_role(self, role: str) -> None:
        self._spawn(role, self.topo.hosts[role].prefix() + self._argv(role), self._env(role))

    def wait_role(self, role: str, deadline_s: float, progress: Progress = None) -> float:
        return self._wait_http(role, self._ready_url(role), deadline_s, progress)

    def start(self) -> "NetnsPD":
        # The router with the servers, as in harness.deployment.PDDeployment: its own start-up (about
        # 20 s on the loaded 2-core host, Python imports) then overlaps theirs instead of following it.
        for role in ROLES:
            self.start_role(role)
        return self

    def wait_ready(self, deadline_s: float = 300.0, progress: Progress = None) -> None:
        took = self.wait_role("prefill", deadline_s, progress)
        took += self.wait_role("decode", max(10.0, deadline_s - took), progress)
        self.wait_role("router", max(30.0, deadline_s - took), progress)

    # -- faults -------------------------------------------------------------------------------
    def pid(self, role: str) -> Optional[int]:
        return self.procs[role].pid if role in self.procs else None

    def signal(self, role: str, sig: int) -> None:
        """Signal the role's whole process group (server, scheduler, detokenizer)."""
        try:
            os.killpg(self.procs[role].pid, sig)
        except ProcessLookupError:
            pass

    def stall(self, role: str) -> None:
        self.signal(role, signal.SIGSTOP)

    def resume(self, role: str) -> None:
        self.signal(role, signal.SIGCONT)

    def kill(self, role: str) -> None:
        """SIGKILL the role's process group: a crash, nothing cleaned up."""
        self.procs[role].kill_hard()

    def serving(self, role: str, attempts: int = 3) -> bool:
        """Whether the role answers its readiness check, in one of `attempts` tries of up to 5 s: a
        loaded 2-core host can take seconds to answer SGLang's /health (a one-token generation)."""
        return any(http_ok(self._ready_url(role), timeout_s=5.0) for _ in range(attempts))

    def stop(self) -> None:
        for role in ROLES:  # a stopped group would not act on SIGTERM
            if role in self.procs and self.procs[role].alive():
                self.resume(role)
        super().stop()
