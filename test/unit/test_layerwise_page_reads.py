"""page_reads.py: a device row's source pages are queued, not read, and resolve to what a blocking
read gives; host rows are read at once."""

import numpy as np
import pytest

from sglang_mori.backend.prefill.layerwise import page_reads
from sglang_mori.backend.prefill.layerwise.page_reads import SourcePages, read_source_pages
from sglang_mori.backend.prefill.layerwise.ranges import source_pages

from harness.device_row import DeviceRow, FakeDeviceCopies


def test_a_device_row_is_queued_and_its_slices_resolve_to_the_blocking_read(monkeypatch):
    log, reads = [], []
    monkeypatch.setattr(page_reads, "start_device_copy", FakeDeviceCopies(log))
    values = np.arange(1000, 1200)
    pages = read_source_pages(DeviceRow(values, reads), 16, 96, 16)
    part = pages.sub(1, 3)
    assert reads == [] and log == [] and pages.pending and len(pages) == 5 and len(part) == 2
    want = source_pages(values, 16, 96, 16)
    assert part.resolve().tolist() == want[1:3].tolist()  # waits for the copy, once
    assert pages.resolve().tolist() == want.tolist() and len(log) == 1 and reads == []
    assert pages.sub(3, 10).resolve().tolist() == want[3:].tolist()


def test_host_rows_are_read_at_once(monkeypatch):
    monkeypatch.setattr(page_reads, "start_device_copy", None)  # never called for a host row
    assert not read_source_pages(np.arange(64, 128), 0, 32, 16).pending
    assert read_source_pages(list(range(64, 128)), 0, 32, 16).resolve().tolist() == [4, 5]
    torch = pytest.importorskip("torch")
    pages = read_source_pages(torch.arange(64, 128, dtype=torch.int32), 0, 32, 16)
    assert not pages.pending and pages.resolve().tolist() == [4, 5]


def test_a_failed_asynchronous_start_falls_back_to_the_blocking_read(monkeypatch):
    def no_pinned_memory(slots):
        raise RuntimeError("no pinned memory")

    reads = []
    monkeypatch.setattr(page_reads, "start_device_copy", no_pinned_memory)
    pages = read_source_pages(DeviceRow(np.arange(32), reads), 0, 32, 16)
    assert reads == ["cpu"] and pages.resolve().tolist() == [0, 1]


def test_arrays_wrap_as_resolved_pages():
    pages = SourcePages.of([3, 1, 2])
    assert SourcePages.of(pages) is pages and pages.resolve().dtype == np.int64 and len(pages) == 3
