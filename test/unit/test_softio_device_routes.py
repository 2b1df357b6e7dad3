"""softio's fast route for device batch_write calls (device_routes.py), on CPU: the backend's
cached device sessions are stand-ins over a recording engine (the copies themselves run in
test/gpu). The route must give the copies the general path gives, and hand every case it does
not cover (stale or released sessions, bad ranges, per-pair arrays, reads) to the general path,
whose per-pair failures are checked here too."""

import threading
from types import SimpleNamespace

import numpy as np
import pytest

import sglang_mori.softio as io
from sglang_mori.softio import device_routes
from sglang_mori.softio.descriptors import EngineDesc, MemoryDesc
from sglang_mori.softio.device_path import DeviceSession, expand_shared
from sglang_mori.softio.enums import StatusCode
from sglang_mori.softio.remote_mapping import RemoteMapping
from sglang_mori.softio.status import TransferStatus, succeed_all


class RecordingEngine:
    def __init__(self):
        self.calls = []

    def submit(self, dsts, srcs, sizes, statuses, to_peer=False, holds=()):
        self.calls.append((dsts.tolist(), srcs.tolist(), sizes.tolist(), list(statuses), to_peer, holds))

    def submit_shared(self, dst_base, src_base, dst_off, src_off, sizes, statuses, to_peer=False, holds=()):
        """The engine's table of shared ranges, recorded as the flat copies it stands for."""
        self.submit(*expand_shared(dst_base, src_base, dst_off, src_off, sizes), statuses, to_peer, holds)

    def close(self):
        pass


class NoRuntime:
    def close(self, handle, device):
        pass


@pytest.fixture
def rig(monkeypatch):
    routed = []  # one entry per call the fast route posted
    original = device_routes._post

    def counted(*args):
        posted = original(*args)
        routed.append(posted)
        return posted
    monkeypatch.setattr(device_routes, "_post", counted)
    engine = io.IOEngine("local", io.IOEngineConfig("127.0.0.1", 0))
    engine.create_backend(io.BackendType.RDMA)
    core = engine._core
    backend = core.backends[io.BackendType.RDMA]
    backend.peers.register(EngineDesc("peer", "node", "host", "127.0.0.1", 1, 1))
    copies = RecordingEngine()
    core._device_engines[0] = copies  # the device path is in use in this process
    buffers = [np.zeros(64, np.uint8) for _ in range(3)]
    local = [engine.register_memory(b.ctypes.data, b.nbytes, -1, io.MemoryLocationType.CPU) for b in buffers]
    remote, sessions = [], []
    for i, desc in enumerate(local):
        r = MemoryDesc._make("peer", i, 1, 0, 1000, io.MemoryLocationType.GPU)
        remote.append(r)
        mapping = RemoteMapping(NoRuntime(), b"h%d" % i, 0, f"memory {i}")
        s = DeviceSession(backend, copies, SimpleNamespace(ptr=10_000 * (i + 1), size=100), 1_000_000 * (i + 1),
                          1000, to_peer=True, mapping=mapping)
        backend._sessions[("peer", desc._id, i)] = s
        sessions.append(s)
    yield SimpleNamespace(engine=engine, core=core, backend=backend, copies=copies, local=local, remote=remote,
                          sessions=sessions, buffers=buffers, routed=routed)
    engine._core.shutdown()


def write(rig, lo, ro, sz, pairs=3):
    e = rig.engine
    return e.batch_write(rig.local[:pairs], lo, rig.remote[:pairs], ro, sz,
                         [e.allocate_transfer_uid() for _ in range(pairs)])


def shared(*columns, pairs=3):
    return [[np.array(c, dtype=np.int64)] * pairs for c in columns]


def test_shared_arrays_become_one_submission_with_every_pairs_addresses(rig, monkeypatch):
    lo, ro, sz = shared([0, 16], [8, 40], [4, 8])
    statuses = write(rig, lo, ro, sz)
    assert [s.Code() for s in statuses] == [StatusCode.IN_PROGRESS] * 3
    (dsts, srcs, sizes, posted, to_peer, holds), = rig.copies.calls
    assert dsts == [1_000_008, 1_000_040, 2_000_008, 2_000_040, 3_000_008, 3_000_040]
    assert srcs == [10_000, 10_016, 20_000, 20_016, 30_000, 30_016]
    assert sizes == [4, 8] * 3
    assert posted == statuses and to_peer and rig.routed == [True]
    assert set(holds) == {s.mapping for s in rig.sessions}
    # the same descriptors again: the cached route, no per-pair resolution
    monkeypatch.setattr(device_routes.DeviceRoutes, "_resolve", staticmethod(lambda *a: pytest.fail("resolved")))
    write(rig, *shared([0], [0], [16]))
    assert rig.copies.calls[-1][0] == [1_000_000, 2_000_000, 3_000_000] and rig.routed == [True, True]


def test_the_route_and_the_general_path_give_the_same_copies(rig):
    lo, ro, sz = [0, 32], [100, 500], [16, 16]
    write(rig, *shared(lo, ro, sz))
    per_pair = [[np.array(c, dtype=np.int64) for _ in range(3)] for c in (lo, ro, sz)]  # not shared: general
    write(rig, *per_pair)
    assert rig.copies.calls[0][:3] == rig.copies.calls[1][:3] and rig.routed == [True]


def test_a_range_outside_one_region_fails_that_pair_alone(rig):
    rig.sessions[1].local.size = 20  # smaller than the others: [16, 24) leaves it
    rig.backend.sessions_generation += 1
    statuses = write(rig, *shared([0, 16], [0, 16], [8, 8]))
    assert statuses[1].Code() == StatusCode.ERR_INVALID_ARGS
    assert statuses[0].Code() == statuses[2].Code() == StatusCode.IN_PROGRESS
    assert rig.copies.calls[-1][3] == [statuses[0], statuses[2]] and rig.routed == [False]


def test_an_empty_or_negative_range_goes_the_general_way(rig):
    statuses = write(rig, *shared([0, 8], [0, 8], [4, 0]))  # the empty range is dropped
    assert rig.copies.calls[-1][2] == [4, 4, 4] and all(s.InProgress() for s in statuses)
    statuses = write(rig, *shared([-8], [0], [4]))
    assert all(s.Code() == StatusCode.ERR_INVALID_ARGS for s in statuses) and rig.routed == [False, False]


def test_a_released_mapping_fails_its_pairs_and_takes_no_hold(rig):
    write(rig, *shared([0], [0], [4]))  # the route is cached
    for hold in rig.copies.calls[0][5]:
        hold.end()  # the batch's event fired
    rig.backend.device_peer_gone(rig.backend.peers.peer("peer"), "test: peer gone")  # releases, bumps
    statuses = write(rig, *shared([0], [0], [4]))
    assert all(s.Code() == StatusCode.ERR_BAD_STATE for s in statuses)
    assert len(rig.copies.calls) == 1 and rig.routed == [True, False]
    assert all(s.mapping.closed for s in rig.sessions)  # no hold left behind by the declined route


def test_a_stale_route_is_resolved_again(rig):
    write(rig, *shared([0], [0], [4], pairs=2), pairs=2)
    fresh = DeviceSession(rig.backend, rig.copies, SimpleNamespace(ptr=77_000, size=100), 9_000_000, 1000)
    old = rig.sessions[0]
    with rig.backend._sessions_lock:
        rig.backend._sessions[("peer", rig.local[0]._id, 0)] = fresh
        rig.backend.sessions_generation += 1  # what dropping the old one does
    write(rig, *shared([0], [0], [4], pairs=2), pairs=2)
    assert rig.copies.calls[-1][0] == [9_000_000, 2_000_000] and old.mapping not in rig.copies.calls[-1][5]
    assert rig.routed == [True, True]


def test_reads_take_the_general_path(rig):
    e = rig.engine
    lo, ro, sz = shared([0], [8], [4])
    e.batch_read(rig.local, lo, rig.remote, ro, sz, [e.allocate_transfer_uid() for _ in range(3)])
    assert rig.copies.calls[-1][0] == [10_000, 20_000, 30_000]  # into local memory
    assert rig.routed == []


def test_succeed_all_keeps_failures_and_wakes_waiters():
    waiting, failed, fresh = TransferStatus(), TransferStatus(), TransferStatus()
    for s in (waiting, failed, fresh):
        s._start()
    failed.Update(StatusCode.ERR_GPU_OP, "broken")
    woke = []
    t = threading.Thread(target=lambda: woke.append(waiting.WaitFor(5000)))
    t.start()
    while waiting._event is None:
        pass  # the waiter has armed its wake-up event
    succeed_all([waiting, failed, fresh])
    t.join(5)
    assert woke == [StatusCode.SUCCESS] and fresh.Succeeded()
    assert failed.Code() == StatusCode.ERR_GPU_OP and failed.Message() == "broken"


def test_the_routes_statuses_are_fresh_in_progress_and_wake_their_waiter(rig):
    statuses = write(rig, *shared([0, 16], [8, 40], [4, 8]))
    assert rig.routed == [True] and len(statuses) == 3 and len({id(s) for s in statuses}) == 3
    assert all(type(s) is TransferStatus and s.InProgress() and s.Message() == "" for s in statuses)
    given = rig.copies.calls[0][3]
    assert given == statuses and given is not statuses  # the engine's own list
    woke = []
    t = threading.Thread(target=lambda: woke.append(statuses[1].WaitFor(5000)))
    t.start()
    while statuses[1]._event is None:
        pass  # the waiter has armed its wake-up event
    succeed_all(given)
    t.join(5)
    assert woke == [StatusCode.SUCCESS] and all(s.Succeeded() for s in statuses)


def test_equal_arrays_that_are_not_one_object_are_not_shared(rig):
    lo = np.array([0], dtype=np.int64)
    (ro, sz) = shared([0], [4])
    statuses = write(rig, [lo, lo.copy(), lo], ro, sz)  # equal values, but one pair has its own array
    assert rig.routed == [] and all(s.InProgress() for s in statuses)  # the general path took it
    assert rig.copies.calls[-1][0] == [1_000_000, 2_000_000, 3_000_000]


def test_statuses_stocked_after_a_post_are_each_handed_out_once_and_fresh(rig):
    """The route makes the next call's statuses after its submit (issue 28): every call still gets
    its own, IN_PROGRESS, and completing one call's never touches another's."""
    first = write(rig, *shared([0], [0], [16]))
    second = write(rig, *shared([16], [16], [16]))
    two_pairs = write(rig, *shared([32], [32], [8], pairs=2), pairs=2)
    ids = [id(s) for s in first + second + two_pairs]
    assert len(set(ids)) == 8
    succeed_all(first)
    assert all(s.Succeeded() for s in first)
    assert all(s.InProgress() for s in second + two_pairs)
    assert [call[3] for call in rig.copies.calls] == [first, second, two_pairs]  # each call's own
    assert rig.routed == [True, True, True]


def test_a_call_the_route_hands_back_keeps_the_stocked_statuses_unseen(rig):
    write(rig, *shared([0], [0], [16]))  # stocks statuses for the next 3-pair call
    rig.sessions[1].local.size = 20
    rig.backend.sessions_generation += 1
    general = write(rig, *shared([16], [16], [8]))  # out of bounds for pair 1: the general path
    assert general[1].Code() == StatusCode.ERR_INVALID_ARGS and rig.routed[-1] is False
    rig.sessions[1].local.size = 100
    rig.backend.sessions_generation += 1
    routed = write(rig, *shared([0], [0], [8]))
    assert rig.routed[-1] is True
    assert all(s.InProgress() for s in routed) and not {id(s) for s in routed} & {id(s) for s in general}
