"""A decode's GPU pool comes back once the decode is gone and prefill dropped it.

Prefill maps the peer's pool (CUDA IPC) to write into it; CUDA frees an exported allocation only
when every process that mapped it has unmapped it. Before softio closed its mappings, a killed
decode's pool stayed allocated for as long as prefill lived (2.0 GB per decode restart on the
H200 run). Here the peer process holds a POOL-byte pool; after it is gone the device's free memory
must grow by at least POOL (its CUDA context comes back too, which alone is far less than POOL).
"""

from __future__ import annotations

import time
import uuid

import pytest
import torch

import sglang_mori.softio as io

from device_peer import DevicePeer
from pd_rig import PATHS

POOL = 2 << 30
WAIT_MS = 20_000
RETURN_S = 30.0  # the child's exit and the driver's release


def _free_bytes() -> int:
    return torch.cuda.mem_get_info(0)[0]


def _wait_for_free(at_least: int) -> int:
    deadline = time.monotonic() + RETURN_S
    while True:
        free = _free_bytes()
        if free >= at_least or time.monotonic() >= deadline:
            return free
        time.sleep(0.2)  # polling the device's free memory: no event tells when the driver freed it


@pytest.mark.parametrize("ending", ["killed", "deregistered-then-stopped"])
def test_a_removed_peer_returns_its_gpu_memory(ending):
    torch.cuda.set_device(0)
    local = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, device="cuda")
    engine = io.IOEngine(f"gpu-release-{uuid.uuid4().hex[:8]}", io.IOEngineConfig("127.0.0.1", 0))
    engine.create_backend(io.BackendType.RDMA, io.RdmaBackendConfig())
    lmem = engine.register_torch_tensor(local)
    peer = DevicePeer(POOL, 0, PATHS)
    try:
        desc = io.EngineDesc.unpack(peer.desc_blob)
        engine.register_remote_engine(desc)
        remote = io.MemoryDesc.unpack(peer.mem_blob)
        status = engine.write(lmem, 0, remote, POOL - local.numel(), local.numel(), engine.allocate_transfer_uid())
        assert status.WaitFor(WAIT_MS) == io.StatusCode.SUCCESS, status.Message()  # the pool is mapped here
        torch.cuda.synchronize()
        with_peer = _free_bytes()
        if ending == "killed":
            peer.proc.kill()  # SIGKILL: only the control connection's end tells this process
            peer.proc.join(20)
        else:
            engine.deregister_remote_engine(desc)
            peer.close()
        after = _wait_for_free(with_peer + POOL)
        assert after - with_peer >= POOL, (
            f"{(after - with_peer) / 2**30:.2f} GiB came back, the pool is {POOL / 2**30:.2f} GiB: "
            f"this process still maps the gone peer's pool")
        if ending == "killed":
            event = engine.pop_peer_failure()
            assert event is not None and event.remote_engine_key == desc.key
    finally:
        peer.close()
        engine._core.shutdown()
