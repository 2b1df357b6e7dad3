"""Tensor parallelism with real SGLang servers on CPU: a prefill at TP 2 into a decode at TP 1.

The prefill runs `--tp 2` (two scheduler processes, torch.distributed over gloo); the decode runs TP 1.
Each prefill rank holds one of the tiny model's 2 KV heads and our backend writes it into its slice
of decode's 2-head pages (head slicing between real processes, one engine per prefill rank). Greedy
outputs must be token-identical to a TP 1 standalone server on the same checkpoint; the tiny model's
weights are a safetensors file (harness/tiny_model.py), loaded shard by shard by every TP size, so
both sides compute with the same weights (`--load-format dummy` would fill each shard separately).

What SGLang needs to run TP 2 on CPU, besides the usual CPU recipe (harness/launch.py):
- `SGLANG_CPU_OMP_THREADS_BIND=0|1`: one core per rank (SGLang refuses more ranks than NUMA nodes
  without it; this host has one);
- the test-only plugin harness/cpu_hooks: SGLang picks `use_pynccl=True` for `--device cpu` and
  `PyNcclCommunicator` fails with "Expected a cuda device"; the hook passes `use_pynccl=False`.

This module starts its own standalone and PD servers and runs before the shared ones (own_servers).
"""

from __future__ import annotations

import dataclasses

import pytest

from harness import client, launch
from harness.deployment import PDDeployment, Standalone
from harness.failure_env import FAILURE_ENV
from harness.prompts import varied_prompts

pytestmark = [pytest.mark.e2e, pytest.mark.own_servers, pytest.mark.needs_backend("mori")]

MAX_NEW_TOKENS = 8
CHUNK = 64
PREFILL_TP = 2


class PrefillTP2(PDDeployment):
    """A PD deployment whose prefill alone runs at TP 2 (the decode keeps TP 1)."""

    def start_prefill(self) -> None:
        argv = launch.prefill_argv(self.opts, self.prefill_port, self.bootstrap_port, self.backend)
        env = {**self.env, "SGLANG_CPU_OMP_THREADS_BIND": "0|1"}
        self._spawn("prefill", argv + ["--tp", str(PREFILL_TP)], env)


@pytest.fixture(scope="module")
def tp_servers(e2e_backend, server_options, active_deployments, tmp_path_factory):
    """(standalone TP 1, PD with prefill TP 2 -> decode TP 1); stopped after the module's last test."""
    log_dir = tmp_path_factory.mktemp("e2e-tp-logs")
    ports: set = set()
    standalone = Standalone(server_options, log_dir, ports, sleep_on_idle=True)
    opts = dataclasses.replace(server_options, extra_args=["--enable-metrics"])
    env = {**FAILURE_ENV, "PYTHONPATH": launch.plugin_pythonpath(launch.CPU_HOOKS)}
    pd = PrefillTP2(opts, e2e_backend, log_dir, ports, env=env)
    active_deployments.extend([standalone, pd])
    try:
        standalone.start()
        pd.start()
        standalone.wait_ready(300)
        pd.wait_ready(400)
        yield standalone, pd
    finally:
        for d in (pd, standalone):
            active_deployments.remove(d)
            d.stop()
        print(f"\ne2e TP server logs: {log_dir}")


def _compare(standalone, pd, prompts, concurrency):
    refs = client.generate_many(standalone.url, prompts, MAX_NEW_TOKENS, concurrency=concurrency)
    ours = client.generate_many(pd.router_url, prompts, MAX_NEW_TOKENS, concurrency=concurrency)
    assert all(r.ok for r in refs), [(r.status, r.error[:200]) for r in refs if not r.ok]
    failed = [(i, r.status, r.error[:300]) for i, r in enumerate(ours) if not r.ok]
    assert not failed, f"TP 2 -> TP 1 PD requests failed: {failed}"
    mismatches = [f"prompt {i}: PD {o.output_ids} standalone {r.output_ids}"
                  for i, (o, r) in enumerate(zip(ours, refs)) if o.output_ids != r.output_ids]
    assert not mismatches, f"{len(mismatches)}/{len(prompts)} outputs differ:\n" + "\n".join(mismatches)
    return ours


def test_prefill_runs_tp2_and_decode_tp1(tp_servers):
    _, pd = tp_servers
    assert client.get_json(f"{pd.prefill_url}/get_server_info")["tp_size"] == PREFILL_TP
    assert client.get_json(f"{pd.decode_url}/get_server_info")["tp_size"] == 1


def test_prefill_tp2_outputs_match_standalone(tp_servers):
    """Single-chunk and multi-chunk prompts, one at a time, then four at once."""
    standalone, pd = tp_servers
    prompts = varied_prompts(24, seed=41)
    short = [p for p in prompts if len(p.split()) <= 20][:2]
    long = [p for p in prompts if len(p.split()) >= 120][:2]
    ours = _compare(standalone, pd, short + long, concurrency=1)
    tokens = [r.meta["prompt_tokens"] for r in ours]
    assert min(tokens) <= CHUNK < 2 * CHUNK < max(tokens), tokens
    _compare(standalone, pd, varied_prompts(4, seed=43), concurrency=4)
