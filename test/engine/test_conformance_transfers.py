"""Conformance: reads, writes and batches land exactly the right bytes; invalid input sends none."""

from __future__ import annotations

import threading

import numpy as np
import pytest

pytestmark = pytest.mark.timeout(90)

WAIT_MS = 20_000
FILL = 0xEE


def expected_after(remote_before: np.ndarray, local: np.ndarray, entries) -> np.ndarray:
    out = remote_before.copy()
    for lo, ro, size in entries:
        out[ro:ro + size] = local[lo:lo + size]
    return out


def split(entries):
    return [e[0] for e in entries], [e[1] for e in entries], [e[2] for e in entries]


# Unsorted remote offsets; runs contiguous on both sides (merge); remote-contiguous but
# local-scattered runs (gathered into one frame); odd sizes and offsets; a zero-size entry.
MIXED_ENTRIES = [
    (8192, 40960, 4096), (0, 0, 4096), (4096, 4096, 4096),  # contiguous both sides with (0, 0)
    (20000, 12288, 100), (30000, 12388, 900), (50001, 13288, 7),  # remote-contiguous, gathered
    (70000, 65536, 3000), (100000, 99999, 1), (60000, 50000, 0),
]


def test_single_write_then_read_back(io, initiator, shared_peer):
    local, lmem = initiator.local(1 << 20, seed=3)
    remote, rmem = initiator.remote(shared_peer, 1 << 20, FILL)
    before = remote.copy()
    status = initiator.engine.write(lmem, 1000, rmem, 5000, 300_000,
                                    initiator.engine.allocate_transfer_uid())
    assert status.WaitFor(WAIT_MS) == io.StatusCode.SUCCESS, status.Message()
    assert np.array_equal(remote, expected_after(before, local, [(1000, 5000, 300_000)]))

    back = np.zeros(1 << 20, dtype=np.uint8)
    bmem = initiator.engine.register_memory(back.ctypes.data, back.nbytes, -1,
                                            io.MemoryLocationType.CPU)
    status = initiator.engine.read(bmem, 7, rmem, 5000, 300_000,
                                   initiator.engine.allocate_transfer_uid())
    assert status.WaitFor(WAIT_MS) == io.StatusCode.SUCCESS, status.Message()
    assert np.array_equal(back[7:7 + 300_000], local[1000:301_000])
    assert not back[:7].any() and not back[300_007:].any()


def test_batch_write_sorts_merges_and_gathers(io, initiator, shared_peer):
    local, lmem = initiator.local(1 << 17, seed=4)
    remote, rmem = initiator.remote(shared_peer, 1 << 17, FILL)
    before = remote.copy()
    lo, ro, sz = split(MIXED_ENTRIES)
    statuses = initiator.engine.batch_write([lmem], [lo], [rmem], [ro], [sz],
                                            [initiator.engine.allocate_transfer_uid()])
    assert len(statuses) == 1
    assert initiator.engine.wait_all(statuses, WAIT_MS) == io.StatusCode.SUCCESS, \
        statuses[0].Message()
    assert np.array_equal(remote, expected_after(before, local, MIXED_ENTRIES))


def test_batch_read_sorts_merges_and_scatters(io, initiator, shared_peer):
    source, _ = initiator.local(1 << 17, seed=5)
    remote, rmem = initiator.remote(shared_peer, 1 << 17)
    remote[:] = source  # the peer's memory holds the data we read
    back = np.full(1 << 17, 0x11, dtype=np.uint8)
    bmem = initiator.engine.register_memory(back.ctypes.data, back.nbytes, -1,
                                            io.MemoryLocationType.CPU)
    lo, ro, sz = split(MIXED_ENTRIES)
    statuses = initiator.engine.batch_read([bmem], [lo], [rmem], [ro], [sz],
                                           [initiator.engine.allocate_transfer_uid()])
    assert initiator.engine.wait_all(statuses, WAIT_MS) == io.StatusCode.SUCCESS
    expected = np.full(1 << 17, 0x11, dtype=np.uint8)
    for l, r, s in MIXED_ENTRIES:
        expected[l:l + s] = source[r:r + s]
    assert np.array_equal(back, expected)


def test_engine_batch_has_one_status_per_pair_across_peers(io, initiator, shared_peer,
                                                           make_peer):
    other = make_peer(role="second-target")
    initiator.connect(other)
    local, lmem = initiator.local(1 << 16, seed=6)
    remote_a, rmem_a = initiator.remote(shared_peer, 1 << 16, FILL)
    remote_b, rmem_b = initiator.remote(other, 1 << 16, FILL)
    uids = [initiator.engine.allocate_transfer_uid() for _ in range(2)]
    statuses = initiator.engine.batch_write(
        [lmem, lmem], [[0, 8192], [100]], [rmem_a, rmem_b], [[4096, 0], [200]],
        [[4096, 4096], [5000]], uids)
    assert len(statuses) == 2
    assert initiator.engine.wait_all(statuses, WAIT_MS) == io.StatusCode.SUCCESS
    assert np.array_equal(remote_a[4096:8192], local[:4096])
    assert np.array_equal(remote_a[:4096], local[8192:12288])
    assert np.array_equal(remote_b[200:5200], local[100:5100])
    assert (remote_b[:200] == FILL).all() and (remote_b[5200:] == FILL).all()


def test_session_batch_returns_a_single_status(io, initiator, shared_peer):
    local, lmem = initiator.local(1 << 16, seed=7)
    remote, rmem = initiator.remote(shared_peer, 1 << 16, FILL)
    session = initiator.engine.create_session(lmem, rmem)
    assert session is not None and session.alive()
    status = session.batch_write([0, 10_000], [20_000, 0], [5000, 3000],
                                 session.allocate_transfer_uid())
    assert not isinstance(status, list)
    assert status.WaitFor(WAIT_MS) == io.StatusCode.SUCCESS
    assert np.array_equal(remote[20_000:25_000], local[:5000])
    assert np.array_equal(remote[:3000], local[10_000:13_000])
    status = session.write(100, 40_000, 64, session.allocate_transfer_uid())
    assert status.WaitFor(WAIT_MS) == io.StatusCode.SUCCESS
    assert np.array_equal(remote[40_000:40_064], local[100:164])
    back = np.zeros(64, dtype=np.uint8)
    bmem = initiator.engine.register_memory(back.ctypes.data, 64, -1, io.MemoryLocationType.CPU)
    read_session = initiator.engine.create_session(bmem, rmem)
    status = read_session.read(0, 40_000, 64, read_session.allocate_transfer_uid())
    assert status.WaitFor(WAIT_MS) == io.StatusCode.SUCCESS
    assert np.array_equal(back, local[100:164])


def test_submit_sets_in_progress_inside_the_call(io, initiator, shared_peer):
    _, lmem = initiator.local(4 << 20)
    _, rmem = initiator.remote(shared_peer, 4 << 20)
    status = initiator.engine.write(lmem, 0, rmem, 0, 4 << 20,
                                    initiator.engine.allocate_transfer_uid())
    assert status.Code() in (io.StatusCode.IN_PROGRESS, io.StatusCode.SUCCESS)
    status.Wait()
    assert status.Succeeded()


def test_invalid_batches_fail_whole_and_send_nothing(io, make_initiator, shared_peer):
    # One lane: had any byte of a rejected batch been sent, it would land before the probe.
    initiator = make_initiator(qp=1)
    initiator.connect(shared_peer)
    local, lmem = initiator.local(8192)
    remote, rmem = initiator.remote(shared_peer, 8192, FILL)
    engine, uid = initiator.engine, initiator.engine.allocate_transfer_uid
    cases = {
        "remote out of range": ([0, 100], [0, 8000], [100, 200]),
        "local out of range": ([0, 8100], [0, 200], [100, 200]),
        "mismatched lengths": ([0, 100], [0], [100, 100]),
        "entry over 4 GiB": ([0], [0], [1 << 32]),
    }
    for name, (lo, ro, sz) in cases.items():
        status = engine.batch_write([lmem], [lo], [rmem], [ro], [sz], [uid()])[0]
        assert status.Code() == io.StatusCode.ERR_INVALID_ARGS, name
        assert status.Failed() and status.Message(), name
    probe = engine.write(lmem, 0, rmem, 4096, 16, uid())
    assert probe.WaitFor(WAIT_MS) == io.StatusCode.SUCCESS
    assert (remote[:4096] == FILL).all() and (remote[4112:] == FILL).all()
    assert np.array_equal(remote[4096:4112], local[:16])


def test_empty_batches_succeed_at_once(io, initiator, shared_peer):
    local, lmem = initiator.local(4096)
    remote, rmem = initiator.remote(shared_peer, 4096, FILL)
    engine = initiator.engine
    statuses = engine.batch_write([lmem, lmem], [[], [0]], [rmem, rmem], [[], [0]], [[], [64]],
                                  [engine.allocate_transfer_uid(), engine.allocate_transfer_uid()])
    assert statuses[0].Code() == io.StatusCode.SUCCESS
    assert engine.wait_all(statuses, WAIT_MS) == io.StatusCode.SUCCESS
    session = engine.create_session(lmem, rmem)
    assert session.batch_write([], [], [], engine.allocate_transfer_uid()).Code() == \
        io.StatusCode.SUCCESS
    assert engine.wait_all([], 0) == io.StatusCode.SUCCESS
    assert np.array_equal(remote[:64], local[:64]) and (remote[64:] == FILL).all()


def test_threads_submit_at_once(io, initiator, shared_peer):
    threads_n, rounds, chunk = 4, 15, 32 * 1024
    local, lmem = initiator.local(threads_n * chunk, seed=9)
    remote, rmem = initiator.remote(shared_peer, threads_n * rounds * chunk, FILL)
    failures = []

    def worker(t: int) -> None:
        statuses = []
        for r in range(rounds):
            # Four 8 KiB pieces per round, written in reverse order into this thread's slot.
            base = (t * rounds + r) * chunk
            lo = [t * chunk + i * 8192 for i in range(4)]
            ro = [base + (3 - i) * 8192 for i in range(4)]
            statuses += initiator.engine.batch_write(
                [lmem], [lo], [rmem], [ro], [[8192] * 4],
                [initiator.engine.allocate_transfer_uid()])
        code = initiator.engine.wait_all(statuses, WAIT_MS)
        if code != io.StatusCode.SUCCESS:
            failures.append((t, code))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(threads_n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not failures
    for t in range(threads_n):
        for r in range(rounds):
            base = (t * rounds + r) * chunk
            for i in range(4):
                got = remote[base + (3 - i) * 8192: base + (4 - i) * 8192]
                assert np.array_equal(got, local[t * chunk + i * 8192: t * chunk + (i + 1) * 8192])


def test_many_scattered_pages_with_numpy_offsets(io, initiator, shared_peer):
    pages, page = 4096, 256
    local, lmem = initiator.local(pages * page, seed=10)
    remote, rmem = initiator.remote(shared_peer, pages * page, FILL)
    order = np.random.default_rng(11).permutation(pages)
    lo = np.arange(pages, dtype=np.int64) * page
    ro = order.astype(np.int64) * page
    sizes = np.full(pages, page, dtype=np.int64)
    status = initiator.engine.batch_write([lmem], [lo], [rmem], [ro], [sizes],
                                          [initiator.engine.allocate_transfer_uid()])[0]
    assert status.WaitFor(WAIT_MS) == io.StatusCode.SUCCESS, status.Message()
    expected = np.empty_like(remote)
    expected.reshape(pages, page)[order] = local.reshape(pages, page)
    assert np.array_equal(remote, expected)
