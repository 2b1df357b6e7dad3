"""softio's device path hands ranges of at least SGLANG_MORI_SOFTIO_CE_MIN_BYTES to the copy engines
and the rest to the gather kernel, both on the engine's stream before the batch's event. Checked on
CPU with a recording CUDA runtime and copier (the copies themselves run in test/gpu)."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from sglang_mori.softio import device_path
from sglang_mori.softio.device_gather import CE_MIN_ENV, ce_min_bytes, fill_compact_table, split_long
from sglang_mori.softio.remote_mapping import RemoteMapping, begin_all, end_all
from sglang_mori.softio.status import TransferStatus, start_all

MIB = 1 << 20


class RecordingRuntime:
    """The calls a DeviceEngine makes into cuda_runtime, in order, with no GPU."""

    def __init__(self):
        self.log = []
        self._events = 0

    def stream(self, device):
        return 7

    def event(self, device):
        self._events += 1
        return self._events

    def use_device(self, device):
        pass

    def record(self, event, stream):
        self.log.append(("record", event, stream))

    def synchronize(self, event):
        pass

    def copy(self, dsts, srcs, sizes, stream, device):
        self.log.append(("ce", dsts.tolist(), srcs.tolist(), sizes.tolist(), stream))


class RecordingCopier:
    def __init__(self, log):
        self.log = log

    def copy(self, dsts, srcs, sizes, stream, to_peer=False):
        self.log.append(("kernel", dsts.tolist(), srcs.tolist(), sizes.tolist(), stream))
        return "table"

    def copy_shared(self, dst_base, src_base, dst_off, src_off, sizes, stream, to_peer=False):
        # the shared kernel's table as GatherCopier writes it, read back range by range as the kernel does
        pairs, per = len(dst_base), len(sizes)
        host = np.zeros(2 * pairs + 3 * per, dtype=np.uint64)
        fill_compact_table(host, dst_base, src_base, dst_off, src_off, sizes)
        self.log.append(("kernel", *compact_table_ranges(host, pairs, per), stream))
        return "table"


def compact_table_ranges(table, pairs: int, per: int):
    """(dsts, srcs, sizes) lists of a `gather_copy_shared` table, with the kernel's index arithmetic
    (range r: pair r // per, shared range r - pair * per)."""
    t = [int(x) for x in table]
    dsts, srcs, sizes = [], [], []
    for r in range(pairs * per):
        p = r // per
        j = r - p * per
        dsts.append(t[p] + t[2 * pairs + j])
        srcs.append(t[pairs + p] + t[2 * pairs + per + j])
        sizes.append(t[2 * pairs + 2 * per + j])
    return dsts, srcs, sizes


@pytest.fixture
def engine(monkeypatch):
    rt = RecordingRuntime()
    monkeypatch.setattr(device_path, "make_copier", lambda device: RecordingCopier(rt.log))
    monkeypatch.delenv(CE_MIN_ENV, raising=False)
    eng = device_path.DeviceEngine(rt, 0, "test")
    yield eng, rt
    eng.close()


def u64(values):
    return np.array(values, dtype=np.uint64)


def submit_and_wait(eng, dsts, srcs, sizes):
    status = TransferStatus()
    start_all([status])  # as the backend does when it submits
    eng.submit(u64(dsts), u64(srcs), u64(sizes), [status], to_peer=True)
    status.WaitFor(5000)
    return status


def test_long_ranges_go_to_the_copy_engines_and_short_ones_to_the_kernel_before_the_event(engine):
    eng, rt = engine
    status = submit_and_wait(eng, [0, 10 * MIB, 40 * MIB], [100, 20 * MIB, 60 * MIB], [4096, 16 * MIB, MIB])
    assert status.Succeeded()
    kinds = [entry[0] for entry in rt.log]
    assert kinds == ["ce", "kernel", "record"]
    assert rt.log[0][1:4] == ([10 * MIB, 40 * MIB], [20 * MIB, 60 * MIB], [16 * MIB, MIB])
    assert rt.log[1][1:4] == ([0], [100], [4096])
    assert {entry[-1] for entry in rt.log} == {7}  # every copy and the event on the engine's stream
    assert eng.ce_ranges == 2 and eng.ranges == 3 and eng.bytes == 4096 + 17 * MIB


def test_a_batch_of_only_short_ranges_never_calls_the_copy_engines(engine):
    eng, rt = engine
    assert submit_and_wait(eng, [0, 8192], [0, 4096], [4096, 4096]).Succeeded()
    assert [entry[0] for entry in rt.log] == ["kernel", "record"]


def test_a_batch_of_only_long_ranges_launches_no_kernel(engine):
    eng, rt = engine
    assert submit_and_wait(eng, [0], [32 * MIB], [16 * MIB]).Succeeded()
    assert [entry[0] for entry in rt.log] == ["ce", "record"]


def test_threshold_zero_keeps_every_range_on_the_kernel(monkeypatch):
    rt = RecordingRuntime()
    monkeypatch.setattr(device_path, "make_copier", lambda device: RecordingCopier(rt.log))
    monkeypatch.setenv(CE_MIN_ENV, "0")
    eng = device_path.DeviceEngine(rt, 0, "test")
    try:
        assert submit_and_wait(eng, [0], [32 * MIB], [16 * MIB]).Succeeded()
    finally:
        eng.close()
    assert [entry[0] for entry in rt.log] == ["kernel", "record"]


def test_a_bad_threshold_is_refused_with_the_variable_named(monkeypatch):
    monkeypatch.setenv(CE_MIN_ENV, "1MiB")
    with pytest.raises(ValueError, match=CE_MIN_ENV):
        ce_min_bytes()


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1 << 40), st.integers(0, 1 << 40), st.integers(0, 4 * MIB)), max_size=40),
       st.integers(0, 4 * MIB))
def test_split_long_partitions_the_ranges_keeping_their_order(ranges, threshold):
    cols = np.array(ranges, dtype=np.uint64).reshape(-1, 3)
    (ld, ls, ln), (sd, ss, sn) = split_long(cols[:, 0], cols[:, 1], cols[:, 2], threshold)
    is_long = [threshold > 0 and r[2] >= threshold for r in ranges]
    assert list(zip(ld.tolist(), ls.tolist(), ln.tolist())) == [r for r, x in zip(ranges, is_long) if x]
    assert list(zip(sd.tolist(), ss.tolist(), sn.tolist())) == [r for r, x in zip(ranges, is_long) if not x]
    assert all(a.dtype == np.uint64 for a in (ld, ls, ln, sd, ss, sn))


def _shared_case(draw_ranges, pairs):
    rng = np.random.default_rng(len(draw_ranges) * 31 + pairs)
    dst_base = rng.integers(0, 1 << 40, pairs).astype(np.uint64)
    src_base = rng.integers(0, 1 << 40, pairs).astype(np.uint64)
    cols = np.array(draw_ranges, dtype=np.uint64).reshape(-1, 3)
    return dst_base, src_base, cols[:, 0], cols[:, 1], cols[:, 2]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1 << 40), st.integers(0, 1 << 40), st.integers(1, 4 * MIB)),
                min_size=1, max_size=30), st.integers(1, 8))
def test_a_shared_table_makes_the_calls_of_its_flat_table_in_the_same_order(ranges, pairs):
    """submit_shared (every pair the same ranges of its own regions) enqueues exactly what submit
    enqueues for the flattened table: the same copy-engine copies and kernel table, pair by pair,
    and the same counters."""
    dst_base, src_base, do, so, sz = _shared_case(ranges, pairs)
    logs = []
    for shared in (False, True):
        rt = RecordingRuntime()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(device_path, "make_copier", lambda device: RecordingCopier(rt.log))
            mp.delenv(CE_MIN_ENV, raising=False)
            eng = device_path.DeviceEngine(rt, 0, "test")
        status = TransferStatus()
        start_all([status])
        try:
            if shared:
                eng.submit_shared(dst_base, src_base, do, so, sz, [status], to_peer=True)
            else:
                eng.submit(*device_path.expand_shared(dst_base, src_base, do, so, sz), [status], to_peer=True)
            assert status.WaitFor(5000) == status.Code() and status.Succeeded()
        finally:
            eng.close()
        logs.append((rt.log, eng.ce_ranges, eng.ranges, eng.bytes))
    assert logs[0] == logs[1]
    assert logs[1][2] == pairs * len(ranges) and logs[1][3] == pairs * int(sz.sum())


def test_the_compact_table_holds_the_bases_then_the_shared_ranges():
    host = np.zeros(2 * 2 + 3 * 3, dtype=np.uint64)
    fill_compact_table(host, u64([1000, 2000]), u64([50, 60]), u64([0, 10, 20]), u64([1, 2, 3]), u64([4, 5, 6]))
    assert host.tolist() == [1000, 2000, 50, 60, 0, 10, 20, 1, 2, 3, 4, 5, 6]
    assert compact_table_ranges(host, 2, 3) == ([1000, 1010, 1020, 2000, 2010, 2020], [51, 52, 53, 61, 62, 63],
                                                [4, 5, 6, 4, 5, 6])


class ClosingRuntime:
    def __init__(self):
        self.closed = []

    def close(self, handle, device):
        self.closed.append(handle)


def test_a_shared_batch_whose_copy_raises_fails_its_statuses_and_gives_its_holds_back_after_its_event(engine):
    eng, rt = engine
    runtime = ClosingRuntime()
    holds = (RemoteMapping(runtime, b"a", 0, "memory a"), RemoteMapping(runtime, b"b", 0, "memory b"))
    assert begin_all(holds)
    holds[1].release()  # its peer went away meanwhile: unmapped once this batch gave it back

    def boom(*args, **kwargs):
        raise RuntimeError("launch failed")

    eng.copier.copy_shared = boom
    status = TransferStatus()
    start_all([status])
    eng.submit_shared(u64([0]), u64([0]), u64([0, 8]), u64([0, 8]), u64([4, 4]), [status], True, holds)
    status.WaitFor(5000)
    assert status.Failed() and "launch failed" in status.Message()
    assert [entry[0] for entry in rt.log] == ["record"]  # the event behind whatever was queued
    assert runtime.closed == [b"b"] and not holds[0].closed and holds[1].closed


def test_holds_taken_together_are_all_or_none():
    runtime = ClosingRuntime()
    a, b = RemoteMapping(runtime, b"a", 0, "memory a"), RemoteMapping(runtime, b"b", 0, "memory b")
    b.release()
    assert runtime.closed == [b"b"]  # nothing in flight: unmapped at once
    assert not begin_all((a, b))
    a.release()
    assert runtime.closed == [b"b", b"a"]  # `a` was not left taken by the refused batch
    c, d = RemoteMapping(runtime, b"c", 0, "memory c"), RemoteMapping(runtime, b"d", 0, "memory d")
    assert begin_all((c, d)) and begin_all((c,))
    c.release()
    d.release()
    assert runtime.closed[2:] == []  # both still under a batch
    end_all((c, d))
    assert runtime.closed[2:] == [b"d"]  # c has a second batch in flight
    end_all((c,))
    assert runtime.closed[2:] == [b"d", b"c"]
