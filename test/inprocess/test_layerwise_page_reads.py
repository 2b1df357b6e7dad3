"""Layer-wise source pages from a device row: begin_batch makes no blocking device read (it only
queues a copy, page_reads.py); the worker resolves the pages after the layer's event, and the
streamed bytes are exactly the request's pages (docs/benchmarks.md, Session 16)."""

import threading

import numpy as np
import pytest

from sglang_mori.backend import room_status as S
from sglang_mori.backend.prefill.layerwise import page_reads
from sglang_mori.backend.prefill.layerwise.planner import LayerwisePlanner
from sglang_mori.backend.prefill.layerwise.session import BatchView, ReqView
from sglang_mori.config import MoriConfig

from harness.device_row import DeviceRow, FakeDeviceCopies, FakeEvent
from layerwise_rig import CountingMetrics
from rig import PrefillRig
from test_layerwise import LAYERS, assert_bytes, open_room


@pytest.fixture
def rig():
    with PrefillRig(MoriConfig(transfer_shards=2, transfer_timeout_ms=5000), buffers=2 * LAYERS,
                    planner_class=LayerwisePlanner) as r:
        r.metrics = r.parts.metrics = CountingMetrics()
        r.register()
        yield r


def test_begin_batch_queues_the_page_read_and_the_worker_resolves_it_after_the_layer_event(rig, monkeypatch):
    log, reads = [], []
    copies = FakeDeviceCopies(log)
    monkeypatch.setattr(page_reads, "start_device_copy", copies)
    session = rig.layerwise()
    src, dst = [13, 11, 20, 17, 15, 12, 19, 10, 18, 21, 14, 16], list(range(30, 42))
    open_room(rig, 1, dst)
    row = DeviceRow([99, 98] + src + [97], reads)  # two cached tokens before, one token after
    me = threading.current_thread().name

    batch = session.begin_batch(BatchView([ReqView(room=1, prefix_len=2, extend_len=12, input_len=15,
                                                   decode_prefix_len=2, start_send_idx=2, row=row)], page_size=1))
    assert batch is not None
    assert reads == [], "begin_batch read the device row with a blocking read"
    assert [s.tolist() for s, _ in copies.started] == [src] and copies.started[0][1] == me
    assert log == []  # nothing waited for the copy on the scheduler thread

    pool = rig.prefill.pool()
    for layer in range(LAYERS):
        session.on_layer(batch, pool, layer, FakeEvent(log, f"layer{layer}"))
    session.end_batch(batch)
    assert batch.done.wait(5)
    session.add_chunk(1, np.array(src[:12]), slice(0, 12), True, aux_index=2)
    rig.wait_status(1, S.SUCCESS)

    assert_bytes(rig, src, dst)
    assert reads == []
    copy_waits = [i for i, (what, _) in enumerate(log) if what == "copy"]
    assert len(copy_waits) == 1, log
    assert log[copy_waits[0]][1] != me  # the worker resolved the pages, not the scheduler thread
    assert log[copy_waits[0] - 1][0] == "layer0", log  # ... once the first group's layer event was waited for
    rig.clear(1)
    rig.wait_idle()
