"""Long runs on the copy engines: SGLang's page size 1 hands a fresh request one contiguous run of
slots, so the backend's plans are a few long ranges, which softio's device path copies with the copy
engines (ranges of SGLANG_MORI_SOFTIO_CE_MIN_BYTES and more) and the rest with its gather kernel, on
one stream before the batch's event. Prefill on GPU 0, decode on GPU 1 (the peer link): every decode
byte must equal the prefill's, chunk-wise and layer-wise, with the route counted so that the test
fails if the copy engines were never used. Skipped where fewer than two GPUs are visible."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from link_bench import device_engine
from pd_rig import GpuPD, Requests

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")

TOKENS, REQUESTS = 4096, 2  # GQA: 8 MiB per layer's K; MLA: 4.5 MiB per layer (both over 1 MiB)


@pytest.fixture(scope="module", params=["gqa", "mla"])
def rig(request):
    with GpuPD(request.param, 1, TOKENS * REQUESTS, decode_device=1) as rig:
        yield rig


def step(rig, reqs, layerwise: bool, seed: int):
    dev = device_engine(rig)
    before = (dev.ce_ranges, dev.ranges)
    result = rig.prefill_batch(reqs, layerwise=layerwise, seed=seed)
    assert not result.failures, result.failures
    # one digest per request and side (every buffer's bytes of its slots in order): page by page
    # would take seconds at page size 1
    torch.cuda.synchronize(rig.prefill.device)
    bad = sum(rig.prefill.pool.digest(reqs.src[i]) != rig.ask("digest", [int(p) for p in reqs.dst[i]])
              for i in range(reqs.count))
    rig.release(rig.last_rooms)
    return bad, dev.ce_ranges - before[0], (dev.ranges - before[1]) - (dev.ce_ranges - before[0])


@pytest.mark.parametrize("layerwise", [False, True], ids=["chunk-wise", "layer-wise"])
def test_whole_request_runs_cross_on_the_copy_engines_byte_exact(rig, layerwise):
    reqs = Requests(1, TOKENS, REQUESTS, 0, np.random.default_rng(11 + layerwise), run=TOKENS)
    bad, ce_ranges, kernel_ranges = step(rig, reqs, layerwise, 11 + layerwise)
    assert bad == 0  # requests whose decode bytes differ
    assert ce_ranges >= rig.shape.layers  # at least one long range per layer went to the copy engines
    assert kernel_ranges == 0


@pytest.mark.parametrize("layerwise", [False, True], ids=["chunk-wise", "layer-wise"])
def test_long_and_scattered_requests_in_one_step_byte_exact(rig, layerwise):
    """One request one run, the other's destinations scattered slot by slot: both routes in a step."""
    rng = np.random.default_rng(21 + layerwise)
    reqs = Requests(1, TOKENS, REQUESTS, 0, rng, run=TOKENS)
    reqs.dst[1] = reqs.dst[1][rng.permutation(TOKENS)]
    bad, ce_ranges, kernel_ranges = step(rig, reqs, layerwise, 21 + layerwise)
    assert bad == 0
    assert ce_ranges > 0 and kernel_ranges > 0
