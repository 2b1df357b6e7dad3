"""softio's device path turns the pairs of one batch_write into one list of copies (DeviceBatch):
the addresses, the read/write direction and the per-pair failures are checked here on CPU, with a
recording engine in place of the CUDA one (the copies themselves run in test/gpu)."""

from types import SimpleNamespace

import numpy as np

from sglang_mori.softio.device_path import DeviceBatch, DeviceSession, expand_shared
from sglang_mori.softio.enums import StatusCode
from sglang_mori.softio.status import TransferStatus


class RecordingEngine:
    def __init__(self):
        self.calls = []

    def submit(self, dsts, srcs, sizes, statuses, to_peer=False, holds=()):
        self.calls.append((dsts.tolist(), srcs.tolist(), sizes.tolist(), list(statuses)))
        self.to_peer = to_peer

    def submit_shared(self, dst_base, src_base, dst_off, src_off, sizes, statuses, to_peer=False, holds=()):
        """The engine's table of shared ranges, recorded as the flat copies it stands for."""
        self.submit(*expand_shared(dst_base, src_base, dst_off, src_off, sizes), statuses, to_peer, holds)


def session(engine, local_ptr, local_size, remote_base, remote_size, to_peer=False):
    return DeviceSession(None, engine, SimpleNamespace(ptr=local_ptr, size=local_size), remote_base, remote_size,
                         to_peer)


def test_pairs_of_one_call_become_one_submission_with_their_addresses():
    engine = RecordingEngine()
    a = session(engine, 1000, 100, 50_000, 100)
    b = session(engine, 2000, 100, 60_000, 100)
    batch = DeviceBatch()
    s1, s2, s3 = TransferStatus(), TransferStatus(), TransferStatus()
    a.add_to(batch, [0, 10], [5, 50], [4, 0], s1, False)  # a zero-size range is dropped
    b.add_to(batch, np.array([1]), np.array([2]), np.array([3]), s2, True)  # a read: remote -> local
    a.add_to(batch, [], [], [], s3, False)
    batch.submit()
    assert s3.Code() == StatusCode.SUCCESS  # empty: succeeds at once, not submitted
    assert engine.calls == [([50_005, 2001], [1000, 60_002], [4, 3], [s1, s2])]
    assert s1.Code() == s2.Code() == StatusCode.IN_PROGRESS


def test_a_pair_with_a_range_outside_its_region_fails_alone_and_sends_nothing():
    engine = RecordingEngine()
    a = session(engine, 1000, 100, 50_000, 100)
    batch = DeviceBatch()
    good, bad, ragged = TransferStatus(), TransferStatus(), TransferStatus()
    a.add_to(batch, [0], [0], [10], good, False)
    a.add_to(batch, [0, 95], [0, 0], [10, 10], bad, False)  # 95 + 10 > 100
    a.add_to(batch, [0, 1], [0], [1, 1], ragged, False)
    batch.submit()
    assert bad.Code() == StatusCode.ERR_INVALID_ARGS and ragged.Code() == StatusCode.ERR_INVALID_ARGS
    assert engine.calls == [([50_000], [1000], [10], [good])]


def test_a_batch_with_a_pair_into_another_gpu_is_submitted_as_crossing_the_link():
    engine = RecordingEngine()
    same = session(engine, 1000, 100, 50_000, 100)
    other = session(engine, 2000, 100, 60_000, 100, to_peer=True)
    batch = DeviceBatch()
    same.add_to(batch, [0], [0], [8], TransferStatus(), False)
    batch.submit()
    assert engine.to_peer is False
    batch = DeviceBatch()
    same.add_to(batch, [0], [0], [8], TransferStatus(), False)
    other.add_to(batch, [0], [0], [8], TransferStatus(), False)
    batch.submit()
    assert engine.to_peer is True and engine.calls[-1][0] == [50_000, 60_000]


def test_plans_arrays_and_lists_give_the_same_copies():
    lists, arrays = RecordingEngine(), RecordingEngine()
    for engine, kind in ((lists, list), (arrays, np.array)):
        batch = DeviceBatch()
        for base in (0, 40):
            session(engine, 1000 + base, 100, 50_000 + base, 100).add_to(
                batch, kind([0, 16]), kind([8, 24]), kind([4, 4]), TransferStatus(), False)
        batch.submit()
    assert lists.calls[0][:3] == arrays.calls[0][:3] == ([50_008, 50_024, 50_048, 50_064],
                                                         [1000, 1016, 1040, 1056], [4, 4, 4, 4])


def test_shared_arrays_give_the_copies_of_lists_and_a_short_region_still_fails_alone():
    lists, arrays = RecordingEngine(), RecordingEngine()
    lo, ro, sz = np.array([0, 16]), np.array([8, 24]), np.array([4, 4])
    for engine, columns in ((lists, ([0, 16], [8, 24], [4, 4])), (arrays, (lo, ro, sz))):
        batch = DeviceBatch()
        for base in (0, 40):  # the same three array objects for both pairs: one broadcast table
            session(engine, 1000 + base, 100, 50_000 + base, 100).add_to(batch, *columns, TransferStatus(), False)
        batch.submit()
    assert lists.calls[0][:3] == arrays.calls[0][:3] == ([50_008, 50_024, 50_048, 50_064],
                                                         [1000, 1016, 1040, 1056], [4, 4, 4, 4])
    engine, batch = RecordingEngine(), DeviceBatch()
    good, short = TransferStatus(), TransferStatus()
    session(engine, 1000, 100, 50_000, 100).add_to(batch, lo, ro, sz, good, False)
    session(engine, 2000, 18, 60_000, 100).add_to(batch, lo, ro, sz, short, False)  # 16 + 4 > 18
    batch.submit()
    assert short.Code() == StatusCode.ERR_INVALID_ARGS
    assert engine.calls == [([50_008, 50_024], [1000, 1016], [4, 4], [good])]
