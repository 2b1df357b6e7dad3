"""Optimistic prefill (`--optimistic-prefill-attempts 1` on the prefill server) with real SGLang
servers on CPU, our backend on softio, layer-wise streaming on, then chunk-wise.

With the flag, SGLang admits a request whose decode has not sent its destinations yet
(KVPoll.Bootstrapping) into a prefill batch with `req.pending_bootstrap`; its KV is sent once the
destinations arrive (`finalize_bootstrap`), or it waits parked after the forward. What must hold:
greedy outputs token-identical to the standalone server's with the optimistic path really taken
(SGLang's `#optimistic-req` in the prefill batch log) and requests joining the layer-wise stream
when their destinations arrive mid-forward (each prefill attention layer is stretched by a test
plugin so that they do), and a request whose decode never sends
destinations fails with its cause instead of hanging, after which the deployment still serves
identical outputs. The prefill runs the overlap scheduler, as on a GPU.
"""

from __future__ import annotations

import dataclasses
import random
import re
import time
from pathlib import Path

import pytest

from harness import client, launch
from harness.deployment import PDDeployment
from harness.outputs import assert_same_tokens
from harness.procs import wait_until
from harness.prompts import varied_prompts

pytestmark = [pytest.mark.e2e, pytest.mark.own_servers, pytest.mark.needs_backend("mori")]

MAX_NEW_TOKENS = 12
LAYER_DELAY_MS = 40
PROBE = Path(__file__).resolve().parents[1] / "harness" / "layerwise_probe"
BOOTSTRAP_TIMEOUT_S = 10  # as in the chaos test (SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT=10 under load)
OPTIMISTIC = re.compile(r"#optimistic-req: (\d+)")


# The layer-wise variant is `slow` (make test-all): CI keeps chunk-wise, the default, and the
# layer-wise join of late destinations mid-forward is covered in CI by
# test/inprocess/test_layerwise_late_destinations.py and test_layerwise_late_after_hooks.py.
@pytest.fixture(scope="module", params=[pytest.param("on", marks=pytest.mark.slow), "off"],
                ids=["layerwise", "chunkwise"])
def optimistic_pd(request, e2e_backend, server_options, reference_server, reference_ports, tmp_path_factory,
                  active_deployments):
    log_dir = tmp_path_factory.mktemp(f"optimistic-{request.param}-logs")
    env = {
        "SGLANG_MORI_LAYERWISE": request.param,
        "SGLANG_MORI_LAYERWISE_MIN_TOKENS": "1",
        "SGLANG_MORI_LAYERWISE_MIN_BATCH_TOKENS": "0",
        # A request whose destinations never come fails after this (SGLang's bootstrap timeout).
        "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": str(BOOTSTRAP_TIMEOUT_S),
        # The tiny model's forward is shorter than decode's bootstrap round trip: stretched (test
        # plugin harness/layerwise_probe), destinations arrive while it runs and the request joins
        # the layer-wise stream mid-forward.
        "SGLANG_MORI_PROBE_LAYER_DELAY_MS": str(LAYER_DELAY_MS),
        "PYTHONPATH": launch.plugin_pythonpath(PROBE, launch.CPU_HOOKS),
    }
    opts = dataclasses.replace(server_options, extra_args=["--enable-metrics"], prefill_overlap=True,
                               prefill_extra_args=["--optimistic-prefill-attempts", "1"])
    pd = PDDeployment(opts, e2e_backend, log_dir, ports=reference_ports, env=env)
    pd.layerwise = request.param
    active_deployments.append(pd)
    try:
        pd.start()
        pd.wait_ready(300)
        yield pd
    finally:
        active_deployments.remove(pd)
        pd.stop()
        print(f"\noptimistic e2e server logs: {log_dir}")


def _optimistic_batches(pd) -> int:
    """Prefill batches so far that carried at least one request still waiting for its destinations."""
    return sum(int(n) > 0 for n in OPTIMISTIC.findall(pd.log_text("prefill")))


def test_optimistic_outputs_match_standalone(standalone, optimistic_pd):
    prompts = varied_prompts(16, seed=41)
    before = _optimistic_batches(optimistic_pd)
    refs = [client.generate(standalone.url, p, MAX_NEW_TOKENS) for p in prompts]
    ours = [client.generate(optimistic_pd.router_url, p, MAX_NEW_TOKENS) for p in prompts]
    assert_same_tokens(refs, ours, "optimistic PD")
    refs = client.generate_many(standalone.url, prompts, MAX_NEW_TOKENS, concurrency=8)
    ours = client.generate_many(optimistic_pd.router_url, prompts, MAX_NEW_TOKENS, concurrency=8)
    assert_same_tokens(refs, ours, "optimistic PD at concurrency 8")
    taken = _optimistic_batches(optimistic_pd) - before
    late = client.metric_total(optimistic_pd.prefill_url, "sglang_mori_layerwise_late_destinations_total")
    pending = client.metric_total(optimistic_pd.prefill_url, "sglang_mori_layerwise_fallbacks_total",
                                  reason="pending_bootstrap")
    print(f"\nbatches with optimistic requests: {taken}; late destinations joined: {late}; "
          f"pending_bootstrap fallbacks: {pending}")
    assert taken > 0, "no prefill batch ran a request before its destinations arrived"
    assert "Unexpected poll state" not in optimistic_pd.log_text("prefill")
    if optimistic_pd.layerwise == "on":
        # Destinations that arrived mid-forward were streamed from there (SGLang still saw
        # WaitingForInput until its finalize_bootstrap: it raises on any other state there).
        assert late > 0, "no optimistic request joined the layer-wise stream mid-forward"
    else:
        assert late == 0 and pending == 0  # chunk-wise: no layer-wise session at all


def test_request_whose_decode_never_answers_fails_with_its_cause(standalone, optimistic_pd):
    """Straight to prefill with a room no decode knows: prefill runs it optimistically, parks it,
    and fails it at the bootstrap timeout with SGLang's reason; the deployment serves on."""
    room = random.Random(2718).getrandbits(62)
    extra = {"bootstrap_host": launch.HOST, "bootstrap_port": optimistic_pd.bootstrap_port, "bootstrap_room": room}
    before = _optimistic_batches(optimistic_pd)
    start = time.monotonic()
    gen = client.generate(optimistic_pd.prefill_url, "nobody decodes this one " * 8, 4,
                          timeout_s=BOOTSTRAP_TIMEOUT_S + 90, extra=extra)
    elapsed = time.monotonic() - start
    assert not gen.ok, "a request without destinations reported success"
    assert "Bootstrapping" in gen.error or "bootstrap" in gen.error.lower(), gen.error[:500]
    assert elapsed < BOOTSTRAP_TIMEOUT_S + 60, f"failed only after {elapsed:.0f} s"
    assert _optimistic_batches(optimistic_pd) > before, "the request was not prefilled optimistically"
    # nothing of it stays held on prefill: our room was released with the request
    wait_until(lambda: client.metric_total(optimistic_pd.prefill_url, "sglang_mori_open_rooms") == 0, 30,
               "prefill holds no room after the failed bootstrap")
    prompts = varied_prompts(6, seed=43)
    refs = [client.generate(standalone.url, p, MAX_NEW_TOKENS) for p in prompts]
    ours = [client.generate(optimistic_pd.router_url, p, MAX_NEW_TOKENS) for p in prompts]
    assert_same_tokens(refs, ours, "optimistic PD after a failed bootstrap")
