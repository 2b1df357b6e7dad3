"""A stand-in for a `req_to_token` row in device memory, for CPU tests of layer-wise page reads.

`DeviceRow` looks like a CUDA tensor to page_reads.py (`is_cuda`, slicing, `shape`, `dtype`) and
counts every blocking read (`.cpu()`, `.tolist()`, `.numpy()`, `.item()`, `np.asarray`).
`FakeDeviceCopies` replaces page_reads.start_device_copy: the copy is queued, and its bytes land in
the host buffer only when its event is synchronized (until then the buffer holds -1), so pages used
before the copy landed would name page -1. `log` records each wait: (what, thread name).
"""

import threading

import numpy as np


class DeviceRow:
    is_cuda = True

    def __init__(self, values, reads: list):
        self._values = np.asarray(values)
        self.reads = reads

    def __getitem__(self, item):
        return DeviceRow(self._values[item], self.reads)

    @property
    def shape(self):
        return self._values.shape

    @property
    def dtype(self):
        return self._values.dtype

    def _blocking(self, how):
        self.reads.append(how)
        return self._values.copy()

    def cpu(self):
        return HostSlots(self._blocking("cpu"))

    def tolist(self):
        return self._blocking("tolist").tolist()

    def numpy(self):
        return self._blocking("numpy")

    def item(self):
        return self._blocking("item").item()

    def __array__(self, dtype=None, copy=None):
        values = self._blocking("__array__")
        return values if dtype is None else values.astype(dtype)


class HostSlots:
    def __init__(self, values):
        self._values = values

    def numpy(self):
        return self._values


class FakeEvent:
    def __init__(self, log: list, what: str, on_sync=None):
        self.log, self.what, self.on_sync = log, what, on_sync

    def synchronize(self):
        self.log.append((self.what, threading.current_thread().name))
        if self.on_sync is not None:
            self.on_sync()

    def query(self):
        return False


class FakeDeviceCopies:
    def __init__(self, log: list):
        self.log = log
        self.started = []  # the slots of each copy queued

    def __call__(self, slots):
        src = slots._values.copy()  # the stream position of the copy: what the row holds now
        host = HostSlots(np.full(src.shape, -1, dtype=src.dtype))
        self.started.append((src, threading.current_thread().name))
        return host, FakeEvent(self.log, "copy", on_sync=lambda: host._values.__setitem__(slice(None), src))
