"""Inline posts (SGLANG_MORI_INLINE_POST, issue 28): a chunk whose room and shard are idle is planned
and posted on the thread that hands it over (SGLang's scheduler) instead of waking its shard, whose
wake-up waits for the scheduler's GIL. These tests pin where each chunk was posted, that a room's
chunks stay in order whichever thread posts them, that anything that would wait goes to the shard
instead (a busy shard, an earlier chunk of the room still queued, a full in-flight budget), and that
a failure found inline fails that room only, through the failure door, with its reason."""

import threading
from types import SimpleNamespace

import pytest

from sglang_mori import protocol
from sglang_mori.backend import room_status as S
from sglang_mori.backend.prefill.submitter import ChunkSubmitter
from sglang_mori.config import MoriConfig
from sglang_mori.planning import PlanningError

from rig import BUFFERS, PAGE_BYTES, WAIT_S, PrefillRig
from stalled_lanes import open_room, resume, stall


@pytest.fixture
def rig():
    with PrefillRig(MoriConfig(transfer_shards=1, transfer_timeout_ms=30000, inline_post="on")) as r:
        r.register()
        yield r


def record_post_threads(rig) -> list:
    """(bytes, name of the posting thread) of each write batch the prefill engine was asked for."""
    posts = []
    engine = rig.prefill.engine
    real_write = engine.write

    def write(peer_key, batch, **kw):
        posts.append((batch.nbytes, threading.current_thread().name))
        return real_write(peer_key, batch, **kw)

    engine.write = write
    return posts


def warm_up(rig, room=90):
    """One room end to end, so that the decode peer's sessions are open (a first contact dials the
    peer, which only a shard does)."""
    open_room(rig, room, pages=[60])
    rig.send(room, pages=[30], last=True)
    rig.wait_status(room, S.SUCCESS)


def page_bytes(pages: int) -> int:
    return PAGE_BYTES * pages * BUFFERS


def assert_landed(rig, src, dst):
    for b in range(BUFFERS):
        assert [rig.decode.page(b, p) for p in dst] == [rig.prefill.page(b, p) for p in src]


def test_chunks_of_an_idle_room_are_posted_on_the_callers_thread_in_order(rig):
    warm_up(rig)
    posts = record_post_threads(rig)
    me = threading.current_thread().name
    open_room(rig, 1, pages=[10, 11, 12])
    rig.send(1, pages=[0], last=False)
    # Posted before send() returned, by this thread: no shard wake-up in between.
    assert posts == [(page_bytes(1), me)]
    (started,) = rig.messenger.of_type(protocol.TransferStarted, 1)
    assert started in rig.messenger.nonblocking  # the scheduler never waits on a full send queue
    rig.send(1, pages=[1, 2], start=1, last=True)
    assert posts == [(page_bytes(1), me), (page_bytes(2), me)]
    rig.wait_status(1, S.SUCCESS)
    assert rig.service.submitter.inline_posts == 2
    assert_landed(rig, [0, 1, 2], [10, 11, 12])
    rig.clear(1), rig.clear(90)
    rig.wait_idle()


def test_a_chunk_behind_a_busy_shard_or_a_queued_chunk_of_its_room_goes_through_the_queue(rig):
    """Room 2's chunk holds the (only) shard; room 3's first chunk finds the shard busy and queues;
    its second queues behind it (the room has a chunk queued): both go out on the shard, in order,
    and once the shard is idle again the next room's chunk goes inline."""
    warm_up(rig)
    posts = record_post_threads(rig)
    me = threading.current_thread().name
    submitter = rig.service.submitter
    shard_may_go, shard_holds, real_submit = threading.Event(), threading.Event(), submitter.submit

    def held_submit(chunk, **kw):
        if chunk.room == 2:
            shard_holds.set()
            assert shard_may_go.wait(WAIT_S)
        real_submit(chunk, **kw)

    submitter.submit = held_submit
    open_room(rig, 2, pages=[20])
    open_room(rig, 3, pages=[30, 31, 32])
    submitter.shard_busy[0] = True  # room 2's chunk to the shard: it looks busy for this hand-over
    rig.send(2, pages=[5], last=True)
    assert shard_holds.wait(WAIT_S)
    assert submitter.shard_busy[0]  # the shard thread marks itself while it works on room 2
    rig.send(3, pages=[6], last=False)  # shard busy: queued
    rig.send(3, pages=[7, 8], start=1, last=True)  # room 3 has a chunk queued: queued behind it
    assert posts == [] and rig.service.p.rooms.get(3).queued == 2
    shard_may_go.set()
    rig.wait_status(3, S.SUCCESS)
    rig.wait_status(2, S.SUCCESS)
    shard = "mori-shard-0"
    assert posts == [(page_bytes(1), shard), (page_bytes(1), shard), (page_bytes(2), shard)]
    assert submitter.inline_posts == 0
    assert_landed(rig, [6, 7, 8], [30, 31, 32])
    # Idle again: the next room goes inline.
    open_room(rig, 4, pages=[40])
    rig.send(4, pages=[9], last=True)
    assert posts[-1] == (page_bytes(1), me)
    rig.wait_status(4, S.SUCCESS)


@pytest.mark.parametrize("error, label", [(PlanningError("index 7 out of range"), "index 7 out of range"),
                                          (RuntimeError("planner bug"), "internal error while sending KV")])
def test_a_failure_in_an_inline_post_fails_that_room_only_with_its_reason(rig, error, label):
    warm_up(rig)
    planner = rig.service.p.planner
    real_plan = planner.write_batch

    def write_batch(peer, chunk, target):
        if chunk.room == 5:
            raise error
        return real_plan(peer, chunk, target)

    planner.write_batch = write_batch
    open_room(rig, 5, pages=[50])
    open_room(rig, 6, pages=[51])
    rig.send(5, pages=[3], last=True)
    # Failed before send() returned, through the failure door: SGLang's status and reason, decode told.
    assert rig.sglang.status(5) == S.FAILED
    assert label in rig.sglang.failure_reason(5)
    (failed,) = rig.messenger.of_type(protocol.RoomStatus, 5)
    assert failed.status == S.FAILED and label in failed.reason and failed in rig.messenger.nonblocking
    rig.send(6, pages=[4], last=True)
    rig.wait_status(6, S.SUCCESS)
    assert_landed(rig, [4], [51])
    rig.clear(5), rig.clear(6), rig.clear(90)
    rig.wait_idle()


def test_a_full_budget_hands_the_chunk_to_its_shard_without_waiting():
    config = MoriConfig(transfer_shards=1, transfer_timeout_ms=30000, inline_post="on",
                        max_inflight_per_peer=1)
    with PrefillRig(config=config) as rig:
        rig.register()
        warm_up(rig)
        posts = record_post_threads(rig)
        me = threading.current_thread().name
        budget = rig.service.p.peers.budget
        stall(rig)
        try:
            open_room(rig, 7, pages=[44])
            open_room(rig, 8, pages=[45])
            rig.send(7, pages=[1], last=True)  # inline: fills the budget (its write cannot finish)
            assert posts == [(page_bytes(1), me)]
            rig.send(8, pages=[2], last=True)  # would wait for a slot: returned at once, queued
            rig.wait(lambda: budget.holding == 1, "room 8's chunk held on its shard")
            assert posts == [(page_bytes(1), me)] and rig.sglang.status(8) == S.TRANSFERRING
        finally:
            resume(rig)
        rig.wait_status(8, S.SUCCESS)
        # posted by a shard (the stalled-decodes one: its own held it, submitter.py)
        assert posts[0] == (page_bytes(1), me) and len(posts) == 2
        assert posts[1][0] == page_bytes(1) and posts[1][1].startswith("mori-shard-")
        assert_landed(rig, [1, 2], [44, 45])


# `off`, and the default `auto` in SGLang's own process (its scheduler thread keeps its time).
@pytest.mark.parametrize("mode", ["off", None])
def test_off_and_auto_in_process_send_every_chunk_through_its_shard(mode):
    extra = {} if mode is None else {"inline_post": mode}
    with PrefillRig(MoriConfig(transfer_shards=1, transfer_timeout_ms=30000, **extra)) as rig:
        rig.register()
        warm_up(rig)
        posts = record_post_threads(rig)
        open_room(rig, 1, pages=[10])
        rig.send(1, pages=[0], last=True)
        rig.wait_status(1, S.SUCCESS)
        assert posts == [(page_bytes(1), "mori-shard-0")]


@pytest.mark.parametrize("mode, scheduler_hands_over, inline", [
    ("on", True, True), ("on", False, True), ("off", True, False), ("off", False, False),
    ("auto", True, False),  # SGLang's scheduler thread keeps its time: chunks go to the shards
    ("auto", False, True),  # the transfer process's reader thread is ours: it posts inline
])
def test_the_mode_decides_by_who_hands_the_chunks_over(mode, scheduler_hands_over, inline):
    parts = SimpleNamespace(config=MoriConfig(transfer_shards=1, inline_post=mode),
                            scheduler_hands_over=scheduler_hands_over)
    assert ChunkSubmitter(parts, None, None, None).inline_post is inline
