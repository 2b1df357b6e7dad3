"""Standalone and prefill-decode (PD) deployments of real SGLang servers on this host.

A deployment owns its processes: `start()` launches them, `wait_ready()` polls their health
endpoints against a deadline, `stop()` tears everything down (idempotent, also after a failure).
Logs go to one file per process under `log_dir`; `tails()` returns the end of each for reports.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import requests

from harness import launch
from harness.procs import ManagedProcess, stop_together, wait_until

Progress = Optional[Callable[[str, float], None]]
STOP_GRACE_S = 3.0


def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    try:
        return requests.get(url, timeout=timeout_s).status_code == 200
    except requests.RequestException:
        return False


class Deployment:
    """A set of named processes started and stopped together."""

    def __init__(self, log_dir: Path):
        self.log_dir = Path(log_dir)
        self.procs: Dict[str, ManagedProcess] = {}

    def _spawn(self, name: str, argv: List[str], env: Dict[str, str]) -> ManagedProcess:
        proc = ManagedProcess(name, argv, env, self.log_dir / f"{name}.log").start()
        self.procs[name] = proc
        return proc

    def _wait_http(self, name: str, url: str, deadline_s: float, progress: Progress) -> float:
        proc = self.procs[name]
        cb = (lambda elapsed: progress(name, elapsed)) if progress else None
        try:
            return wait_until(lambda: http_ok(url), deadline_s, name, alive=proc.alive, progress=cb)
        except (TimeoutError, RuntimeError) as exc:
            raise RuntimeError(f"{exc}\n--- {name} log tail ---\n{proc.tail()}") from exc

    def stop(self) -> None:
        # All at once (the router signalled first, so no new traffic reaches servers going away).
        # A short grace: SIGTERM ends a server's scheduler at once, and its launcher then sleeps 5 s
        # "before crash diagnostics" before it exits; nothing of use happens in that time.
        stop_together([self.procs[name] for name in sorted(self.procs, key=lambda n: n != "router")],
                      grace_s=STOP_GRACE_S)

    def log_text(self, name: str) -> str:
        """Everything process `name` has logged so far."""
        return self.procs[name].log_path.read_text(errors="replace")

    def tails(self, lines: int = 60) -> str:
        return "\n".join(
            f"--- {name} ({proc.log_path}) ---\n{proc.tail(lines)}" for name, proc in self.procs.items()
        )

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


class Standalone(Deployment):
    """One ordinary (non-disaggregated) SGLang server: the reference for PD outputs."""

    def __init__(self, opts: launch.ServerOptions, log_dir: Path, ports: Optional[set] = None,
                 name: str = "standalone", sleep_on_idle: bool = False):
        super().__init__(log_dir)
        self.opts = opts
        self.name = name
        # An idle SGLang scheduler spins on a full core. The reference server may sleep in a zmq
        # poll instead (a new request wakes it at once), leaving the 2-core host to the PD servers
        # under test. PD servers get the flag through ServerOptions.sleep_on_idle (the e2e tests
        # set it; SGLang 0.5.23's idle check counts their bootstrap, transfer and in-flight queues).
        self.sleep_on_idle = sleep_on_idle
        (self.port,) = launch.pick_free_ports(1, ports)
        self.url = f"http://{launch.HOST}:{self.port}"

    def start(self) -> "Standalone":
        env = launch.base_env(None, self.opts.extra_env)
        argv = launch.standalone_argv(self.opts, self.port)
        self._spawn(self.name, argv + (["--sleep-on-idle"] if self.sleep_on_idle and not self.opts.sleep_on_idle
                                       else []), env)
        return self

    def wait_ready(self, deadline_s: float = 300.0, progress: Progress = None) -> None:
        self._wait_http(self.name, f"{self.url}/health", deadline_s, progress)


class PDDeployment(Deployment):
    """Prefill server + decode server + sglang_router in PD mode, all on 127.0.0.1."""

    def __init__(self, opts: launch.ServerOptions, backend: str, log_dir: Path,
                 ports: Optional[set] = None, env: Optional[Dict[str, str]] = None):
        super().__init__(log_dir)
        if backend not in launch.BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; one of {launch.BACKENDS}")
        self.opts = opts
        self.backend = backend
        self.env = launch.base_env(backend, {**opts.extra_env, **(env or {})})
        (self.prefill_port, self.bootstrap_port, self.decode_port, self.router_port,
         self.metrics_port) = launch.pick_free_ports(5, ports)
        self.prefill_url = f"http://{launch.HOST}:{self.prefill_port}"
        self.decode_url = f"http://{launch.HOST}:{self.decode_port}"
        self.router_url = f"http://{launch.HOST}:{self.router_port}"

    # -- servers -------------------------------------------------------------------------------
    def start_servers(self) -> "PDDeployment":
        self.start_prefill()
        self._spawn("decode", launch.decode_argv(self.opts, self.decode_port, self.backend), self.env)
        return self

    def start_prefill(self) -> None:
        argv = launch.prefill_argv(self.opts, self.prefill_port, self.bootstrap_port, self.backend)
        self._spawn("prefill", argv, self.env)

    def wait_prefill(self, deadline_s: float = 300.0, progress: Progress = None) -> float:
        return self._wait_http("prefill", f"{self.prefill_url}/health", deadline_s, progress)

    def wait_servers(self, deadline_s: float = 300.0, progress: Progress = None) -> None:
        start = time.monotonic()
        self.wait_prefill(deadline_s, progress)
        remaining = deadline_s - (time.monotonic() - start)
        self._wait_http("decode", f"{self.decode_url}/health", remaining, progress)

    # -- router --------------------------------------------------------------------------------
    def start_router(self) -> None:
        # Started with the servers: its own start-up (25-55 s on a loaded 2-core host, most of it
        # Python imports) overlaps theirs. It polls workers that are not up yet every second
        # (its default: every 30 s) until they are.
        argv = launch.router_argv(self.router_port, self.prefill_port, self.bootstrap_port,
                                  self.decode_port, self.metrics_port,
                                  extra=["--worker-startup-check-interval", "1"])
        self._spawn("router", argv, self.env)

    def wait_router(self, deadline_s: float = 120.0, progress: Progress = None) -> None:
        # /readiness turns 200 once the router sees healthy prefill and decode workers.
        self._wait_http("router", f"{self.router_url}/readiness", deadline_s, progress)

    def start(self) -> "PDDeployment":
        self.start_servers()
        self.start_router()
        return self

    def wait_ready(self, deadline_s: float = 300.0, progress: Progress = None) -> None:
        start = time.monotonic()
        self.wait_servers(deadline_s, progress)
        self.wait_router(max(30.0, deadline_s - (time.monotonic() - start)), progress)

    # -- fault injection -----------------------------------------------------------------------
    def kill_prefill(self) -> None:
        """SIGKILL the prefill server's whole process group: a crash, no clean shutdown."""
        self.procs["prefill"].kill_hard()

    def restart_prefill(self, deadline_s: float = 300.0, progress: Progress = None) -> float:
        """A new prefill server on the same HTTP and bootstrap ports; returns its start-up time."""
        self.procs["prefill"].stop()
        self.start_prefill()
        return self.wait_prefill(deadline_s, progress)


@contextmanager
def standalone_and_pd(opts: launch.ServerOptions, backend: str, log_dir: Path,
                      pd_extra_args: Sequence[str] = (), env: Optional[Dict[str, str]] = None,
                      deadline_s: float = 300.0, registry: Optional[List[Deployment]] = None
                      ) -> Iterator[Tuple[Standalone, PDDeployment]]:
    """A standalone reference server and a PD deployment of the same model, started together (the
    reference sleeps when idle) and stopped on exit whatever happens. `registry`, if given, lists
    them while they run (the e2e conftest attaches their log tails to failure reports)."""
    ports: set = set()
    standalone = Standalone(opts, log_dir, ports, sleep_on_idle=True)
    pd_opts = dataclasses.replace(opts, extra_args=list(opts.extra_args) + list(pd_extra_args))
    pd = PDDeployment(pd_opts, backend, log_dir, ports, env=env)
    if registry is not None:
        registry.extend([standalone, pd])
    try:
        standalone.start()
        pd.start()
        standalone.wait_ready(deadline_s)
        pd.wait_ready(deadline_s)
        yield standalone, pd
    finally:
        if registry is not None:
            for d in (standalone, pd):
                if d in registry:
                    registry.remove(d)
        # In parallel: each SGLang server takes seconds to exit after SIGTERM.
        stoppers = [threading.Thread(target=d.stop, name=f"stop-{type(d).__name__}") for d in (pd, standalone)]
        for t in stoppers:
            t.start()
        for t in stoppers:
            t.join()
