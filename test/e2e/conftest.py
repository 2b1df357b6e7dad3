"""Fixtures for end-to-end tests: real SGLang servers on CPU with a tiny local model.

One standalone server of the tiny model (the reference) serves every e2e module that compares
against it (package scope): it starts with the first PD deployment that needs it, in parallel with
it, and sleeps when idle, so it costs no CPU while other modules run. One PD deployment (prefill +
decode + router) is shared by every test that needs no servers of its own; it starts after the
modules with their own servers have stopped theirs. Start-up costs 45-90 s on the 2-core host; the
one test that kills the shared prefill server brings a new one up on the same ports before it
ends, and runs last. Every server is stopped after the last e2e test whatever happens. Every e2e
server, PD ones included, runs with --sleep-on-idle (launch.ServerOptions.sleep_on_idle): an idle
scheduler would otherwise spin on one of the 2 cores while the other servers start or serve.

Backend: SGLANG_MORI_E2E_BACKEND, default `mori` (our plugin on the softio engine). `mooncake_tcp`
runs the same tests over SGLang's Mooncake backend, which is how the harness itself was validated.
On failure, the tail of every server log is attached to the report; full logs stay under the
session's tmp dir (path printed in the report).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import List

import pytest

from harness import launch
from harness.deployment import Deployment, PDDeployment, Standalone
from harness.failure_env import FAILURE_ENV
from harness.plugin_check import plugin_serves_mori
from harness.tiny_model import build_tiny_model

BACKEND = os.environ.get("SGLANG_MORI_E2E_BACKEND", "mori")
CHUNKED_PREFILL = 64

_ACTIVE: List[Deployment] = []
# Ports handed out to the servers that run side by side (the reference with any PD deployment): a
# port is free until its server binds it, 30-60 s into its start-up, so they must not pick twice.
_PORTS: set = set()


def pytest_configure(config):
    config.addinivalue_line("markers", "restarts_prefill: kills and restarts the shared prefill server; runs last")
    config.addinivalue_line("markers", "own_servers: a module with its own servers (not the shared ones); runs "
                            "first, so that they never share the host with the shared servers")
    config.addinivalue_line("markers", "needs_backend(name): only meaningful with that transfer backend")


def pytest_runtest_setup(item):
    marker = item.get_closest_marker("needs_backend")
    if marker and BACKEND not in marker.args:
        # Reported as skipped (never as passed), with the reason.
        pytest.skip(f"needs backend {' or '.join(marker.args)}; this run uses {BACKEND}")


def pytest_collection_modifyitems(config, items):
    # The destructive test goes after every e2e test that expects an untouched deployment, but stays
    # among the e2e tests (moving it past other directories would start the servers a second time).
    # Modules with their own servers go first: they start and stop theirs before the shared ones start
    # (an idle PD scheduler spins on a core, so two sets at once would halve the speed of both).
    here = Path(__file__).parent
    slots = [i for i, item in enumerate(items) if here in Path(item.path).parents]
    ordered = sorted((items[i] for i in slots),
                     key=lambda item: (item.get_closest_marker("own_servers") is None,
                                       item.get_closest_marker("restarts_prefill") is not None))
    for i, item in zip(slots, ordered):
        items[i] = item


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and _ACTIVE:
        logs = "\n".join(d.tails(40) for d in _ACTIVE)
        report.sections.append(("server logs (tail)", logs))


@pytest.fixture(scope="package")
def e2e_backend() -> str:
    if BACKEND not in ("mori", "mooncake_tcp"):
        pytest.fail(f"SGLANG_MORI_E2E_BACKEND={BACKEND!r}: use mori or mooncake_tcp", pytrace=False)
    if BACKEND == "mori":
        # Otherwise SGLang's own mori backend would run and fail on the missing `mori` module.
        ok, detail = plugin_serves_mori()
        if not ok:
            pytest.fail("SGLANG_MORI_E2E_BACKEND=mori but the sglang_mori plugin does not serve "
                        f"TransferBackend.MORI:\n{detail}\nSet SGLANG_MORI_E2E_BACKEND=mooncake_tcp "
                        "to run the harness over Mooncake/TCP.", pytrace=False)
    return BACKEND


@pytest.fixture(scope="package")
def active_deployments() -> List[Deployment]:
    """Deployments whose log tails a failing test's report gets; modules with own servers add theirs."""
    return _ACTIVE


@pytest.fixture(scope="package")
def tiny_model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="package")
def server_options(tiny_model) -> launch.ServerOptions:
    # Every e2e server sleeps when idle (launch.ServerOptions.sleep_on_idle says why).
    return launch.ServerOptions(model_dir=tiny_model, chunked_prefill_size=CHUNKED_PREFILL, sleep_on_idle=True)


@pytest.fixture(scope="package")
def reference_ports() -> set:
    """Pass to every deployment that runs beside the reference server (pick_free_ports updates it)."""
    return _PORTS


@pytest.fixture(scope="package")
def reference_server(server_options, tmp_path_factory):
    """The standalone reference server, started (not yet ready: PD fixtures start their servers
    meanwhile, then the `standalone` fixture waits for it); stopped after the last e2e test."""
    log_dir = tmp_path_factory.mktemp("e2e-reference-logs")
    server = Standalone(server_options, log_dir, _PORTS, sleep_on_idle=True)
    _ACTIVE.append(server)
    try:
        server.start()
        yield server
    finally:
        _ACTIVE.remove(server)
        server.stop()
        print(f"\ne2e reference server logs: {log_dir}")


@pytest.fixture(scope="package")
def standalone(reference_server) -> Standalone:
    reference_server.wait_ready(300)  # at once when it is up already
    return reference_server


@pytest.fixture(scope="package")
def pd(e2e_backend, server_options, reference_server, reference_ports, tmp_path_factory) -> PDDeployment:
    """The shared PD deployment (its start overlaps the reference's, if that is still starting)."""
    log_dir = tmp_path_factory.mktemp("e2e-logs")
    # --enable-metrics: the prefill's /metrics then carries the backend's transfer counters.
    # --enable-pd-role-switch: test_pd_role_switch flips the decode server's role and back.
    opts = dataclasses.replace(server_options, extra_args=list(server_options.extra_args)
                               + ["--enable-metrics", "--enable-pd-role-switch"])
    dep = PDDeployment(opts, e2e_backend, log_dir, ports=reference_ports, env=FAILURE_ENV)
    _ACTIVE.append(dep)
    try:
        dep.start()
        dep.wait_ready(300)
        yield dep
    finally:
        _ACTIVE.remove(dep)
        dep.stop()
        print(f"\ne2e server logs: {log_dir}")
