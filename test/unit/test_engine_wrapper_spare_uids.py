"""TransferEngine: the transfer uids of the next post are allocated after a post, for the next
one of its size (issue 28), over the fake mori.io of fake_mori_io.py."""

import pytest

from sglang_mori.engine import transfer_engine as te
from sglang_mori.engine.transfer_engine import SUCCESS, SubmitError

from fake_mori_io import IOEngine, clock, fake_io, make_engine, ok, pair, sq_full  # noqa: F401 (clock: a fixture)


class UidCountingEngine(IOEngine):
    """Records how many uids were allocated since `_since` was last reset (by the test, as it
    calls `write`) when each batch_write comes: those on the path to the call."""

    def __init__(self, key, config):
        super().__init__(key, config)
        self.allocated_before_call = []
        self._since = 0

    def allocate_transfer_uid(self):
        self._since += 1
        return super().allocate_transfer_uid()

    def batch_write(self, *args):
        self.allocated_before_call.append(self._since)
        self._since = 0
        return super().batch_write(*args)


def test_the_next_posts_uids_are_allocated_after_a_post_and_never_reused(clock):
    eng = make_engine(fake_io(UidCountingEngine))
    e = eng.engine
    for n in (3, 3, 3, 3, 1, 1):  # a second size has its own list
        e._since = 0  # write() starts
        eng.write("decode-a", [pair(i) for i in range(n)], deadline=clock.now + 10, retry_max=0)
    # The first call of a size allocates on its way to the engine; later ones take the list
    # stocked after the call before them.
    assert e.allocated_before_call == [3, 0, 0, 0, 1, 0]
    uids = [u for call in e.calls for u in call[5]]
    assert len(uids) == len(set(uids)) == 4 * 3 + 2  # every call's uids fresh
    assert all(len(call[5]) == len(call[0]) for call in e.calls)
    eng.close()
    assert eng._spare_uids == {}


def test_resubmitted_pairs_get_fresh_uids_and_a_failed_call_still_stocks(clock):
    eng = make_engine()
    e = eng.engine
    e.script = [[ok(), sq_full()], [ok()], RuntimeError("boom")]
    h = eng.write("decode-a", [pair(0), pair(1)], deadline=clock.now + 10, retry_max=3)
    assert h.result() == SUCCESS
    with pytest.raises(SubmitError):
        eng.write("decode-a", [pair(0), pair(1)], deadline=clock.now + 10, retry_max=3)
    eng.write("decode-a", [pair(0), pair(1)], deadline=clock.now + 10, retry_max=3)
    uids = [u for call in e.calls for u in call[5]]
    assert [len(call[5]) for call in e.calls] == [2, 1, 2, 2]
    assert len(uids) == len(set(uids))


def test_the_stock_is_bounded_in_sizes(clock, monkeypatch):
    monkeypatch.setattr(te, "SPARE_UID_SIZES", 2)
    eng = make_engine()
    for n in (1, 2, 3, 4):
        eng.write("decode-a", [pair(i) for i in range(n)], deadline=clock.now + 10, retry_max=0)
    assert sorted(eng._spare_uids) == [1, 2]
