"""Conformance: descriptors, configs, ports and uids (no data moved)."""

from __future__ import annotations

import numpy as np
import pytest

from engine_peer import unique_key

pytestmark = pytest.mark.timeout(60)


def test_port_is_known_only_after_create_backend(io):
    engine = io.IOEngine(unique_key("port"), io.IOEngineConfig("127.0.0.1", 0))
    assert engine.get_engine_desc().port == 0
    engine.create_backend(io.BackendType.RDMA, io.RdmaBackendConfig())
    desc = engine.get_engine_desc()
    assert desc.port > 0
    assert desc.host == "127.0.0.1"
    engine.remove_backend(io.BackendType.RDMA)


def test_engine_desc_pack_round_trip(io, initiator, shared_peer):
    desc = initiator.engine.get_engine_desc()
    back = io.EngineDesc.unpack(desc.pack())
    assert back == desc
    assert (back.key, back.host, back.port, back.pid) == (desc.key, desc.host, desc.port, desc.pid)
    assert back.key == initiator.key
    assert isinstance(back.node_id, str) and isinstance(back.hostname, str)
    peer_desc = io.EngineDesc.unpack(shared_peer.desc_blob)
    assert peer_desc.key == shared_peer.key and peer_desc.port > 0
    assert peer_desc != desc


def test_memory_desc_pack_round_trip(io, initiator):
    array, mem = initiator.local(4096)
    back = io.MemoryDesc.unpack(mem.pack())
    assert back == mem
    assert back.engine_key == initiator.key
    assert back.data == array.ctypes.data
    assert back.size == 4096
    assert back.loc == io.MemoryLocationType.CPU
    assert back.device_id == -1
    assert len(back.ipc_handle) == 64
    _, other = initiator.local(4096)
    assert other.id != mem.id and other != mem


def test_descriptor_fields_are_read_only(io, initiator):
    _, mem = initiator.local(64)
    with pytest.raises(AttributeError):
        mem.size = 1
    with pytest.raises(AttributeError):
        initiator.engine.get_engine_desc().port = 1


def test_memory_ids_count_from_zero_per_engine(io):
    engine = io.IOEngine(unique_key("ids"), io.IOEngineConfig("127.0.0.1", 0))
    arrays = [np.zeros(128, dtype=np.uint8) for _ in range(3)]
    ids = [engine.register_memory(a.ctypes.data, a.nbytes, -1, io.MemoryLocationType.CPU).id
           for a in arrays]
    assert ids == [0, 1, 2]


def test_transfer_uids_are_monotonic_per_engine(io):
    first = io.IOEngine(unique_key("uid"), io.IOEngineConfig("127.0.0.1", 0))
    second = io.IOEngine(unique_key("uid"), io.IOEngineConfig("127.0.0.1", 0))
    uids = [first.allocate_transfer_uid() for _ in range(100)]
    assert uids == list(range(100))
    # A different engine (or a restarted one) starts again at 0: uids are per incarnation.
    assert second.allocate_transfer_uid() == 0


def test_rdma_config_positional_order_and_defaults(io):
    default = io.RdmaBackendConfig()
    assert (default.qp_per_transfer, default.post_batch_size, default.num_worker_threads,
            default.poll_cq_mode, default.enable_notification, default.notif_per_qp,
            default.enable_transfer_chunking, default.chunk_bytes,
            default.max_chunks_per_transfer, default.num_nics_per_transfer) == (
        1, -1, -1, io.PollCqMode.POLLING, True, 1024, False, 65536, 64, 1)
    # SGLang builds it positionally: (qp, post_batch, workers, poll mode, notifications).
    cfg = io.RdmaBackendConfig(4, 8, 3, io.PollCqMode.EVENT, False)
    assert (cfg.qp_per_transfer, cfg.post_batch_size, cfg.num_worker_threads, cfg.poll_cq_mode,
            cfg.enable_notification) == (4, 8, 3, io.PollCqMode.EVENT, False)
    engine_cfg = io.IOEngineConfig()
    assert (engine_cfg.host, engine_cfg.port) == ("", 0)
    xgmi = io.XgmiBackendConfig()
    assert (xgmi.num_streams, xgmi.num_events) == (64, 64)


def test_status_code_values(io):
    codes = io.StatusCode
    assert [int(c) for c in (codes.SUCCESS, codes.INIT, codes.IN_PROGRESS, codes.ERR_INVALID_ARGS,
                             codes.ERR_NOT_FOUND, codes.ERR_RDMA_OP, codes.ERR_BAD_STATE,
                             codes.ERR_GPU_OP)] == [0, 1, 2, 11, 12, 13, 14, 15]
    assert [int(b) for b in (io.BackendType.XGMI, io.BackendType.RDMA, io.BackendType.TCP)] == \
        [1, 2, 3]
    assert [int(m) for m in (io.MemoryLocationType.CPU, io.MemoryLocationType.GPU)] == [1, 2]


def test_new_status_is_init_and_updates_are_sticky(io):
    from importlib import import_module
    cpp = import_module("sglang_mori.softio" if io.__name__.startswith("sglang") else "mori.cpp")
    status = cpp.TransferStatus()
    assert status.Init() and status.Code() == io.StatusCode.INIT
    assert status.WaitFor(0) == io.StatusCode.INIT and status.WaitFor(50) == io.StatusCode.INIT
    status.SetCode(io.StatusCode.IN_PROGRESS)
    assert status.InProgress()
    status.Update(io.StatusCode.SUCCESS, "")
    assert status.Succeeded()
    status.Update(io.StatusCode.ERR_RDMA_OP, "late failure")  # a success can be overwritten
    assert status.Failed() and status.Message() == "late failure"
    status.Update(io.StatusCode.SUCCESS, "ignored")  # a failure is sticky
    assert status.Code() == io.StatusCode.ERR_RDMA_OP and status.Message() == "late failure"
