"""softio's device path unmaps a peer's memory when the peer (or a region of the pair) is
deregistered and when the engine closes, and never while a copy through the mapping is queued.

On a GPU host a mapping that is never closed keeps a dead decode's whole KV pool allocated on its
GPU (seen on 4x H200: each decode restart left 2.0 GB behind). Here the CUDA runtime is a fake
(fake_cuda.py) over host memory: it logs every IPC open/close and synchronize, holds copies in
flight for as long as a test wants, and records a close under a queued copy as a violation.
"""

from __future__ import annotations

import numpy as np
import pytest

from engine_peer import EnginePeer, unique_key, wait_until
from fake_cuda import install
from sglang_mori import softio
from sglang_mori.engine.transfer_engine import TransferEngine
from sglang_mori.softio import cuda_runtime

SOFTIO_ONLY = True
pytestmark = pytest.mark.timeout(60)

WAIT_MS = 20_000
POOL = 4096
DECODE_HANDLE = b"decode-pool"


def _engine(role: str) -> softio.IOEngine:
    e = softio.IOEngine(unique_key(role), softio.IOEngineConfig("127.0.0.1", 0))
    e.create_backend(softio.BackendType.RDMA)
    return e


class Rig:
    """A prefill engine with a (fake) device pool and a decode engine whose pool prefill reaches
    through an IPC handle, as between two processes of one GPU host."""

    def __init__(self, fake, engine: softio.IOEngine | None = None):
        self.fake = fake
        self.prefill = engine or _engine("prefill")
        self.src = np.arange(POOL, dtype=np.uint32).astype(np.uint8)
        fake.device_memory(self.src.ctypes.data, POOL, 0, handle=b"prefill-pool")
        self.local = self.prefill.register_memory(self.src.ctypes.data, POOL, 0, softio.MemoryLocationType.GPU)
        self.decode = _engine("decode")
        self.decode_desc = self.decode.get_engine_desc()
        self.prefill.register_remote_engine(self.decode_desc)
        self.dst = np.zeros(POOL, dtype=np.uint8)
        self.base = self.dst.ctypes.data
        fake.peer_allocation(DECODE_HANDLE, self.base, POOL, 1)
        self.remote = self.remote_region(0, POOL)

    def remote_region(self, offset: int, size: int):
        """Decode registers part of its pool (the control plane knows its size); the descriptor
        carries the pool's IPC handle, as a device registration of another process would."""
        registered = self.decode.register_memory(self.base + offset, size, -1, softio.MemoryLocationType.CPU)
        desc = softio.MemoryDesc.unpack(registered.pack())
        desc._ipc_handle = DECODE_HANDLE.ljust(64, b"\0")
        desc._ipc_offset = offset
        return desc

    def write(self, offset: int, size: int, remote=None, remote_offset: int | None = None):
        """Local bytes [offset, offset + size) to the same place of decode's region (or remote_offset)."""
        at = offset if remote_offset is None else remote_offset
        return self.prefill.batch_write([self.local], [[offset]], [remote or self.remote], [[at]], [[size]],
                                        [self.prefill.allocate_transfer_uid()])[0]

    def closes(self) -> int:
        return len([e for e in self.fake.entries("close") if e[1] == self.base])

    def opens(self) -> int:
        return len([e for e in self.fake.entries("open") if e[1] == DECODE_HANDLE])


@pytest.fixture
def rig(monkeypatch):
    r = Rig(install(monkeypatch))
    yield r
    r.fake.let_go()
    r.prefill._core.shutdown()
    r.decode._core.shutdown()


def _succeeded(status) -> None:
    assert status.WaitFor(WAIT_MS) == softio.StatusCode.SUCCESS, status.Message()


def test_a_removed_peer_is_unmapped_once_after_its_copy_in_flight_finished(rig):
    rig.fake.hold()
    status = rig.write(0, 256)
    assert status.InProgress() and rig.fake.queued() == 1  # the copy waits on the stream
    rig.prefill.deregister_remote_engine(rig.decode_desc)
    assert rig.closes() == 0  # not under the queued copy
    rig.fake.let_go()
    _succeeded(status)
    assert rig.dst[:256].tolist() == rig.src[:256].tolist() and not rig.dst[256:].any()
    assert rig.opens() == 1 and rig.closes() == 1
    kinds = [e[0] for e in rig.fake.log if e[0] in ("sync", "close")]
    assert kinds.index("close") > kinds.index("sync")
    assert rig.fake.violations == []
    assert cuda_runtime.load().mapped() == {}
    rig.prefill._core.shutdown()
    assert rig.closes() == 1  # exactly once


def test_a_removed_peer_with_nothing_in_flight_is_unmapped_at_once(rig):
    _succeeded(rig.write(0, 64))
    assert rig.closes() == 0  # a live peer stays mapped between writes
    rig.prefill.deregister_remote_engine(rig.decode_desc)
    assert rig.closes() == 1 and rig.fake.violations == []


def test_a_re_added_peer_is_mapped_again(rig):
    _succeeded(rig.write(0, 64))
    rig.prefill.deregister_remote_engine(rig.decode_desc)
    rig.prefill.register_remote_engine(rig.decode_desc)
    rig.dst[:] = 0
    _succeeded(rig.write(64, 64))
    assert rig.dst[64:128].tolist() == rig.src[64:128].tolist()
    assert rig.opens() == 2 and rig.closes() == 1
    rig.prefill._core.shutdown()
    assert rig.closes() == 2 and rig.fake.violations == []


def test_a_batch_that_failed_half_enqueued_keeps_the_mapping_until_its_queued_copies_ran(rig):
    rig.fake.fail_copy_at = 1  # the second range fails after the first was queued
    rig.fake.hold()
    status = rig.prefill.batch_write([rig.local], [[0, 512]], [rig.remote], [[0, 512]], [[64, 64]],
                                     [rig.prefill.allocate_transfer_uid()])[0]
    assert rig.fake.queued() == 1
    rig.prefill.deregister_remote_engine(rig.decode_desc)
    assert rig.closes() == 0
    rig.fake.let_go()
    assert status.WaitFor(WAIT_MS) == softio.StatusCode.ERR_GPU_OP and "device copy failed" in status.Message()
    assert rig.closes() == 1 and rig.fake.violations == []


def test_a_write_through_a_released_session_fails_and_queues_no_copy(rig):
    session = rig.prefill.create_session(rig.local, rig.remote)  # held by the caller
    rig.prefill.deregister_remote_engine(rig.decode_desc)
    status = session.batch_write([0], [0], [64], session.allocate_transfer_uid())
    assert status.Code() == softio.StatusCode.ERR_BAD_STATE and "no longer mapped" in status.Message()
    assert rig.fake.queued() == 0 and not rig.dst.any() and rig.closes() == 1


def test_engine_close_unmaps_every_mapping_after_the_copies_in_flight(rig, monkeypatch):
    other = b"other-decode-pool"
    other_dst = np.zeros(POOL, dtype=np.uint8)
    rig.fake.peer_allocation(other, other_dst.ctypes.data, POOL, 2)
    second = rig.remote_region(0, POOL)
    second._ipc_handle = other.ljust(64, b"\0")  # another allocation of the same engine
    _succeeded(rig.write(0, 32, remote=second))
    rig.fake.hold()
    status = rig.write(0, 128)
    rig.prefill._core.shutdown()
    assert rig.closes() == 0 and len(rig.fake.entries("close")) == 1  # the idle one only
    rig.fake.let_go()
    _succeeded(status)
    assert rig.closes() == 1 and len(rig.fake.entries("close")) == 2
    assert rig.fake.violations == [] and cuda_runtime.load().mapped() == {}


def test_regions_of_one_allocation_share_one_mapping_until_the_last_is_dropped(rig):
    upper = rig.remote_region(POOL // 2, POOL // 2)  # K and V of one cached-allocator segment
    lower = rig.remote_region(0, POOL // 2)
    _succeeded(rig.write(0, 16, remote=lower))
    _succeeded(rig.write(POOL // 2, 16, remote=upper, remote_offset=0))
    assert rig.opens() == 1  # the handle is mapped once, its holds are counted
    assert rig.dst[POOL // 2:POOL // 2 + 16].tolist() == rig.src[POOL // 2:POOL // 2 + 16].tolist()
    rig.prefill.deregister_memory(rig.local)  # both sessions used this local region
    assert rig.closes() == 1 and rig.fake.violations == []


def test_transfer_engine_remove_peer_and_close_unmap(monkeypatch):
    fake = install(monkeypatch)
    wrapper = TransferEngine(softio, role="prefill", host="127.0.0.1", qp_per_transfer=1, post_batch_size=-1,
                             num_workers=1)
    r = Rig(fake, engine=wrapper.engine)
    try:
        key = wrapper.add_peer(r.decode_desc.pack())
        _succeeded(r.write(0, 64))
        wrapper.remove_peer(key)  # what prefill does for a dead, pruned or replaced decode
        assert r.closes() == 1
        wrapper.add_peer(r.decode_desc.pack())
        fake.hold()
        status = r.write(0, 64)
        wrapper.close()
        assert r.closes() == 1  # the copy is still queued
        fake.let_go()
        _succeeded(status)
        assert r.closes() == 2 and fake.violations == []
    finally:
        fake.let_go()
        r.decode._core.shutdown()


def test_a_killed_device_peer_is_reported_and_unmapped_after_its_copy_in_flight(monkeypatch):
    """The decode process dies (SIGKILL): no lane tells, copies into its still-mapped pool succeed;
    its control connection closing does, and its mapping closes once the queued copy finished."""
    fake = install(monkeypatch)
    prefill = _engine("prefill")
    src = np.arange(POOL, dtype=np.uint32).astype(np.uint8)
    fake.device_memory(src.ctypes.data, POOL, 0, handle=b"prefill-pool")
    local = prefill.register_memory(src.ctypes.data, POOL, 0, softio.MemoryLocationType.GPU)
    decode = EnginePeer("softio-tcp", role="decode")
    try:
        pool, blob = decode.register(POOL)
        remote = softio.MemoryDesc.unpack(blob)
        remote._ipc_handle = DECODE_HANDLE.ljust(64, b"\0")
        fake.peer_allocation(DECODE_HANDLE, pool.addr, POOL, 1)  # the same pages as the peer's
        prefill.register_remote_engine(softio.EngineDesc.unpack(decode.desc_blob))

        def write(size):
            return prefill.batch_write([local], [[0]], [remote], [[0]], [[size]], [prefill.allocate_transfer_uid()])[0]

        _succeeded(write(64))
        assert pool.array[:64].tolist() == src[:64].tolist()
        fake.hold()
        status = write(128)
        decode.kill()
        event = wait_until(prefill.pop_peer_failure, 10, "the killed peer's failure event")
        assert event.remote_engine_key == decode.key and event.reason == softio.PeerFailureReason.PEER_UNREACHABLE
        assert not [e for e in fake.entries("close")]  # the copy is still queued
        fake.let_go()
        _succeeded(status)
        assert len(fake.entries("close")) == 1 and fake.violations == []
        assert cuda_runtime.load().mapped() == {}
        late = write(64)  # the pair's session is kept: the write fails with a status, enqueues nothing
        assert late.Code() == softio.StatusCode.ERR_BAD_STATE and "no longer mapped" in late.Message()
        assert fake.queued() == 0
        other = softio.MemoryDesc.unpack(blob)
        other._ipc_handle, other._id = remote._ipc_handle, remote._id + 1
        with pytest.raises(RuntimeError, match="is down"):  # no new session to a peer seen to fail
            prefill.batch_write([local], [[0]], [other], [[0]], [[8]], [prefill.allocate_transfer_uid()])
    finally:
        fake.let_go()
        decode.close()
        prefill._core.shutdown()


def test_runtime_counts_holds_per_mapping_and_unmaps_at_the_last(monkeypatch):
    fake = install(monkeypatch)
    runtime = cuda_runtime.load()
    pool = np.zeros(POOL, dtype=np.uint8)
    fake.peer_allocation(DECODE_HANDLE, pool.ctypes.data, POOL, 1)
    handle = DECODE_HANDLE.ljust(64, b"\0")
    fake.fail_open_on.add(2)  # a second context may not map it again: device 2 goes through device 0's
    bases = {runtime.open(handle, 0), runtime.open(handle, 0), runtime.open(handle, 2)}
    assert bases == {pool.ctypes.data} and len(fake.entries("open")) == 1
    runtime.close(handle, 0)
    runtime.close(handle, 2)
    assert fake.entries("close") == [] and runtime.mapped() == {(handle, 0): 1}
    runtime.close(handle, 0)
    assert fake.entries("close") == [("close", pool.ctypes.data)] and runtime.mapped() == {}
    with pytest.raises(cuda_runtime.CudaError, match="never opened"):
        runtime.close(handle, 0)
    fake.fail_open_on.clear()
    assert runtime.open(handle, 2) == pool.ctypes.data and fake.entries("open")[-1][2] == 2  # mapped anew
