"""softio's device path (GPU registrations, CUDA IPC, copies on the engine's stream): the transfer
conformance cases of test/engine run on device memory between two processes, plus what is
particular to it: registrations export an IPC handle, host/device pairs are refused, copies are
not ordered against the producer's stream (as on MORI-IO), and the link pacing holds."""

from __future__ import annotations

import threading
import time
import uuid

import numpy as np
import pytest
import torch

import sglang_mori.softio as io
from sglang_mori.softio import device_path

from device_peer import DevicePeer
from pd_rig import PATHS

WAIT_MS = 20_000
SIZE = 1 << 20
FILL = 0xEE
# (local offset, remote offset, size): unsorted, contiguous runs, odd sizes, a zero-size entry
ENTRIES = [(8192, 40960, 4096), (0, 0, 4096), (4096, 4096, 4096), (20000, 12288, 100), (30000, 12388, 900),
           (50001, 13288, 7), (70000, 65536, 3000), (100000, 99999, 1), (60000, 50000, 0)]


def split(entries):
    return [e[0] for e in entries], [e[1] for e in entries], [e[2] for e in entries]


def expected_after(before, local, entries):
    out = before.copy()
    for lo, ro, size in entries:
        out[ro:ro + size] = local[lo:lo + size]
    return out


class GpuInitiator:
    def __init__(self):
        self.engine = io.IOEngine(f"gpu-initiator-{uuid.uuid4().hex[:8]}", io.IOEngineConfig("127.0.0.1", 0))
        self.engine.create_backend(io.BackendType.RDMA, io.RdmaBackendConfig())
        self.keep = []

    def local(self, size: int, seed: int):
        data = torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda",
                             generator=torch.Generator(device="cuda").manual_seed(seed))
        self.keep.append(data)
        return data, self.engine.register_torch_tensor(data)

    def connect(self, peer: DevicePeer):
        self.engine.register_remote_engine(io.EngineDesc.unpack(peer.desc_blob))
        return io.MemoryDesc.unpack(peer.mem_blob)


@pytest.fixture(scope="module")
def peer():
    p = DevicePeer(SIZE, FILL, PATHS)
    yield p
    p.close()


@pytest.fixture
def ini(peer):
    initiator = GpuInitiator()
    initiator.remote = initiator.connect(peer)
    peer.fill(np.full(SIZE, FILL, np.uint8))
    return initiator


def test_gpu_registrations_export_an_ipc_handle_and_host_ones_do_not(ini):
    _, mem = ini.local(4096, seed=1)
    assert mem.loc == io.MemoryLocationType.GPU
    assert mem.ipc_handle != bytes(64)
    host = np.zeros(4096, np.uint8)
    hmem = ini.engine.register_memory(host.ctypes.data, host.nbytes, 0, io.MemoryLocationType.GPU)
    assert hmem.ipc_handle == bytes(64)  # SGLang's CPU pools registered as GPU stay host regions


def test_single_write_lands_exact_bytes_in_another_process(ini, peer):
    local, lmem = ini.local(SIZE, seed=3)
    status = ini.engine.write(lmem, 1000, ini.remote, 5000, 300_000, ini.engine.allocate_transfer_uid())
    assert status.WaitFor(WAIT_MS) == io.StatusCode.SUCCESS, status.Message()
    before = np.full(SIZE, FILL, np.uint8)
    assert np.array_equal(peer.bytes(), expected_after(before, local.cpu().numpy(), [(1000, 5000, 300_000)]))


def test_batch_write_scattered_ranges_and_one_status_per_pair(ini, peer):
    local, lmem = ini.local(1 << 17, seed=4)
    lo, ro, sz = split(ENTRIES)
    statuses = ini.engine.batch_write([lmem, lmem], [lo, []], [ini.remote, ini.remote], [ro, []], [sz, []],
                                      [ini.engine.allocate_transfer_uid(), ini.engine.allocate_transfer_uid()])
    assert len(statuses) == 2
    assert io.StatusCode.SUCCESS == ini.engine.wait_all(statuses, WAIT_MS), [s.Message() for s in statuses]
    before = np.full(SIZE, FILL, np.uint8)
    assert np.array_equal(peer.bytes(), expected_after(before, local.cpu().numpy(), ENTRIES))


def test_session_batch_read_gathers_remote_bytes(ini, peer):
    remote = np.random.default_rng(5).integers(0, 256, SIZE, dtype=np.uint8)
    peer.fill(remote)
    local, lmem = ini.local(1 << 17, seed=6)
    before = local.cpu().numpy().copy()
    sess = ini.engine.create_session(lmem, ini.remote)
    lo, ro, sz = split(ENTRIES)
    status = sess.batch_read(lo, ro, sz, sess.allocate_transfer_uid())
    assert status.WaitFor(WAIT_MS) == io.StatusCode.SUCCESS, status.Message()
    want = before.copy()
    for l, r, s in ENTRIES:
        want[l:l + s] = remote[r:r + s]
    torch.cuda.synchronize()
    assert np.array_equal(local.cpu().numpy(), want)


def test_status_is_in_progress_inside_the_call_and_invalid_batches_send_nothing(ini, peer):
    local, lmem = ini.local(1 << 16, seed=7)
    status = ini.engine.write(lmem, 0, ini.remote, 0, 1 << 16, ini.engine.allocate_transfer_uid())
    assert status.Code() in (io.StatusCode.IN_PROGRESS, io.StatusCode.SUCCESS)
    assert status.WaitFor(WAIT_MS) == io.StatusCode.SUCCESS
    peer.fill(np.full(SIZE, FILL, np.uint8))
    bad = ini.engine.batch_write([lmem], [[0, 1 << 16]], [ini.remote], [[0, 0]], [[16, 1]],
                                 [ini.engine.allocate_transfer_uid()])[0]
    assert bad.WaitFor(WAIT_MS) == io.StatusCode.ERR_INVALID_ARGS
    empty = ini.engine.batch_write([lmem], [[]], [ini.remote], [[]], [[]], [ini.engine.allocate_transfer_uid()])[0]
    assert empty.WaitFor(WAIT_MS) == io.StatusCode.SUCCESS
    assert (peer.bytes() == FILL).all()


def test_threads_submit_at_once(ini, peer):
    local, lmem = ini.local(SIZE, seed=8)
    statuses, errors = [], []

    def worker(k):
        try:
            for j in range(16):
                off = (k * 16 + j) * 4096
                statuses.append(ini.engine.write(lmem, off, ini.remote, off, 4096, ini.engine.allocate_transfer_uid()))
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    assert ini.engine.wait_all(statuses, WAIT_MS) == io.StatusCode.SUCCESS
    got = peer.bytes()
    assert np.array_equal(got[:8 * 16 * 4096], local.cpu().numpy()[:8 * 16 * 4096])


def test_a_pair_of_host_and_device_memory_is_refused(ini, peer):
    host = np.ones(4096, np.uint8)
    hmem = ini.engine.register_memory(host.ctypes.data, host.nbytes, -1, io.MemoryLocationType.CPU)
    with pytest.raises(RuntimeError, match="host and device"):
        ini.engine.create_session(hmem, ini.remote)


def test_copies_are_not_ordered_against_the_producer_stream(ini, peer):
    """As on MORI-IO: a write posted while the producer's kernel is still queued reads the old
    bytes; after waiting on the producer's event it reads the new ones."""
    local, lmem = ini.local(1 << 16, seed=9)
    local.zero_()
    torch.cuda.synchronize()
    producer = torch.cuda.Stream()
    with torch.cuda.stream(producer):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before the store
        local.fill_(7)
        done = torch.cuda.Event()
        done.record()
    early = ini.engine.write(lmem, 0, ini.remote, 0, 1 << 16, ini.engine.allocate_transfer_uid())
    assert early.WaitFor(WAIT_MS) == io.StatusCode.SUCCESS
    assert (peer.bytes()[:1 << 16] == 0).all(), "the copy waited for the producer: not MORI-IO's semantics"
    done.synchronize()
    late = ini.engine.write(lmem, 0, ini.remote, 0, 1 << 16, ini.engine.allocate_transfer_uid())
    assert late.WaitFor(WAIT_MS) == io.StatusCode.SUCCESS
    assert (peer.bytes()[:1 << 16] == 7).all()


def test_link_pacing_holds_a_write_to_the_link_rate(peer, monkeypatch):
    monkeypatch.setenv(device_path.LINK_GBPS_ENV, "0.5")  # 0.5 GB/s: 64 MiB takes >= 134 ms
    ini = GpuInitiator()  # a new engine reads the setting
    remote = ini.connect(peer)
    local, lmem = ini.local(SIZE, seed=10)
    statuses = []
    t0 = time.monotonic()
    for _ in range(64):
        statuses.append(ini.engine.write(lmem, 0, remote, 0, SIZE, ini.engine.allocate_transfer_uid()))
    assert ini.engine.wait_all(statuses, WAIT_MS) == io.StatusCode.SUCCESS
    assert time.monotonic() - t0 >= 0.95 * 64 * SIZE / 0.5e9
