"""softio's local rules: registration, hosts, backends, env overrides, status wake-ups."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from sglang_mori import softio
from sglang_mori.softio.config import resolve_lane_settings
from sglang_mori.softio.core import _check_host

SOFTIO_ONLY = True
pytestmark = pytest.mark.timeout(60)

WAIT_MS = 20_000


def engine(key: str, host: str = "127.0.0.1") -> softio.IOEngine:
    return softio.IOEngine(key, softio.IOEngineConfig(host, 0))


def test_size_zero_and_negative_registrations_are_errors():
    e = engine("reg-errors")
    array = np.zeros(16, dtype=np.uint8)
    with pytest.raises(RuntimeError, match="size 0"):
        e.register_memory(array.ctypes.data, 0, -1, softio.MemoryLocationType.CPU)
    with pytest.raises(TypeError):
        e.register_memory(array.ctypes.data, -5, -1, softio.MemoryLocationType.CPU)
    with pytest.raises(RuntimeError, match="null"):
        e.register_memory(0, 16, -1, softio.MemoryLocationType.CPU)


def test_empty_host_means_loopback_and_names_are_refused():
    e = engine("empty-host", host="")
    e.create_backend(softio.BackendType.RDMA)
    assert e.get_engine_desc().host == "127.0.0.1" and e.get_engine_desc().port > 0
    e.remove_backend(softio.BackendType.RDMA)
    with pytest.raises(RuntimeError, match="IPv4"):
        engine("named-host", host="localhost").create_backend(softio.BackendType.RDMA)


def test_wildcard_host_is_refused_unless_allowed(monkeypatch):
    with pytest.raises(RuntimeError, match="SGLANG_MORI_SOFTIO_ALLOW_WILDCARD"):
        engine("wildcard", host="0.0.0.0").create_backend(softio.BackendType.RDMA)
    monkeypatch.setenv("SGLANG_MORI_SOFTIO_ALLOW_WILDCARD", "1")
    _check_host("0.0.0.0")  # allowed now (not bound here: tests bind loopback only)


def test_backends_other_than_rdma():
    e = engine("backends")
    with pytest.raises(RuntimeError, match="XGMI"):
        e.create_backend(softio.BackendType.XGMI)
    with pytest.raises(NotImplementedError):
        e.create_backend(softio.BackendType.TCP)
    e.create_backend(softio.BackendType.RDMA)
    port = e.get_engine_desc().port
    e.create_backend(softio.BackendType.RDMA)  # a duplicate is skipped, as in MORI
    assert e.get_engine_desc().port == port
    e.remove_backend(softio.BackendType.RDMA)


def test_gpu_typed_memory_and_torch_tensors_are_host_memory():
    # SGLang registers its KV pools as GPU memory; softio treats the pointer as host memory.
    a, b = engine("gpu-a"), engine("gpu-b")
    for e in (a, b):
        e.create_backend(softio.BackendType.RDMA)
    a.register_remote_engine(b.get_engine_desc())
    src = torch.arange(4096, dtype=torch.int32)
    dst = torch.zeros(4096, dtype=torch.int32)
    smem = a.register_torch_tensor(src)
    assert smem.loc == softio.MemoryLocationType.CPU and smem.size == 4096 * 4
    dmem = b.register_memory(dst.data_ptr(), dst.numel() * 4, 0, softio.MemoryLocationType.GPU)
    assert dmem.loc == softio.MemoryLocationType.GPU and dmem.device_id == 0
    status = a.write(smem, 0, dmem, 0, 4096 * 4, a.allocate_transfer_uid())
    assert status.WaitFor(WAIT_MS) == softio.StatusCode.SUCCESS
    assert torch.equal(src, dst)
    with pytest.raises(RuntimeError, match="contiguous"):
        a.register_torch_tensor(torch.zeros(8, 8)[:, 1])
    for e in (a, b):
        e.remove_backend(softio.BackendType.RDMA)


def test_mori_env_variables_override_the_config(monkeypatch):
    config = softio.RdmaBackendConfig(4, -1, -1, softio.PollCqMode.POLLING, False)
    assert resolve_lane_settings(config).lanes == 4
    assert resolve_lane_settings(config).enable_notification is False
    monkeypatch.setenv("MORI_IO_QP_PER_TRANSFER", "2")
    monkeypatch.setenv("MORI_IO_ENABLE_NOTIFICATION", "1")
    monkeypatch.setenv("MORI_IO_CP_TIMEOUT_MS", "0")
    settings = resolve_lane_settings(config)
    assert settings.lanes == 2 and settings.enable_notification is True
    assert settings.cp_timeout_s is None


def test_a_waiting_thread_wakes_when_another_completes_the_status():
    status = softio.TransferStatus()
    status.SetCode(softio.StatusCode.IN_PROGRESS)
    started = threading.Event()
    seen = []

    def waiter():
        started.set()
        seen.append(status.WaitFor(-1))

    thread = threading.Thread(target=waiter)
    thread.start()
    started.wait(5)
    status.Update(softio.StatusCode.SUCCESS, "")
    thread.join(5)
    assert seen == [softio.StatusCode.SUCCESS]


def test_set_log_level_accepts_mori_names():
    softio.set_log_level("info")
    softio.set_log_level("warn")
    with pytest.raises(ValueError):
        softio.set_log_level("chatty")


def test_pybind_like_enum_printing_and_fabric_stubs():
    assert str(softio.StatusCode.SUCCESS) == "StatusCode.SUCCESS"
    assert softio.PollCqMode.POLLING.name == "POLLING"
    with pytest.raises(RuntimeError):
        softio.fabric_alloc(4096, 0)
