"""softio's gather copier reuses a range table's pinned and device buffers (issue 28: no pool
allocation on the way to a lone request's kernel launch), and only once the batch that used them
finished: the completion thread gives them back after the batch's event fired, never before and
never after a failed wait. Checked on the CPU with a stand-in CuPy and CUDA runtime (the kernel's
copies themselves run in test/gpu)."""

import threading
from types import SimpleNamespace

import numpy as np

from sglang_mori.softio import device_gather, device_path
from sglang_mori.softio.device_gather import GatherCopier, Staging
from sglang_mori.softio.enums import StatusCode
from sglang_mori.softio.status import started


class Cupy:
    """What GatherCopier calls of CuPy, logged: pinned and device allocations, uploads, launches."""

    def __init__(self):
        self.log = []
        cupy = self

        class Ctx:
            ptr = 7

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

        class Mem:
            def __init__(self, array):
                self.array = array

            def copy_from_host_async(self, mem, size, stream=None):
                cupy.log.append(("upload", self.array.ident, mem.value, size))

        class DeviceArray:
            made = 0

            def __init__(self, n, dtype=None):
                DeviceArray.made += 1
                self.ident, self.n, self.data = DeviceArray.made, n, Mem(self)
                cupy.log.append(("device", n))

        def alloc_pinned_memory(nbytes):
            cupy.log.append(("pinned", nbytes))
            return bytearray(nbytes)

        self.uint64 = np.uint64
        self.empty = DeviceArray
        self.cuda = SimpleNamespace(Device=lambda d: Ctx(), ExternalStream=lambda s: Ctx(),
                                    alloc_pinned_memory=alloc_pinned_memory)

    def kernel(self, grid, block, args):
        table = args[0]
        self.log.append(("launch", table.ident, [int(a) for a in args[1:]]))


def copier(variant="ranges"):
    # "ranges": the tables these tests spell out word by word (test_softio_gather_bytes.py: "bytes")
    cupy = Cupy()
    c = object.__new__(GatherCopier)
    c.__dict__.update(cupy=cupy, device=0, threads=device_gather.THREADS, blocks=16, peer_blocks=132, _streams={},
                      _free={}, kernel=cupy.kernel, shared_kernel=cupy.kernel, bytes_kernel=cupy.kernel,
                      dynamic_kernel=cupy.kernel,
                      variant=variant, unroll=8, share=0)
    return c, cupy.log


def shared_args(pairs=61, per=128, item=73728):
    base = np.arange(pairs, dtype=np.uint64) << np.uint64(32)
    off = np.arange(per, dtype=np.uint64) * np.uint64(item)
    return base, base + np.uint64(1 << 31), off, off, np.full(per, item, dtype=np.uint64)


def kinds(log, kind):
    return [e for e in log if e[0] == kind]


def test_a_table_in_use_is_never_handed_to_another_batch():
    c, log = copier()
    first = c.copy_shared(*shared_args(), 0)
    second = c.copy_shared(*shared_args(), 0)  # the first not given back: its kernel may still read it
    assert first is not second and first.host_ptr.value != second.host_ptr.value
    assert first.table is not second.table
    assert len(kinds(log, "pinned")) == 2 and len(kinds(log, "device")) == 2


def test_a_finished_batch_table_serves_the_next_one_without_allocating():
    c, log = copier()
    first = c.copy_shared(*shared_args(), 0)
    c.give_back(first)
    log.clear()
    again = c.copy_shared(*shared_args(per=120), 0)  # another length, the same size class
    assert again is first
    assert kinds(log, "pinned") == [] and kinds(log, "device") == []
    words = 2 * 61 + 3 * 120
    assert kinds(log, "upload") == [("upload", first.table.ident, first.host_ptr.value, words * 8)]
    assert kinds(log, "launch") == [("launch", first.table.ident, [61, 120])]
    # the words uploaded are the new table's, not the old one's
    assert first.host[2 * 61 + 3 * 120 - 1] == 73728 and first.host[2 * 61:2 * 61 + 120].tolist()[-1] == 119 * 73728


def test_the_flat_kernel_uploads_its_three_columns_only():
    c, log = copier()
    d = np.arange(5, dtype=np.uint64) << np.uint64(20)
    staging = c.copy(d, d + np.uint64(3), np.full(5, 4096, dtype=np.uint64), 0)
    assert kinds(log, "upload")[0][3] == 15 * 8 and kinds(log, "launch")[0][2] == [5]
    assert staging.host[:15].tolist() == d.tolist() + (d + np.uint64(3)).tolist() + [4096] * 5


def test_at_most_a_few_finished_tables_are_kept_per_size_class():
    c, _ = copier()
    tables = [c.copy_shared(*shared_args(), 0) for _ in range(device_gather._FREE_PER_CLASS + 3)]
    for t in tables:
        c.give_back(t)
    assert sum(len(v) for v in c._free.values()) == device_gather._FREE_PER_CLASS
    c.give_back("table")  # what another copier returns: not a Staging, not kept
    assert sum(len(v) for v in c._free.values()) == device_gather._FREE_PER_CLASS


class Runtime:
    """The CUDA runtime calls of a DeviceEngine; `synchronize` blocks until `fire` (or raises)."""

    def __init__(self):
        self.fired = threading.Event()
        self.broken = False

    def stream(self, device):
        return 7

    def event(self, device):
        return 1

    def use_device(self, device):
        pass

    def record(self, event, stream):
        pass

    def synchronize(self, event):
        assert self.fired.wait(10)
        if self.broken:
            raise RuntimeError("illegal address")

    def copy(self, *a):
        raise AssertionError("no long range here")


def device_engine(monkeypatch, rt):
    c, log = copier()
    monkeypatch.setattr(device_path, "make_copier", lambda device: c)
    return device_path.DeviceEngine(rt, 0, "reuse"), c


def test_the_completion_gives_the_table_back_only_after_the_event_fired(monkeypatch):
    rt = Runtime()
    engine, c = device_engine(monkeypatch, rt)
    try:
        statuses = started(61)
        engine.submit_shared(*(a.astype(np.int64) for a in shared_args()), statuses, True, ())
        assert not any(c._free.values())  # the copy is still running: nothing to reuse
        rt.fired.set()
        for s in statuses:
            s.Wait()
        assert all(s.Succeeded() for s in statuses)
        # given back right after the statuses, on the completion thread: wait for it by its queue
        engine._pending.put(None)
        engine._thread.join(10)
        assert [type(t) for v in c._free.values() for t in v] == [Staging]
    finally:
        engine.close()


def test_a_table_whose_wait_failed_is_never_reused(monkeypatch):
    rt = Runtime()
    rt.broken = True
    engine, c = device_engine(monkeypatch, rt)
    statuses = started(61)
    engine.submit_shared(*(a.astype(np.int64) for a in shared_args()), statuses, True, ())
    rt.fired.set()
    for s in statuses:
        s.Wait()
    assert {int(s.Code()) for s in statuses} == {int(StatusCode.ERR_GPU_OP)}
    engine.close()
    engine._thread.join(10)
    assert not any(c._free.values())


def test_an_empty_shared_batch_launches_nothing_and_succeeds(monkeypatch):
    rt = Runtime()
    rt.fired.set()
    engine, c = device_engine(monkeypatch, rt)
    try:
        statuses = started(2)
        empty = np.empty(0, dtype=np.int64)
        engine.submit_shared(np.array([0, 1 << 32]), np.array([0, 1 << 31]), empty, empty, empty, statuses, True, ())
        for s in statuses:
            s.Wait()
        assert all(s.Succeeded() for s in statuses)
        assert kinds(c.cupy.log, "launch") == [] and kinds(c.cupy.log, "upload") == []
    finally:
        engine.close()
