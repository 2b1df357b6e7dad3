"""softio's registration of GPU memory it cannot export: the transfer process's imported pools (one
line per pool at every child start, expected) log at debug; any other GPU memory without an IPC
handle still warns, since a peer that must open it will fail. Fake CUDA runtime, no GPU."""

import logging
import threading

import numpy as np
import pytest

from sglang_mori.softio import cuda_runtime, memory
from sglang_mori.softio.enums import MemoryLocationType


class UnexportableRuntime:
    """A runtime where every pointer is device 0 memory that cudaIpcGetMemHandle refuses."""

    def __init__(self):
        self._imported, self._lock = [], threading.Lock()  # what CudaRuntime's two methods use

    device_of = staticmethod(lambda ptr: 0)

    def export(self, ptr, device):
        raise cuda_runtime.CudaError("cudaIpcGetMemHandle failed: error 1 (invalid argument)")

    note_imported = cuda_runtime.CudaRuntime.note_imported
    imported = cuda_runtime.CudaRuntime.imported


@pytest.fixture
def runtime(monkeypatch):
    rt = UnexportableRuntime()
    monkeypatch.setattr(cuda_runtime, "load", lambda: rt)
    return rt


def register(buf) -> object:
    return memory.LocalMemory("engine").register(buf.ctypes.data, buf.nbytes, 0, MemoryLocationType.GPU)


def test_an_imported_pool_registers_without_a_handle_at_debug(runtime, caplog):
    buf = np.zeros(4096, np.uint8)
    runtime.note_imported(buf.ctypes.data, buf.nbytes)
    with caplog.at_level(logging.DEBUG, logger=memory.__name__):
        desc = register(buf)
    assert not any(bytes(desc._ipc_handle or b""))  # no handle: a peer cannot open it
    assert [r.levelno for r in caplog.records if "without an IPC handle" in r.message] == [logging.DEBUG]


def test_other_unexportable_gpu_memory_still_warns(runtime, caplog):
    imported, other = np.zeros(4096, np.uint8), np.zeros(4096, np.uint8)
    runtime.note_imported(imported.ctypes.data, imported.nbytes)
    with caplog.at_level(logging.DEBUG, logger=memory.__name__):
        register(other)
    assert [r.levelno for r in caplog.records if "without an IPC handle" in r.message] == [logging.WARNING]


def test_imported_ranges_are_half_open():
    rt = UnexportableRuntime()
    rt.note_imported(1000, 24)
    assert (rt.imported(999), rt.imported(1000), rt.imported(1023), rt.imported(1024)) == (False, True, True, False)
