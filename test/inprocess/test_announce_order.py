"""When a chunk's TransferStarted goes to decode (issue 28): after its writes were posted when
nothing waits before them, so the copies start one message sooner; before the wait when a write is
held for its peer's byte budget, so decode's deadline restarts where prefill's own starts. A room's
last chunk that nothing held up is announced only if its writes still run after
SGLANG_MORI_ANNOUNCE_GRACE_MS (announce.py): a room that concludes sooner sends decode only its
Success or Failed. Never after the room's terminal status."""

import threading
import time

from sglang_mori import protocol
from sglang_mori.backend import room_status as S
from sglang_mori.config import MoriConfig

from rig import BUFFERS, PAGE_BYTES, PrefillRig
from stalled_lanes import open_room, resume, stall


def _timeline(rig) -> list:
    """One list of what happened, in order: ("post", bytes, when, thread) for each engine write the
    prefill asked for, ("send", message, when, thread) for each message to decode."""
    events = []
    engine = rig.prefill.engine
    real_write = engine.write

    def write(peer_key, batch, **kw):
        events.append(("post", batch.nbytes, time.monotonic(), threading.current_thread().name))
        return real_write(peer_key, batch, **kw)

    engine.write = write
    real_send = rig.messenger.send

    def send(endpoint, message, *, block=True):
        events.append(("send", message, time.monotonic(), threading.current_thread().name))
        return real_send(endpoint, message, block=block)

    rig.messenger.send = send
    return events


def _kinds(events, room) -> list:
    out = []
    for kind, what, _, _ in events:
        if kind == "post":
            out.append("post")
        elif getattr(what, "room", None) == room:
            out.append(type(what).__name__ if not isinstance(what, protocol.RoomStatus) else f"status {what.status}")
    return out


def _config(grace_ms: int, **kw) -> MoriConfig:
    return MoriConfig(transfer_shards=2, transfer_timeout_ms=30000, announce_grace_ms=grace_ms, **kw)


def _sent(events, room, cls) -> list:
    """(when, thread) of each message of type `cls` about `room`."""
    return [(when, thread) for kind, what, when, thread in events
            if kind == "send" and isinstance(what, cls) and what.room == room]


def _two_chunks_to_success(rig) -> None:
    """Room 1 in two chunks, then its Success status and message."""
    open_room(rig, 1, pages=[10, 11])
    rig.send(1, pages=[0], last=False)
    rig.send(1, pages=[1], start=1, last=True, aux_index=2)
    rig.wait_status(1, S.SUCCESS)
    rig.wait(lambda: rig.messenger.of_type(protocol.RoomStatus, 1), "room 1's Success message")


def test_a_quick_last_chunk_sends_decode_its_success_only():
    # A grace far longer than this in-process link needs: the writes finish within it.
    with PrefillRig(config=_config(1000)) as rig:
        rig.register()
        events = _timeline(rig)
        _two_chunks_to_success(rig)
        # The first chunk at once, from the shard that posted it; the last one: nothing but Success.
        assert _kinds(events, 1) == ["post", "TransferStarted", "post", f"status {S.SUCCESS}"]
        assert [thread for _, thread in _sent(events, 1, protocol.TransferStarted)] == ["mori-shard-1"]
        for b in range(BUFFERS):
            assert [rig.decode.page(b, p) for p in (10, 11)] == [rig.prefill.page(b, p) for p in (0, 1)]
        # Nor later: once its grace is over, the held-back announcement of a concluded room is
        # dropped, not sent (what the completion thread does then, called here with a later time).
        life = rig.service.p.rooms.get(1)
        assert not rig.service.completion.announcer.fire(life, time.monotonic() + 10)
        assert life.announce_at is None and len(rig.messenger.of_type(protocol.TransferStarted, 1)) == 1


def test_a_single_quick_chunk_is_one_message_to_decode():
    with PrefillRig(config=_config(1000)) as rig:
        rig.register()
        events = _timeline(rig)
        open_room(rig, 2, pages=[12])
        rig.send(2, pages=[3], last=True, aux_index=1)
        rig.wait_status(2, S.SUCCESS)
        rig.wait(lambda: rig.messenger.of_type(protocol.RoomStatus, 2), "room 2's Success message")
        assert [type(m).__name__ for _, m in rig.messenger.sent if getattr(m, "room", None) == 2] == ["RoomStatus"]
        assert [rig.decode.page(b, 12) for b in range(BUFFERS)] == [rig.prefill.page(b, 3) for b in range(BUFFERS)]


def test_a_slow_last_chunk_is_announced_after_the_grace_then_succeeds():
    grace_s = 0.2
    with PrefillRig(config=_config(int(grace_s * 1000))) as rig:
        rig.register()
        events = _timeline(rig)
        stall(rig)  # its writes are posted and stay in flight until resumed
        try:
            open_room(rig, 5, pages=[20])
            rig.send(5, pages=[4], last=True, aux_index=1)
            rig.wait(lambda: _sent(events, 5, protocol.TransferStarted), "room 5's late TransferStarted")
            assert _kinds(events, 5) == ["post", "TransferStarted"]  # no Success: the writes still run
        finally:
            resume(rig)
        rig.wait_status(5, S.SUCCESS)
        rig.wait(lambda: rig.messenger.of_type(protocol.RoomStatus, 5), "room 5's Success message")
        assert _kinds(events, 5) == ["post", "TransferStarted", f"status {S.SUCCESS}"]
        posted_at = next(when for kind, _, when, _ in events if kind == "post")
        [(announced_at, thread)] = _sent(events, 5, protocol.TransferStarted)
        assert thread == "mori-completion"  # held back by the shard, sent by the completion thread
        assert announced_at - posted_at >= grace_s * 0.9  # not before its grace (monotonic clock)
        assert [rig.decode.page(b, 20) for b in range(BUFFERS)] == [rig.prefill.page(b, 4) for b in range(BUFFERS)]


def test_a_non_last_chunk_is_announced_at_once_by_its_shard():
    with PrefillRig(config=_config(1000)) as rig:
        rig.register()
        events = _timeline(rig)
        stall(rig)
        try:
            open_room(rig, 6, pages=[30, 31])
            rig.send(6, pages=[0], last=False)
            rig.wait(lambda: _sent(events, 6, protocol.TransferStarted), "room 6's first TransferStarted")
            # Sent by the shard right after its post, while the writes are held on the wire.
            assert _kinds(events, 6) == ["post", "TransferStarted"]
            assert _sent(events, 6, protocol.TransferStarted)[0][1].startswith("mori-shard-")
            rig.send(6, pages=[1], start=1, last=True)
            rig.wait(lambda: len(_sent(events, 6, protocol.TransferStarted)) == 2, "room 6's last TransferStarted")
        finally:
            resume(rig)
        rig.wait_status(6, S.SUCCESS)
        rig.wait(lambda: rig.messenger.of_type(protocol.RoomStatus, 6), "room 6's Success message")
        assert _kinds(events, 6) == ["post", "TransferStarted", "post", "TransferStarted", f"status {S.SUCCESS}"]
        assert _sent(events, 6, protocol.TransferStarted)[1][1] == "mori-completion"  # the last: after its grace


def test_with_no_grace_every_chunk_is_announced_after_its_post_and_before_success():
    with PrefillRig(config=_config(0)) as rig:
        rig.register()
        events = _timeline(rig)
        _two_chunks_to_success(rig)
        assert _kinds(events, 1) == ["post", "TransferStarted", "post", "TransferStarted", f"status {S.SUCCESS}"]


def test_a_held_chunk_is_announced_before_it_waits_for_the_budget():
    budget_bytes = 2 * PAGE_BYTES * BUFFERS  # two pages of every buffer in flight
    with PrefillRig(config=_config(1000, max_inflight_bytes_per_peer=budget_bytes, peer_stall_ms=0)) as rig:
        rig.register()
        events = _timeline(rig)
        budget = rig.service.p.peers.budget
        stall(rig)
        try:
            open_room(rig, 7, pages=[40, 41, 42])
            rig.send(7, pages=[0, 1], last=False)  # fills the budget
            rig.wait(lambda: _kinds(events, 7) == ["post", "TransferStarted"], "room 7's first chunk posted")
            rig.send(7, pages=[2], start=2, last=True)  # past the budget: held
            rig.wait(lambda: budget.holding == 1, "room 7's second chunk held")
            # held, not posted, and decode already told it started (a last chunk too: it waits)
            assert _kinds(events, 7) == ["post", "TransferStarted", "TransferStarted"]
        finally:
            resume(rig)
        rig.wait_status(7, S.SUCCESS)
        rig.wait(lambda: rig.messenger.of_type(protocol.RoomStatus, 7), "room 7's Success message")
        assert _kinds(events, 7) == ["post", "TransferStarted", "TransferStarted", "post", f"status {S.SUCCESS}"]
        for b in range(BUFFERS):
            assert [rig.decode.page(b, p) for p in (40, 41, 42)] == [rig.prefill.page(b, p) for p in (0, 1, 2)]


def test_a_last_chunk_that_fails_within_its_grace_sends_its_failure_only():
    with PrefillRig(config=_config(1000)) as rig:
        rig.register()
        events = _timeline(rig)
        open_room(rig, 3, pages=[5])
        rig.send(3, pages=[10_000], last=True)  # beyond the prefill's buffers: the plan fails
        rig.wait_status(3, S.FAILED)
        rig.wait(lambda: rig.messenger.of_type(protocol.RoomStatus, 3), "room 3's failure message")
        assert _kinds(events, 3) == [f"status {S.FAILED}"]
