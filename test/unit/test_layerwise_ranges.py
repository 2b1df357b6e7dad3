"""Layer-wise streaming arithmetic: which pages a forward completes, where they go on decode, and
what `send()` still has to write once some pages or layers were streamed."""

import numpy as np
import pytest

from sglang_mori.backend.prefill.layerwise.ranges import Coverage, StreamRange, source_pages, stream_range


def rng(**kw):
    base = dict(prefix_len=0, extend_len=0, input_len=1000, page_size=1, decode_prefix_len=0, already_sent=0)
    base.update(kw)
    return stream_range(**base)


def test_whole_prompt_page_size_1():
    r = rng(extend_len=10, input_len=10)
    assert (r.tok_lo, r.tok_hi, r.dst_slice) == (0, 10, slice(0, 10))


def test_trailing_partial_page_is_left_for_the_next_pass():
    r = rng(extend_len=40, input_len=40, page_size=16)
    assert (r.tok_lo, r.tok_hi, r.dst_slice) == (0, 32, slice(0, 2))


def test_no_whole_page_streams_nothing():
    assert rng(extend_len=10, input_len=10, page_size=16) is None


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_chunked_prefill_chunks_tile_the_prompt_and_match_sglang_index_slices(page_size):
    """Chunks of 100 tokens: each pass streams from the page holding its first token, never a
    page twice, and the pages line up with SGLang's send() index slices (curr_idx)."""
    input_len, chunk = 450, 100
    sent, covered = 0, []
    for start in range(0, input_len, chunk):
        r = rng(prefix_len=start, extend_len=min(chunk, input_len - start), input_len=input_len,
                page_size=page_size, already_sent=sent)
        if r is None:
            continue
        assert r.tok_lo == sent and r.tok_lo % page_size == 0 and r.tok_hi % page_size == 0
        covered.append(r.dst_slice)
        sent = r.tok_hi
    assert sent == input_len - input_len % page_size
    pages = [p for s in covered for p in range(s.start, s.stop)]
    assert pages == list(range(input_len // page_size))


def test_prefix_hit_starts_at_the_page_of_the_first_new_token():
    # 64 cached tokens (page aligned), decode holds none of them: the cached pages are left to send()
    r = rng(prefix_len=64, extend_len=100, input_len=164, page_size=16)
    assert (r.tok_lo, r.tok_hi, r.dst_slice) == (64, 160, slice(4, 10))


def test_decode_prefix_len_shifts_the_destination():
    # decode already holds 32 tokens: its kv_indices start at token 32
    r = rng(prefix_len=32, extend_len=68, input_len=100, page_size=16, decode_prefix_len=32, already_sent=32)
    assert (r.tok_lo, r.tok_hi, r.dst_slice) == (32, 96, slice(0, 4))
    # a radix hit shorter than decode's prefix: pages below decode's prefix never stream
    r = rng(prefix_len=16, extend_len=84, input_len=100, page_size=16, decode_prefix_len=32)
    assert (r.tok_lo, r.dst_slice) == (32, slice(0, 4))


def test_unaligned_decode_prefix_is_refused():
    with pytest.raises(ValueError):
        rng(extend_len=10, page_size=16, decode_prefix_len=8)


def test_overlap_scheduler_launch_order():
    """Chunk k+1 is published before chunk k's send() ran (start_send_idx still lags): the range
    comes from token positions and the streamed boundary, not from what SGLang sent."""
    first = rng(prefix_len=0, extend_len=64, input_len=200, page_size=16, already_sent=0)
    # SGLang's start_send_idx is still 0 here; the session passes max(streamed, start_send_idx)
    second = rng(prefix_len=64, extend_len=64, input_len=200, page_size=16, already_sent=max(first.tok_hi, 0))
    assert first.dst_slice == slice(0, 4) and second.dst_slice == slice(4, 8)
    # early-sent cached prefix (start_send_idx ahead of our boundary) is not streamed again
    third = rng(prefix_len=128, extend_len=72, input_len=200, page_size=16, already_sent=160)
    assert third.dst_slice == slice(10, 12)


def test_after_the_last_send_nothing_streams():
    assert rng(prefix_len=90, extend_len=10, input_len=100, page_size=16, already_sent=100) is None


def test_source_pages_from_a_req_to_token_row():
    row = np.arange(1000, 1200)  # token slots; page size 16 -> slot 1008 is page 63
    assert source_pages(row, 16, 64, 16).tolist() == [1016 // 16, 1032 // 16, 1048 // 16]


def cov(segments, n_buffers=4):
    c = Coverage()
    for lo, hi, bufs in segments:
        c.add(StreamRange(lo, hi, 1, 0), bufs, np.arange(lo, hi))
    return c


def test_remainder_of_fully_streamed_chunk_is_empty():
    c = cov([(0, 10, range(4))])
    assert c.remainder(slice(0, 10), 4) == []


def test_remainder_keeps_unstreamed_pages_and_layers():
    # pages 0..4 got buffers {0, 2} (layer 0 K and V of a 2-layer MHA), 4..8 everything
    c = cov([(0, 4, {0, 2}), (4, 8, range(4))])
    assert c.remainder(slice(0, 10), 4) == [(0, 4, frozenset({1, 3})), (8, 10, None)]
    assert c.remainder(slice(2, 6), 4) == [(0, 2, frozenset({1, 3}))]


def test_remainder_without_coverage_is_the_whole_chunk():
    assert cov([]).remainder(slice(3, 7), 4) == [(0, 4, None)]
    assert cov([(0, 2, set())]).remainder(slice(0, 2), 4) == [(0, 2, None)]


def test_overlapping_segments_are_refused():
    with pytest.raises(ValueError):
        cov([(0, 4, {0}), (3, 6, {0})])


def test_source_pages_from_a_torch_row():
    torch = pytest.importorskip("torch")
    row = torch.arange(64, 128, dtype=torch.int32)
    assert source_pages(row, 0, 32, 16).tolist() == [4, 5]
