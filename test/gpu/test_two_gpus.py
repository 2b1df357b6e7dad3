"""Two GPUs of one host (the single-node PD of an AMD host, whose KV moves over XGMI; here the
GPUs' own link): prefill on GPU 0 and decode on GPU 1, and prefill at attention TP 2 (one rank per
GPU) into decode TP 1. Every decode byte must equal what the prefill ranks hold, with MHA heads
sliced across devices. The device ids travel through the registration path as SGLang passes its
`gpu_id`. Skipped (with the reason) where fewer than two GPUs are visible."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import sglang_mori.softio as io
from sglang_mori.engine import TransferEngine

from pd_rig import GpuPD, Requests

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")

TOKENS, REQUESTS = 512, 2
PAGE = {"mla": 64, "gqa": 16}


def run_and_check(rig, seed: int, layerwise: bool) -> int:
    reqs = Requests(rig.page_size, TOKENS, REQUESTS, 0, np.random.default_rng(seed))
    result = rig.prefill_batch(reqs, layerwise=layerwise, seed=seed)
    assert not result.failures, result.failures
    bad = rig.mismatched_pages(reqs)
    rig.release(rig.last_rooms)
    return bad


def pages_needed(shape_key: str) -> int:
    return REQUESTS * TOKENS // PAGE[shape_key]


@pytest.fixture(scope="module", params=["mla", "gqa"])
def cross_rig(request):
    with GpuPD(request.param, PAGE[request.param], pages_needed(request.param), decode_device=1) as rig:
        yield rig


@pytest.fixture(scope="module", params=["gqa", "mla"])
def tp2_rig(request):
    with GpuPD(request.param, PAGE[request.param], pages_needed(request.param), prefill_devices=(0, 1),
               decode_device=1) as rig:
        yield rig


def test_each_side_registers_its_own_gpu(cross_rig):
    ids, tensor_devices = cross_rig.ask("devices")
    assert set(ids) == {1} and tensor_devices == [1]
    assert {d.device_id for d in cross_rig.prefill.pool.buffers.kv} == {0}
    assert {t.device.index for t in cross_rig.prefill.pool.kv} == {0}


@pytest.mark.parametrize("layerwise", [False, True], ids=["chunk-wise", "layer-wise"])
def test_kv_crosses_to_the_other_gpu_byte_exact(cross_rig, layerwise):
    assert run_and_check(cross_rig, 3 + layerwise, layerwise) == 0


@pytest.mark.parametrize("layerwise", [False, True], ids=["chunk-wise", "layer-wise"])
def test_prefill_tp2_on_two_gpus_into_decode_tp1(tp2_rig, layerwise):
    assert [p.device for p in tp2_rig.prefills] == [0, 1]
    if not tp2_rig.shape.is_mla:  # each rank holds half of every token's heads
        assert [p.shape.kv_heads for p in tp2_rig.prefills] == [4, 4]
    assert run_and_check(tp2_rig, 7 + layerwise, layerwise) == 0


def test_tp2_check_reads_rank_1s_slice(tp2_rig):
    """The byte check can fail, and reads what it should: once rank 1's pool changes after the
    transfer, MHA pages differ (decode holds rank 1's old slice); MLA pages do not (decode reads
    the replicated latent from rank 0 only, rank 1 got dummy metadata)."""
    reqs = Requests(tp2_rig.page_size, TOKENS, REQUESTS, 0, np.random.default_rng(99))
    result = tp2_rig.prefill_batch(reqs, layerwise=False, seed=99)
    assert not result.failures
    for t in tp2_rig.prefills[1].pool.kv:
        t.add_(1)
    expected = 0 if tp2_rig.shape.is_mla else reqs.pages
    assert tp2_rig.mismatched_pages(reqs) == expected
    tp2_rig.release(tp2_rig.last_rooms)


def test_registering_under_another_gpus_id_is_refused():
    engine = TransferEngine(io, role="prefill", host="127.0.0.1", qp_per_transfer=1, post_batch_size=-1,
                            num_workers=1)
    t = torch.zeros(1 << 16, dtype=torch.uint8, device="cuda:0")
    with pytest.raises(RuntimeError, match="is on GPU 0 but was registered as device 1"):
        engine.register(t.data_ptr(), t.numel(), 1, True)
    assert engine.register(t.data_ptr(), t.numel(), 0, True) is not None
    engine.deregister_all()
