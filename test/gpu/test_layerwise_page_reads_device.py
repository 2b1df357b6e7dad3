"""Layer-wise source pages from a device `req_to_token` row on a real GPU (page_reads.py): the read
queued by begin_batch does not wait for the stream, lands in pinned memory, and resolves to the
row as the stream had it at that point (after writes queued before it, before writes queued after)."""

from __future__ import annotations

import pytest

from sglang_mori.backend.prefill.layerwise.page_reads import read_source_pages

torch = pytest.importorskip("torch")

DELAY_CYCLES = 50_000_000  # tens of ms of GPU time ahead of the row's write
PAGE = 16


@pytest.mark.parametrize("side_stream", [False, True], ids=["current-stream", "side-stream"])
def test_queued_read_does_not_wait_and_sees_the_row_in_stream_order(side_stream):
    stream = torch.cuda.Stream() if side_stream else torch.cuda.current_stream()
    with torch.cuda.stream(stream):
        row = torch.zeros(4096, dtype=torch.int32, device="cuda")
        read_source_pages(row, 32, 32 + 8 * PAGE, PAGE).resolve()  # warm the pinned-memory cache
        torch.cuda.synchronize()
        torch.cuda._sleep(DELAY_CYCLES)  # the stream is busy: a blocking read would wait for this
        row.copy_(torch.arange(10_000, 14_096, dtype=torch.int32, device="cuda"))  # SGLang's write of the row
        pages = read_source_pages(row, 32, 32 + 8 * PAGE, PAGE)
        assert pages.pending and not stream.query(), "the read waited for the stream"
        host, _ = pages._copy
        assert host.is_pinned()
        row.fill_(-1)  # a later write of the row: the read must not see it
        got = pages.resolve()
    assert got.tolist() == [(10_000 + 32 + k * PAGE) // PAGE for k in range(8)]
    torch.cuda.synchronize()

