"""A write held for a stalled decode's byte budget (issue 29) holds only its own decode's rooms: the
chunks of another, healthy decode on the same transfer shard are posted and succeed meanwhile.

Rooms move, from their shard, to one more shard thread for stalled decodes (submitter.py); these
tests check that a healthy decode's room on the held room's shard is not delayed, that a moved
room's chunks are still posted in order, and that a held chunk of a room that ends is still dropped
unsent. The stalled decode's lanes are stalled (a link that stopped moving bytes); every wait is on
the service's own state, never a sleep.
"""

import numpy as np

from sglang_mori import protocol
from sglang_mori.backend import room_status as S
from sglang_mori.config import MoriConfig

from rig import BUFFERS, PAGE_BYTES, PrefillRig
from stalled_lanes import FakeClock, open_room, record_posts, resume, stall

CHUNK_BYTES = PAGE_BYTES * BUFFERS  # one page of every buffer
SHARDS = 2
ROOM_A, ROOM_B = 7, 7 + SHARDS  # both on shard 7 % SHARDS


def _rig(stall_ms=0):
    # peer_stall_ms 0: the budget binds from the first byte toward a peer with writes in flight.
    # announce_grace_ms 0: every chunk, the last too, is announced by the shard that posted it, which
    # is how these tests see where a chunk went (a quick last chunk would announce nothing).
    return PrefillRig(config=MoriConfig(transfer_shards=SHARDS, transfer_timeout_ms=30000,
                                        max_inflight_bytes_per_peer=2 * CHUNK_BYTES, peer_stall_ms=stall_ms,
                                        announce_grace_ms=0))


def _hold_a_chunk_of_room_a(rig, posted):
    """Room A's first chunk posted toward the stalled decode A (filling its budget), its second held."""
    a = rig.decode.engine.key
    budget = rig.service.p.peers.budget
    open_room(rig, ROOM_A, pages=[40, 41, 42, 43, 44, 45])
    rig.send(ROOM_A, pages=[0, 1], last=False)
    rig.wait(lambda: posted == [(a, 2 * CHUNK_BYTES)], "room A's first chunk posted")
    rig.send(ROOM_A, pages=[2], start=2, last=False)
    rig.wait(lambda: budget.holding == 1, "room A's second chunk held")


def test_a_healthy_decodes_room_on_the_held_rooms_shard_is_posted_and_succeeds_meanwhile():
    with _rig() as rig:
        rig.register()
        b = rig.add_decode()
        posted = record_posts(rig, keyed=True)
        budget = rig.service.p.peers.budget
        a = rig.decode.engine.key
        stall(rig)
        try:
            _hold_a_chunk_of_room_a(rig, posted)
            open_room(rig, ROOM_B, pages=[30, 31], decode=b)
            rig.send(ROOM_B, pages=[8, 9], last=True)
            rig.wait_status(ROOM_B, S.SUCCESS)
            assert budget.holding == 1 and posted == [(a, 2 * CHUNK_BYTES), (b.engine.key, 2 * CHUNK_BYTES)]
            for buf in range(BUFFERS):
                assert [b.page(buf, p) for p in (30, 31)] == [rig.prefill.page(buf, p) for p in (8, 9)]
            rig.send(ROOM_A, pages=[3, 4, 5], start=3, last=True)  # behind its held chunk, in order
        finally:
            resume(rig)
        rig.wait_status(ROOM_A, S.SUCCESS)
        assert [n for key, n in posted if key == a] == [2 * CHUNK_BYTES, CHUNK_BYTES, 3 * CHUNK_BYTES]
        for buf in range(BUFFERS):
            assert [rig.decode.page(buf, 40 + i) for i in range(6)] == [rig.prefill.page(buf, i) for i in range(6)]
        rig.clear(ROOM_A), rig.clear(ROOM_B)
        rig.wait_idle()
        assert budget.total_bytes() == 0 and budget.holding == 0


def test_a_moved_rooms_later_chunks_wait_behind_its_held_one_and_are_dropped_with_it():
    """The room's next chunks queue behind its held chunk; decode aborts the room: none of them is
    posted, and a healthy decode's room on the same shard still goes out."""
    with _rig() as rig:
        rig.register()
        b = rig.add_decode()
        posted = record_posts(rig, keyed=True)
        budget = rig.service.p.peers.budget
        a = rig.decode.engine.key
        stall(rig)
        try:
            _hold_a_chunk_of_room_a(rig, posted)
            rig.send(ROOM_A, pages=[3], start=3, last=False)
            rig.send(ROOM_A, pages=[4, 5], start=4, last=True)
            stalled_queue = rig.service.submitter.stalled_queue
            rig.wait(lambda: stalled_queue.qsize() == 2, "room A's later chunks queued behind its held one")
            assert posted == [(a, 2 * CHUNK_BYTES)]
            rig.abort(ROOM_A)
            rig.wait(lambda: budget.holding == 0 and stalled_queue.qsize() == 0, "room A's chunks dropped")
            open_room(rig, ROOM_B, pages=[30], decode=b)
            rig.send(ROOM_B, pages=[8], last=True)
            rig.wait_status(ROOM_B, S.SUCCESS)
            assert posted == [(a, 2 * CHUNK_BYTES), (b.engine.key, CHUNK_BYTES)], (
                "a chunk of the aborted room was posted")
            assert rig.sglang.acks_sent == []  # room A's posted chunk may still land
        finally:
            resume(rig)
        rig.wait(lambda: rig.sglang.acks_sent, "room A's abort ACK once its posted chunk finished")
        for buf in range(BUFFERS):
            assert [rig.decode.page(buf, p) for p in (42, 43, 44, 45)] == [bytes(PAGE_BYTES)] * 4
        rig.clear(ROOM_A), rig.clear(ROOM_B)
        rig.wait_idle()


class ForwardThatOutlastsTheStallWindow:
    """A chunk's wait event: the forward pass it waits for ends after the peer was found stalled."""

    def __init__(self, clock: FakeClock, seconds: float):
        self.clock, self.seconds = clock, seconds

    def synchronize(self):
        self.clock.now += self.seconds


def test_a_chunk_whose_decode_stalls_while_its_shard_prepares_it_moves_on_instead_of_holding_the_shard():
    """The decode was not stalled when the shard took the chunk, and is by the time its write would
    be posted (its forward pass ended past the stall window): nothing of it was posted, so it goes on
    to the stalled-decodes shard, and a healthy decode's room behind it on its shard goes out."""
    with _rig(stall_ms=500) as rig:
        rig.register()
        b = rig.add_decode()
        posted = record_posts(rig, keyed=True)
        budget = rig.service.p.peers.budget
        clock = FakeClock()
        budget.use_clock(clock)
        a = rig.decode.engine.key
        stall(rig)
        try:
            open_room(rig, ROOM_A, pages=[40, 41, 42])
            rig.send(ROOM_A, pages=[0, 1], last=False)
            rig.wait(lambda: posted == [(a, 2 * CHUNK_BYTES)], "room A's first chunk posted")
            clock.now += 0.1  # within the stall window when its shard takes the next chunk
            rig.service.add_chunk(ROOM_A, np.asarray([2]), slice(2, 3), True, aux_index=0,
                                  wait_event=ForwardThatOutlastsTheStallWindow(clock, 0.5))
            rig.wait(lambda: budget.holding == 1, "room A's last chunk held")
            assert budget.stalled(a)
            open_room(rig, ROOM_B, pages=[30], decode=b)
            rig.send(ROOM_B, pages=[8], last=True)
            rig.wait_status(ROOM_B, S.SUCCESS)
            assert budget.holding == 1 and rig.sglang.status(ROOM_A) == S.TRANSFERRING
            assert [b.page(buf, 30) for buf in range(BUFFERS)] == [rig.prefill.page(buf, 8) for buf in range(BUFFERS)]
        finally:
            resume(rig)
        rig.wait_status(ROOM_A, S.SUCCESS)
        assert posted == [(a, 2 * CHUNK_BYTES), (b.engine.key, CHUNK_BYTES), (a, CHUNK_BYTES)]
        for buf in range(BUFFERS):
            assert [rig.decode.page(buf, 40 + i) for i in range(3)] == [rig.prefill.page(buf, i) for i in range(3)]
        rig.clear(ROOM_A), rig.clear(ROOM_B)
        rig.wait_idle()
        assert budget.total_bytes() == 0 and budget.holding == 0


def test_a_moved_room_comes_back_to_its_shard_once_its_decode_finishes_writes_again():
    """So that another decode stalling later cannot hold it on the stalled-decodes shard."""
    with _rig() as rig:
        rig.register()
        posted = record_posts(rig, keyed=True)
        budget = rig.service.p.peers.budget
        a = rig.decode.engine.key
        stall(rig)
        try:
            _hold_a_chunk_of_room_a(rig, posted)
        finally:
            resume(rig)
        rig.wait(lambda: len(posted) == 2 and budget.count(a) == 0, "room A's held chunk posted and finished")
        rig.send(ROOM_A, pages=[3, 4, 5], start=3, last=True)
        rig.wait_status(ROOM_A, S.SUCCESS)
        started = [thread for message, thread in rig.messenger.threads
                   if isinstance(message, protocol.TransferStarted) and message.room == ROOM_A]
        shard = f"mori-shard-{ROOM_A % SHARDS}"
        assert started == [shard, "mori-shard-stalled", shard]  # each chunk announced once
        assert [n for _, n in posted] == [2 * CHUNK_BYTES, CHUNK_BYTES, 3 * CHUNK_BYTES]
        for buf in range(BUFFERS):
            assert [rig.decode.page(buf, 40 + i) for i in range(6)] == [rig.prefill.page(buf, i) for i in range(6)]
        rig.clear(ROOM_A)
        rig.wait_idle()
