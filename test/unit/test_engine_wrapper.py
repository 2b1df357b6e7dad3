"""TransferEngine over a fake `io` module with mori.io's API, and load_io_module's errors."""

import os
import sys
import types

import pytest

import sglang_mori.softio
from sglang_mori.engine.loader import EngineUnavailable, load_io_module
from sglang_mori.engine.transfer_engine import (
    ERR_RDMA_OP,
    IN_PROGRESS,
    SUCCESS,
    SubmitError,
    WritePair,
)

from fake_mori_io import (  # noqa: F401 (clock: a fixture)
    SQ_FULL,
    Status,
    ok,
    sq_full,
    EngineDesc,
    EngineWithFailureEvents,
    fake_io,
    make_engine,
    pair,
    clock,
)


# --- construction and keys ---------------------------------------------------------------------

def test_construction_follows_the_mori_call_order():
    io = fake_io()
    eng = make_engine(io, role="decode", host="127.0.0.1", qp_per_transfer=3, post_batch_size=32,
                      num_workers=5, enable_notification=True)
    e = eng.engine
    assert e.key == eng.key
    assert e.config == ("IOEngineConfig", "127.0.0.1", 0)
    assert e.backends == [(io.BackendType.RDMA,
                           ("RdmaBackendConfig", 3, 32, 5, io.PollCqMode.POLLING, True))]
    # The descriptor is taken after create_backend (its port is only known then).
    assert eng.desc.port == 40001
    assert eng.packed_desc == f"{eng.key}|40001".encode()


def test_engine_keys_unique_and_carry_pid():
    keys = [make_engine(role="prefill", host="127.0.0.1").key for _ in range(20)]
    assert len(set(keys)) == 20
    for key in keys:
        assert f"pid{os.getpid()}" in key
        assert key.startswith("sglang-mori-prefill-127.0.0.1-")
    assert make_engine(role="decode").key.startswith("sglang-mori-decode-")


# --- memory ----------------------------------------------------------------------------------

@pytest.mark.parametrize("size", [0, -1])
def test_zero_length_buffer_not_registered(size):
    eng = make_engine()
    assert eng.register(0x1000, size, 0, on_gpu=True) is None
    assert eng.engine.registered == []
    eng.deregister_all()
    assert eng.engine.deregistered == []


def test_register_and_deregister_all():
    io = fake_io()
    eng = make_engine(io)
    gpu = eng.register(0x1000, 4096, 3, on_gpu=True)
    cpu = eng.register(0x2000, 64, 0, on_gpu=False)
    assert (gpu.ptr, gpu.size, gpu.loc) == (0x1000, 4096, io.MemoryLocationType.GPU)
    assert cpu.loc == io.MemoryLocationType.CPU
    assert eng.engine.registered == [(0x1000, 4096, 3, io.MemoryLocationType.GPU),
                                     (0x2000, 64, 0, io.MemoryLocationType.CPU)]
    eng.deregister_all()
    assert eng.engine.deregistered == [gpu, cpu]
    eng.deregister_all()  # nothing left: no double deregistration
    assert eng.engine.deregistered == [gpu, cpu]


def test_deregister_failure_is_logged_not_raised(caplog):
    eng = make_engine()
    eng.register(0x1000, 16, 0, on_gpu=False)
    eng.engine.fail_deregister = True
    eng.deregister_all()
    assert "deregister_memory failed: deregister failed" in caplog.text


def test_unpack_memory_uses_the_module():
    desc = make_engine().unpack_memory(b"4096:16")
    assert (desc.ptr, desc.size) == (4096, 16)


# --- peers -----------------------------------------------------------------------------------

def test_add_peer_registers_once_per_key():
    eng = make_engine()
    a = EngineDesc("decode-a", 1).pack()
    b = EngineDesc("decode-b", 2).pack()
    assert eng.add_peer(a) == "decode-a"
    assert eng.add_peer(a) == "decode-a"
    assert eng.add_peer(b) == "decode-b"
    assert eng.add_peer(a) == "decode-a"
    assert eng.engine.remotes == ["decode-a", "decode-b"]


def test_remove_peer_then_add_registers_again():
    eng = make_engine()
    a = EngineDesc("decode-a", 1).pack()
    eng.add_peer(a)
    eng.remove_peer("decode-a")
    eng.remove_peer("decode-a")  # unknown now: no second deregistration
    eng.remove_peer("never-added")
    assert eng.engine.remotes_removed == ["decode-a"]
    eng.add_peer(a)
    assert eng.engine.remotes == ["decode-a", "decode-a"]


def test_connect_creates_session():
    eng = make_engine()
    eng.connect("local-desc", "remote-desc")
    assert eng.engine.sessions == [("local-desc", "remote-desc")]


def test_peer_failure_events():
    assert make_engine().pop_peer_failures() == []  # engine without pop_peer_failure
    eng = make_engine(fake_io(EngineWithFailureEvents))
    assert eng.has_peer_failure_events
    class Event:
        def __init__(self, key):
            self.remote_engine_key, self.reason, self.detail = key, "QP_ERROR", "retry exceeded"

    eng.engine.failure_events = [Event("d1"), Event("d2")]
    events = eng.pop_peer_failures()
    assert [e.engine_key for e in events] == ["d1", "d2"]
    assert events[0].reason == "peer failure of d1 reported by the engine: QP_ERROR retry exceeded"
    assert eng.pop_peer_failures() == []


def test_peer_failure_events_bounded():
    eng = make_engine(fake_io(EngineWithFailureEvents))
    eng.engine.pop_peer_failure = lambda: "event"  # never drains
    assert len(eng.pop_peer_failures()) == 1024


# --- write -----------------------------------------------------------------------------------

def test_write_nothing():
    eng = make_engine()
    h = eng.write("decode-a", [], deadline=0.0, retry_max=5)
    assert (h.peer_key, h.nbytes, h.live, h.issued, h.unaccounted) == ("decode-a", 0, [], [], False)
    assert eng.engine.calls == []


def test_write_one_batch_for_all_pairs(clock):
    eng = make_engine()
    pairs = [pair(0), pair(1), pair(2)]
    h = eng.write("decode-a", pairs, deadline=clock.now + 10, retry_max=5)
    assert h.peer_key == "decode-a"
    assert h.nbytes == (8 + 1) + (8 + 2) + (8 + 3)
    (call,) = eng.engine.calls
    assert call == (["L0", "L1", "L2"], [[0, 10], [100, 110], [200, 210]], ["R0", "R1", "R2"],
                    [[0, 20], [200, 220], [400, 420]], [[8, 1], [8, 2], [8, 3]], [1, 2, 3])
    assert h.live == h.issued and len(h.live) == 3
    assert h.result() == SUCCESS and h.quiescent()
    assert clock.sleeps == []


def test_sq_full_pairs_are_resubmitted(clock):
    eng = make_engine()
    first = [ok(), sq_full(), Status(ERR_RDMA_OP, "remote access error"), sq_full()]
    second = [sq_full(), Status(IN_PROGRESS)]  # pair 1 still full, pair 3 posted
    third = [ok()]  # pair 1 finally posted
    eng.engine.script = [first, second, third]
    pairs = [pair(i) for i in range(4)]
    h = eng.write("decode-a", pairs, deadline=clock.now + 10, retry_max=5)

    calls = eng.engine.calls
    assert len(calls) == 3
    assert calls[1][0] == ["L1", "L3"] and calls[1][2] == ["R1", "R3"]
    assert calls[1][1] == [[100, 110], [300, 310]] and calls[1][4] == [[8, 2], [8, 4]]
    assert calls[2][0] == ["L1"]
    uids = [u for c in calls for u in c[5]]
    assert len(uids) == len(set(uids)) == 7  # a fresh uid for every attempt

    # live: the latest attempt per pair; the non-"SQ full" failure is not retried.
    assert h.live == [first[0], third[0], first[2], second[1]]
    # issued: every status ever posted, failed attempts included, in submission order.
    assert h.issued == first + second + third
    assert h.result() == ERR_RDMA_OP
    assert not h.quiescent()  # pair 3 is still in progress
    second[1].code = SUCCESS
    assert h.quiescent()
    assert len(clock.sleeps) == 2 and all(s > 0 for s in clock.sleeps)


def test_sq_full_retries_bounded_by_retry_max(clock):
    eng = make_engine()
    eng.engine.script = [[sq_full(), ok()]] + [[sq_full()] for _ in range(10)]
    h = eng.write("decode-a", [pair(0), pair(1)], deadline=clock.now + 3600, retry_max=3)
    assert len(eng.engine.calls) == 1 + 3
    assert len(h.issued) == 2 + 3
    assert h.live[0] is h.issued[-1] and h.live[0].message == SQ_FULL
    assert h.result() == ERR_RDMA_OP
    assert h.quiescent()


def test_retry_max_zero_never_resubmits(clock):
    eng = make_engine()
    eng.engine.script = [[sq_full()]]
    h = eng.write("decode-a", [pair(0)], deadline=clock.now + 3600, retry_max=0)
    assert len(eng.engine.calls) == 1
    assert h.result() == ERR_RDMA_OP
    assert clock.sleeps == []


def test_sq_full_retries_stop_at_the_deadline(clock):
    eng = make_engine()
    eng.engine.script = [[sq_full()] for _ in range(50)]
    start = clock.now
    deadline = start + 0.01
    h = eng.write("decode-a", [pair(0)], deadline=deadline, retry_max=40)
    attempts = len(eng.engine.calls)
    assert 1 < attempts < 41
    assert len(h.issued) == attempts
    assert clock.now < deadline  # never slept past the deadline
    assert len(clock.sleeps) == attempts - 1
    assert h.result() == ERR_RDMA_OP and h.live[0].message == SQ_FULL


def test_no_retry_when_deadline_already_passed(clock):
    eng = make_engine()
    eng.engine.script = [[sq_full()]]
    h = eng.write("decode-a", [pair(0)], deadline=clock.now - 1, retry_max=5)
    assert len(eng.engine.calls) == 1
    assert clock.sleeps == []
    assert h.result() == ERR_RDMA_OP


def test_batch_write_raising_is_submit_error_with_unaccounted_handle(clock):
    eng = make_engine()
    eng.engine.script = [RuntimeError("no route to peer decode-a")]
    with pytest.raises(SubmitError) as info:
        eng.write("decode-a", [pair(0), pair(1)], deadline=clock.now + 10, retry_max=5)
    err = info.value
    assert str(err) == "RuntimeError: no route to peer decode-a"
    assert isinstance(err.__cause__, RuntimeError)
    h = err.handle
    assert h.peer_key == "decode-a" and h.nbytes == 9 + 10
    assert h.unaccounted is True
    assert h.issued == []
    assert not h.quiescent()


def test_batch_write_raising_on_a_retry_keeps_earlier_statuses(clock):
    eng = make_engine()
    first = [Status(IN_PROGRESS), sq_full()]
    eng.engine.script = [first, ValueError("bad session")]
    with pytest.raises(SubmitError) as info:
        eng.write("decode-a", [pair(0), pair(1)], deadline=clock.now + 10, retry_max=5)
    h = info.value.handle
    assert str(info.value) == "ValueError: bad session"
    assert h.issued == first
    assert h.unaccounted is True
    first[0].code = SUCCESS
    assert not h.quiescent()  # the raising call may have posted writes we hold no status for


def test_wait_running_waits_on_the_first_running_status(clock):
    eng = make_engine()
    running = Status(IN_PROGRESS)
    waited = []
    running.WaitFor = lambda ms: waited.append(ms)
    eng.engine.script = [[ok(), running]]
    h = eng.write("decode-a", [pair(0), pair(1)], deadline=clock.now + 10, retry_max=0)
    assert h.wait_running(250) is True
    assert waited == [250]
    running.code = SUCCESS
    assert h.wait_running(250) is False  # nothing running: returns at once
    assert waited == [250]


def test_sq_full_resubmissions_are_counted_on_the_handle(clock):
    eng = make_engine()
    eng.engine.script = [[sq_full(), ok()], [ok()]]
    h = eng.write("decode-a", [pair(0), pair(1)], deadline=clock.now + 10, retry_max=5)
    assert h.retries == 1


# --- loader ----------------------------------------------------------------------------------

def test_load_unknown_engine():
    with pytest.raises(EngineUnavailable) as info:
        load_io_module("bogus")
    msg = str(info.value)
    assert "SGLANG_MORI_ENGINE='bogus'" in msg
    assert "'mori'" in msg and "'soft'" in msg


def test_load_mori_missing(monkeypatch):
    # A None entry in sys.modules makes the import fail with ImportError, whatever is installed.
    monkeypatch.setitem(sys.modules, "mori", None)
    with pytest.raises(EngineUnavailable) as info:
        load_io_module("mori")
    msg = str(info.value)
    assert msg.startswith("SGLANG_MORI_ENGINE=mori: cannot import mori.io: ")
    assert isinstance(info.value.__cause__, ImportError)
    assert "SGLANG_MORI_ENGINE=soft" in msg
    assert "amd-mori" in msg


def test_load_mori_without_rocm_runtime(monkeypatch, tmp_path):
    """An OSError from a missing ROCm library while importing mori.io is reported the same way."""
    pkg = tmp_path / "mori"
    pkg.mkdir()
    (pkg / "io.py").write_text(
        'raise OSError("libamdhip64.so: cannot open shared object file: No such file or directory")\n')
    fake_pkg = types.ModuleType("mori")
    fake_pkg.__path__ = [str(pkg)]
    monkeypatch.setitem(sys.modules, "mori", fake_pkg)
    monkeypatch.delitem(sys.modules, "mori.io", raising=False)
    with pytest.raises(EngineUnavailable) as info:
        load_io_module("mori")
    msg = str(info.value)
    assert "SGLANG_MORI_ENGINE=mori: cannot import mori.io: OSError: libamdhip64.so" in msg
    assert "SGLANG_MORI_ENGINE=soft" in msg
    assert isinstance(info.value.__cause__, OSError)
    assert "mori.io" not in sys.modules


def test_load_soft():
    assert load_io_module("soft") is sglang_mori.softio


def test_load_soft_failure_has_no_mori_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang_mori.softio", None)
    with pytest.raises(EngineUnavailable) as info:
        load_io_module("soft")
    msg = str(info.value)
    assert msg.startswith("SGLANG_MORI_ENGINE=soft: cannot import sglang_mori.softio: ")
    assert "amd-mori" not in msg


def test_close_releases_memory_peers_and_backend():
    """What a runtime role switch needs: nothing of the old engine stays registered or running."""
    eng = make_engine()
    inner = eng.engine
    removed = []
    inner.remove_backend = lambda kind: removed.append(kind)
    gpu = eng.register(0x1000, 4096, 3, True)
    eng.add_peer(EngineDesc("decode-a", 1).pack())
    eng.close()
    assert eng.engine is None
    assert inner.deregistered == [gpu] and inner.remotes_removed == ["decode-a"]
    assert removed == [eng.io.BackendType.RDMA]
    eng.close()  # idempotent
    assert removed == [eng.io.BackendType.RDMA]


# --- plans' arrays across the engine boundary -------------------------------------------------

def test_mori_gets_lists_and_each_shared_array_is_converted_once():
    import numpy as np

    engine = make_engine()
    assert not engine.takes_arrays  # the fake, like MORI's bindings, has no _TAKES_OFFSET_ARRAYS
    shared = np.array([0, 4096], dtype=np.int64)
    sizes = np.array([4096, 4096], dtype=np.int64)
    pairs = [WritePair(f"L{i}", f"R{i}", shared, shared, sizes) for i in range(3)]
    handle = engine.write("peer", pairs, deadline=1e9, retry_max=0)
    _, lo, _, ro, sz, _ = engine.engine.calls[-1]
    assert handle.nbytes == 3 * 8192
    assert all(type(v) is list for column in (lo, ro, sz) for v in column)
    assert lo[0] == [0, 4096] and sz[2] == [4096, 4096]
    assert lo[0] is lo[1] is lo[2] is ro[0]  # one list for the one shared array


def test_softio_gets_the_arrays_themselves():
    import numpy as np

    engine = make_engine()
    engine.takes_arrays = True  # what TransferEngine reads off softio's module
    offsets = np.array([0, 4096], dtype=np.int64)
    engine.write("peer", [WritePair("L", "R", offsets, offsets, offsets + 1)], deadline=1e9, retry_max=0)
    _, lo, _, _, sz, _ = engine.engine.calls[-1]
    assert lo[0] is offsets and sz[0].tolist() == [1, 4097]
    assert sglang_mori.softio._TAKES_OFFSET_ARRAYS is True


def test_quiescent_reads_earlier_attempts_after_a_resubmission(clock):
    """Every live status succeeded, but an earlier attempt of a resubmitted pair still runs: the
    handle is not quiescent (the shortcut from result() holds only when nothing was resubmitted)."""
    eng = make_engine()
    first = [sq_full(), ok()]
    eng.engine.script = [first, [ok()]]
    h = eng.write("decode-a", [pair(0), pair(1)], deadline=clock.now + 10, retry_max=5)
    first[0].code = IN_PROGRESS  # an attempt whose earlier post-batches are still writing
    assert h.result() == SUCCESS
    assert not h.quiescent()
    first[0].code = SUCCESS
    assert h.quiescent()
