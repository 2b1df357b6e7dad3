"""Layer-wise streaming under asynchrony, on a GPU: each layer's KV store is delayed on its stream
(torch.cuda._sleep before it), so the store runs well after the hook returned. Every decode byte
must still equal the source, because the worker waits on the layer's device event before it posts
the write. With that wait removed (no event handed to the worker) the same run must land stale
bytes: proof that the check can fail and that the event is what makes it correct. Also with the
forward on a side stream, as SGLang's overlap scheduler runs it."""

from __future__ import annotations

import numpy as np
import pytest

from sglang_mori.backend.prefill.layerwise import hooks
from sglang_mori.backend.prefill.layerwise.session import group_ends

from pd_rig import GpuPD, Requests

DELAY_CYCLES = 2_000_000  # ~1 ms of GPU time before each layer's store
TOKENS, REQUESTS, PAGE = 512, 2, 64


@pytest.fixture(scope="module", params=[1, 0], ids=["group-1", "halving-groups"])
def rig(request):
    with GpuPD("mla", PAGE, pages=64, group_size=request.param) as r:
        r.group_size = request.param
        yield r


def writes_per_forward(rig) -> int:
    """Layer-wise writes of one forward of REQUESTS requests (one decode peer)."""
    layers = rig.shape.layers
    return REQUESTS * (layers if rig.group_size == 1 else len(group_ends(layers)))


def run(rig, seed: int, **kw):
    reqs = Requests(PAGE, TOKENS, REQUESTS, 0, np.random.default_rng(seed))
    writes_before = rig.prefill.metrics.layerwise
    result = rig.prefill_batch(reqs, seed=seed, **kw)
    streamed = rig.prefill.metrics.layerwise - writes_before
    bad = rig.mismatched_pages(reqs)
    rig.release(rig.last_rooms)
    assert not result.failures, result.failures
    return streamed, bad


@pytest.mark.parametrize("side_stream", [False, True], ids=["default-stream", "side-stream"])
def test_streamed_kv_equals_the_source_although_every_store_is_late(rig, side_stream):
    streamed, bad = run(rig, 11 + side_stream, layerwise=True, side_stream=side_stream,
                        store_delay_cycles=DELAY_CYCLES)
    assert streamed == writes_per_forward(rig), "the layers were not streamed"
    assert bad == 0


@pytest.mark.parametrize("side_stream", [False, True], ids=["default-stream", "side-stream"])
def test_without_the_event_wait_streamed_kv_is_stale(rig, monkeypatch, side_stream):
    monkeypatch.setattr(hooks, "_layer_event", lambda tensor: None)
    streamed, bad = run(rig, 21 + side_stream, layerwise=True, side_stream=side_stream,
                        store_delay_cycles=DELAY_CYCLES)
    assert streamed == writes_per_forward(rig)
    assert bad > 0, "no stale page although the worker did not wait for the stores"


def test_chunk_wise_sends_equal_the_source(rig):
    streamed, bad = run(rig, 31, layerwise=False, store_delay_cycles=DELAY_CYCLES)
    assert streamed == 0 and bad == 0
