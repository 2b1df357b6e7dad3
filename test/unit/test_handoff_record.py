"""The hand-off record as SGLang's send() feeds it (session 22): int32 pages go as their own buffer,
aux items as row views of SGLang's metadata buffers; both arrive as they left, and an aux index
outside the buffers is refused by name instead of read past them."""

import socket
from types import SimpleNamespace

import numpy as np
import pytest

from sglang_mori.backend.manager import MoriKVManager
from sglang_mori.transfer_process import handoff
from sglang_mori.transfer_process.aux_rows import AuxRows


@pytest.fixture
def channel():
    a, b = handoff.channel_pair()
    yield handoff.Sender(a), b
    a.close()
    b.close()


def metadata(slots=4):
    """Three buffers of different item sizes (as MetadataBuffers': int32 x16, float32 x128, bf16 x8)."""
    bufs = [np.arange(slots * n, dtype=np.uint8).reshape(slots, n) + k for k, n in enumerate((64, 512, 16))]
    args = SimpleNamespace(aux_data_ptrs=[b.ctypes.data for b in bufs], aux_data_lens=[b.nbytes for b in bufs],
                           aux_item_lens=[b.shape[1] for b in bufs])
    return bufs, args


def test_int32_pages_travel_as_four_bytes_a_page_and_arrive_as_int64(channel):
    sender, theirs = channel
    pages = np.array([7, 3, 2**31 - 1, 0, 12], dtype=np.int32)
    sender.chunk(1, 99, pages, 0, 5, False, None, None, 80)
    raw = theirs.recv(handoff.MAX_RECORD, socket.MSG_PEEK)
    assert len(raw) == handoff._HEADER.size + 4 * len(pages)  # no int64 conversion on the scheduler
    rec = handoff.Receiver(theirs).next()
    assert rec.pages.dtype == np.int64 and rec.pages.tolist() == pages.tolist()
    assert (rec.start, rec.stop, rec.num_kv_tokens, rec.is_last, rec.aux) == (0, 5, 80, False, None)


@pytest.mark.parametrize("pages", [np.arange(10, dtype=np.int32)[::2], np.array([1, 2], dtype=np.int16),
                                   [4, 5, 6], np.array([9, 8], dtype=">i8")])
def test_other_page_arrays_are_converted_once_and_arrive_equal(channel, pages):
    sender, theirs = channel
    sender.chunk(0, 1, pages, 0, len(pages), False, None, None, None)
    assert handoff.Receiver(theirs).next().pages.tolist() == list(np.asarray(pages).tolist())


def test_aux_row_views_arrive_as_the_rows_bytes_on_the_last_record_only(channel, monkeypatch):
    sender, theirs = channel
    bufs, args = metadata()
    rows = AuxRows(args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens)
    monkeypatch.setattr(handoff, "MAX_PAGES", 3)  # 7 pages: records of 3, 3, 1
    sender.chunk(2, 5, np.arange(7, dtype=np.int32), 10, 17, True, 2, rows(2), 112)
    receiver = handoff.Receiver(theirs)
    recs = [receiver.next() for _ in range(3)]
    assert [(r.start, r.stop, r.is_last, r.aux_index) for r in recs] == [(10, 13, False, None), (13, 16, False, None),
                                                                         (16, 17, True, 2)]
    assert recs[0].aux is None and recs[1].aux is None
    assert recs[2].aux == [b[2].tobytes() for b in bufs]
    assert np.concatenate([r.pages for r in recs]).tolist() == list(range(7))


def test_the_managers_hand_off_reader_gives_rows_and_refuses_an_index_outside_the_buffers():
    bufs, args = metadata(slots=4)
    read = MoriKVManager._handoff_aux_reader(SimpleNamespace(kv_args=args))
    assert [bytes(v) for v in read(3)] == [b[3].tobytes() for b in bufs]
    assert read(3) is read(3)  # a slot's views are made once
    assert read(None) is None
    for bad in (4, -1, 1000):  # string_at read past the buffers here
        with pytest.raises(IndexError, match=f"aux index {bad} outside the metadata buffers' 4 slots"):
            read(bad)
