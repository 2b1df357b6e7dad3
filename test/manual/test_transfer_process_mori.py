"""The prefill transfer process (SGLANG_MORI_TRANSFER_PROCESS) on real MORI-IO: the child imports the
prefill KV pools from this process with HIP IPC, registers them with its own IOEngine, proves the
registration at start-up (a probe write from every pool, transfer_process/proof.py), then moves one
request's KV into decode's GPU pool; the bytes that arrived are compared with prefill's pages.

This is risk 1 (RDMA: `ibv_reg_mr` of an IPC-imported address) and risk 3 (XGMI) of docs/design.md,
"A transfer process", run end to end. A child that cannot register its pools must refuse with the
reason (the scheduler then keeps its transfers in-process): that refusal fails this test with the
reason in its message, which is the result to report.
"""

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from manual_support import REPO, require_node

pytestmark = pytest.mark.manual
sys.path.insert(0, str(REPO / "test" / "inprocess"))  # fake_sglang, waiting

PAGES = 64
PAGE_BYTES = 4096
BUFFERS = 4
AUX_BYTES = 64
WAIT_S = 60.0


def _gpu_pool(torch, device: int, fill: bool):
    gen = torch.Generator(device=f"cuda:{device}").manual_seed(5)
    if fill:
        return [torch.randint(1, 256, (PAGES * PAGE_BYTES,), dtype=torch.uint8, device=f"cuda:{device}",
                              generator=gen) for _ in range(BUFFERS)]
    return [torch.zeros(PAGES * PAGE_BYTES, dtype=torch.uint8, device=f"cuda:{device}") for _ in range(BUFFERS)]


def _args(kv, aux):
    return SimpleNamespace(
        kv_data_ptrs=[t.data_ptr() for t in kv], kv_data_lens=[t.numel() for t in kv],
        kv_item_lens=[PAGE_BYTES] * len(kv), aux_data_ptrs=[aux.ctypes.data], aux_data_lens=[aux.nbytes],
        aux_item_lens=[AUX_BYTES], page_size=1, kv_cache_dtype_str="bfloat16")


@pytest.mark.parametrize("transport", ["rdma", "xgmi"])
def test_the_transfer_process_moves_a_request_from_imported_gpu_pools(transport):
    require_node(gpus=1, rdma=(transport == "rdma"))
    import numpy as np
    import torch
    import zmq

    from sglang_mori.backend import room_status as S
    from sglang_mori.backend import sglang_fields as fields
    from sglang_mori.backend.decode.service import AuxSlots, DecodeIdentity, DecodeParts, DecodeService
    from sglang_mori.backend.messenger import Messenger
    from sglang_mori.backend.plans import LocalBuffers, encode_layout, local_layout
    from sglang_mori.config import MoriConfig
    from sglang_mori.engine import EngineSettings, TransferEngine, load_io_module
    from sglang_mori.metrics import NullTransferMetrics
    from sglang_mori.transfer_process.child import ChildSpec
    from sglang_mori.transfer_process.client import TransferProcess
    from sglang_mori.transfer_process.pools import describe
    from sglang_mori.transfer_process.scheduler_service import TransferProcessService

    from fake_sglang import FakeSGLang
    from waiting import wait_until

    prefill_gpu, decode_gpu = 0, min(1, torch.cuda.device_count() - 1)
    config = MoriConfig(engine="mori", transfer_process=True, xgmi=(transport == "xgmi"), transfer_timeout_ms=20000)
    EngineSettings.for_gpu(None, prefill_gpu, xgmi=config.xgmi, resolve=fields.ib_devices_for_gpu).apply()

    prefill_kv, decode_kv = _gpu_pool(torch, prefill_gpu, True), _gpu_pool(torch, decode_gpu, False)
    prefill_aux = np.arange(8 * AUX_BYTES, dtype=np.uint8)
    decode_aux = np.zeros(8 * AUX_BYTES, dtype=np.uint8)
    torch.cuda.synchronize()
    prefill_args, decode_args = _args(prefill_kv, prefill_aux), _args(decode_kv, decode_aux)
    imports = describe(prefill_args.kv_data_ptrs, prefill_args.kv_data_lens, True, prefill_gpu)
    assert {p.kind for p in imports} == {"hip"}, imports
    spec = ChildSpec(config=config, layout=encode_layout(local_layout(prefill_args, 1, 0, False)), kv=imports,
                     on_gpu=True, device=prefill_gpu, host="127.0.0.1", control_host="127.0.0.1",
                     table_name="", table_slots=0, parent_pid=0)
    process = TransferProcess(spec, slots=64)  # raises with the child's reason if it cannot prove its pools
    sglang, decode_sglang = FakeSGLang(), FakeSGLang()
    service = TransferProcessService(process, sglang, read_aux=lambda i: [
        prefill_aux[i * AUX_BYTES:(i + 1) * AUX_BYTES].tobytes()])
    ctx = zmq.Context()
    engine = TransferEngine(load_io_module("mori"), role="decode", host="127.0.0.1", qp_per_transfer=2,
                            post_batch_size=-1, num_workers=1)
    buffers = LocalBuffers(kv=[engine.register(t.data_ptr(), t.numel(), decode_gpu, True) for t in decode_kv],
                           aux=[engine.register(decode_aux.ctypes.data, decode_aux.nbytes, -1, False)], state=[])
    socket = ctx.socket(zmq.PULL)
    port = socket.bind_to_random_port("tcp://127.0.0.1")
    decode = DecodeService(DecodeParts(
        config=config, engine=engine, local=buffers, layout=local_layout(decode_args, 1, 0, False),
        identity=DecodeIdentity("127.0.0.1", port, 1, 0),
        aux=AuxSlots(list(decode_args.aux_data_ptrs), [AUX_BYTES], [decode_aux.nbytes]),
        messenger=Messenger(ctx), metrics=NullTransferMetrics(), sglang=decode_sglang, control_socket=socket,
    ), lambda err, origin: None)
    to_prefill = Messenger(ctx)
    room, src, dst = 7, [3, 10, 11, 40], [5, 6, 60, 1]
    try:
        decode.start()
        to_prefill.send(("127.0.0.1", process.port), decode.registration())
        decode_sglang.open(room)
        decode.new_receiver(room)
        to_prefill.send(("127.0.0.1", process.port), decode.record_destination(
            bootstrap_room=room, required_dst_info_num=1, kv_indices=np.asarray(dst), aux_index=2,
            state_indices=None, decode_prefix_len=None, is_dummy=False))
        sglang.open(room)
        assert service.claim(room) is None

        def status():
            service.sync(room)
            return sglang.status(room)

        wait_until(lambda: status() == S.WAITING_FOR_INPUT, "WaitingForInput on prefill", WAIT_S)
        service.add_chunk(room, np.asarray(src), slice(0, len(src)), True, aux_index=1)
        wait_until(lambda: status() in (S.SUCCESS, S.FAILED), "prefill's verdict", WAIT_S)
        assert status() == S.SUCCESS, sglang.failure_reason(room)
        wait_until(lambda: decode_sglang.status(room) == S.SUCCESS, "decode's Success", WAIT_S)
        torch.cuda.synchronize()
        for b in range(BUFFERS):
            for s, d in zip(src, dst):
                sent = prefill_kv[b][s * PAGE_BYTES:(s + 1) * PAGE_BYTES].cpu().numpy().tobytes()
                got = decode_kv[b][d * PAGE_BYTES:(d + 1) * PAGE_BYTES].cpu().numpy().tobytes()
                assert got == sent, f"{transport}: buffer {b} page {s} -> {d} differs"
        assert decode_aux[2 * AUX_BYTES:3 * AUX_BYTES].tobytes() == prefill_aux[AUX_BYTES:2 * AUX_BYTES].tobytes()
    finally:
        service.stop()
        decode.stop()
        to_prefill.close()
        socket.close(linger=0)
        engine.close()
        ctx.destroy(linger=0)
