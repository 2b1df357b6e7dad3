"""softio's device path hands ranges of at least SGLANG_MORI_SOFTIO_CE_MIN_BYTES to the copy engines
and the rest to the gather kernel, both on the engine's stream before the batch's event. Checked on
CPU with a recording CUDA runtime and copier (the copies themselves run in test/gpu)."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from sglang_mori.softio import device_path
from sglang_mori.softio.device_gather import CE_MIN_ENV, ce_min_bytes, split_long
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
