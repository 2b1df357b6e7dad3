"""A prefill at TP 2 running SGLang's overlap scheduler, into a decode at TP 1, real servers on CPU.

Tensor parallelism: the prefill runs `--tp 2` (two scheduler processes, torch.distributed over gloo);
the decode runs TP 1. Each prefill rank holds one of the tiny model's 2 KV heads and our backend
writes it into its slice of decode's 2-head pages (head slicing between real processes, one engine
per prefill rank). The tiny model's weights are a safetensors file (harness/tiny_model.py) that every
TP size loads shard by shard, so both sides compute with the same weights (`--load-format dummy`
would fill each shard separately and the outputs could not be compared).

Overlap scheduler: the prefill also runs it (the shared PD deployment does not), with chunk-wise
sends (layer-wise off): SGLang launches chunk k+1's forward before it processes chunk k's result and
calls send() for it, and a radix-cache prefix hit sends its cached pages early. Layer-wise streaming
under the overlap scheduler is covered by test_pd_layerwise.py, whose deployment also runs it.

Greedy outputs must be token-identical to a TP 1 standalone server on the same checkpoint.

What SGLang needs on CPU for this, besides the usual CPU recipe (harness/launch.py):
- `SGLANG_CPU_OMP_THREADS_BIND=0|1`: one core per rank (SGLang refuses more ranks than NUMA nodes
  without it; this host has one);
- the test-only plugin harness/cpu_hooks (see its README): SGLang picks `use_pynccl=True` for
  `--device cpu` and `PyNcclCommunicator` fails with "Expected a cuda device", the hook passes
  `use_pynccl=False`; and the overlap scheduler's early send of cached pages records a
  `torch.cuda.Event` (`maybe_send_cached_prefix_chunk`, RuntimeError: expected stream to be a
  torch.Stream or torch.cuda.Stream object), which the hook skips on CPU, where the forward is
  synchronous and the event orders nothing. Without that hook test_prefix_hit_matches_standalone
  fails: the prefill scheduler dies at prefill.py:1497 `ev.record(self.forward_stream)` with that
  RuntimeError and decode answers 500 "Decode handshake failed ... KVTransferError".

DP attention (`--tp 2 --dp 2 --enable-dp-attention`) cannot run on CPU with this SGLang install, so
no test here uses it (the integration tests in test/integration/test_dp_attention.py cover our
backend under DP attention with SGLang's real classes). Tried on a standalone server of the tiny
model with the hooks above: it starts, then both schedulers die in the first forward (the warm-up
request). DP attention pads every rank's batch to a common size before the forward
(`ForwardBatch.prepare_mlp_sync_batch`), and:
1. `_pad_inputs_to_size` (model_executor/forward_batch_info.py:2016) asks the attention backend for
   `get_cuda_graph_seq_len_fill_value()`; torch_native, the only attention backend that runs on CPU
   without the CPU build of sgl-kernel, does not implement it: `NotImplementedError`
   (layers/attention/base_attn_backend.py:288).
2. With a test hook returning 1 there (what the GPU backends return), the next line fails:
   `torch.tensor(global_num_tokens, pin_memory=True)` (forward_batch_info.py:1949) raises
   `RuntimeError: Found no NVIDIA driver on your system`. SGLang pins memory there unless `_is_cpu`,
   which is true only with `SGLANG_USE_CPU_ENGINE=1`; that switch routes the model through
   sgl-kernel's CPU ops and fails at import with `No module named 'sgl_kernel'` (its CPU build is
   not on PyPI). `_is_cpu` is a module constant, not a function a HookRegistry hook could replace.

KV bytes: the measurement plugin scripts/gpu_sglang/kv_hash.py (the one the GPU runs use) is loaded
on both PD sides here; it hashes each room's KV per layer on every prefill rank and on decode, decode
sliced by the prefill ranks' heads, and the last test requires every room to match byte for byte.

This module starts its own PD servers and runs before the shared ones (own_servers); its reference
is the shared standalone server (TP 1, sleeping when idle).
"""

from __future__ import annotations

import dataclasses
import re

import pytest

from harness import client, launch
from harness.deployment import PDDeployment
from harness.failure_env import FAILURE_ENV
from harness.kv_hash_plugin import KV_HASH, kv_hash_plugin_env
from harness.outputs import assert_same_tokens
from harness.prompts import varied_prompts

pytestmark = [pytest.mark.e2e, pytest.mark.own_servers, pytest.mark.needs_backend("mori")]

MAX_NEW_TOKENS = 16
CHUNK = 64
PREFILL_TP = 2


class PrefillTP2(PDDeployment):
    """A PD deployment whose prefill alone runs at TP 2 (the decode keeps TP 1)."""

    def start_prefill(self) -> None:
        argv = launch.prefill_argv(self.opts, self.prefill_port, self.bootstrap_port, self.backend)
        env = {**self.env, "SGLANG_CPU_OMP_THREADS_BIND": "0|1"}
        self._spawn("prefill", argv + ["--tp", str(PREFILL_TP)], env)


@pytest.fixture(scope="module")
def tp_servers(e2e_backend, server_options, reference_server, reference_ports, active_deployments,
               tmp_path_factory):
    """(the shared standalone TP 1, PD with prefill TP 2 + overlap -> decode TP 1); the PD is stopped
    after the module's last test."""
    log_dir = tmp_path_factory.mktemp("e2e-tp-logs")
    opts = dataclasses.replace(server_options, extra_args=["--enable-metrics"], prefill_overlap=True)
    kv_dir = tmp_path_factory.mktemp("e2e-tp-kv-hash")
    env = {**FAILURE_ENV, "SGLANG_MORI_LAYERWISE": "off",
           **kv_hash_plugin_env(tmp_path_factory.mktemp("kv-hash-plugin"), kv_dir, prefill_tp=PREFILL_TP)}
    pd = PrefillTP2(opts, e2e_backend, log_dir, reference_ports, env=env)
    active_deployments.append(pd)
    try:
        pd.start()
        pd.wait_ready(400)
        reference_server.wait_ready(300)
        pd.kv_hash_dir = kv_dir
        yield reference_server, pd
    finally:
        active_deployments.remove(pd)
        pd.stop()
        print(f"\ne2e TP server logs: {log_dir}")


def _compare(standalone, pd, prompts, concurrency=1):
    refs = client.generate_many(standalone.url, prompts, MAX_NEW_TOKENS, concurrency=concurrency)
    ours = client.generate_many(pd.router_url, prompts, MAX_NEW_TOKENS, concurrency=concurrency)
    assert_same_tokens(refs, ours, "TP 2 -> TP 1 PD")
    return ours


def test_prefill_runs_tp2_with_the_overlap_scheduler(tp_servers):
    _, pd = tp_servers
    prefill = client.get_json(f"{pd.prefill_url}/get_server_info")
    assert (prefill["tp_size"], prefill["disable_overlap_schedule"]) == (PREFILL_TP, False)
    assert client.get_json(f"{pd.decode_url}/get_server_info")["tp_size"] == 1


def test_outputs_match_standalone(tp_servers):
    """One request at a time: single-chunk prompts and prompts of up to 5+ chunks (under the overlap
    scheduler chunk k+1's forward runs before chunk k is sent)."""
    standalone, pd = tp_servers
    ours = _compare(standalone, pd, varied_prompts(24, seed=17))
    tokens = [r.meta["prompt_tokens"] for r in ours]
    assert sum(t <= CHUNK for t in tokens) >= 4 and sum(t > 3 * CHUNK for t in tokens) >= 2, tokens
    # chunk-wise: nothing went through the layer hook
    assert client.metric_total(pd.prefill_url, "sglang_mori_layerwise_writes_total") == 0


def test_concurrent_outputs_match_standalone(tp_servers):
    """Eight at once: several requests' chunks in one batch, their sends interleaved with forwards."""
    standalone, pd = tp_servers
    _compare(standalone, pd, varied_prompts(8, seed=29), concurrency=8)


def test_prefix_hit_matches_standalone(tp_servers):
    """The second request hits the radix cache on prefill: its cached pages are sent early (the call
    the CPU hook lets run without a CUDA event), the rest after its forwards."""
    standalone, pd = tp_servers
    (long_prompt,) = [p for p in varied_prompts(24, seed=19) if len(p) > 1000][:1]
    _compare(standalone, pd, [long_prompt, long_prompt + " then the lane closes"])
    # SGLang logs each prefill batch's radix hit; only the repeated long prompt can hit a whole chunk
    hits = [int(n) for n in re.findall(r"#cached-token: (\d+)", pd.log_text("prefill"))]
    assert max(hits) >= CHUNK, sorted(set(hits))


def test_kv_bytes_equal_on_both_sides(tp_servers):
    """Each room's KV as prefill rank r holds it after Success equals decode's heads [r, r+1) of the
    room's pages after Success, every layer, K and V (every room of this module's requests)."""
    standalone, pd = tp_servers
    prompts = varied_prompts(4, seed=31)
    _compare(standalone, pd, prompts)
    got = KV_HASH.compare(pd.kv_hash_dir)
    assert got["rooms"] >= len(prompts) and got["rooms_matched"] == got["rooms"], got
    assert got["slices"] == PREFILL_TP * got["rooms"] and got["bytes_compared"] > 0, got
    assert (got["unsupported"], got["errors"], got["decode_slices_without_prefill"]) == ([], [], 0), got
