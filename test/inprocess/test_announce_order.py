"""When a chunk's TransferStarted goes to decode (issue 28, the link's latency): after its writes
were posted when nothing waits before them, so the copies start one message sooner; before the
wait when a write is held for its peer's byte budget, so decode's deadline restarts where
prefill's own starts; always once per chunk, and before the room's Success."""

from sglang_mori import protocol
from sglang_mori.backend import room_status as S
from sglang_mori.config import MoriConfig

from rig import BUFFERS, PAGE_BYTES, PrefillRig
from stalled_lanes import open_room, resume, stall


def _timeline(rig) -> list:
    """One list of what happened, in order: ("post", bytes) for each engine write the prefill asked
    for, ("send", message) for each message to decode."""
    events = []
    engine = rig.prefill.engine
    real_write = engine.write

    def write(peer_key, batch, **kw):
        events.append(("post", batch.nbytes))
        return real_write(peer_key, batch, **kw)

    engine.write = write
    real_send = rig.messenger.send

    def send(endpoint, message, *, block=True):
        events.append(("send", message))
        return real_send(endpoint, message, block=block)

    rig.messenger.send = send
    return events


def _kinds(events, room) -> list:
    out = []
    for kind, what in events:
        if kind == "post":
            out.append("post")
        elif getattr(what, "room", None) == room:
            out.append(type(what).__name__ if not isinstance(what, protocol.RoomStatus) else f"status {what.status}")
    return out


def test_a_chunk_is_announced_after_its_writes_are_posted_and_before_success(rig):
    events = _timeline(rig)
    open_room(rig, 1, pages=[10, 11])
    rig.send(1, pages=[0], last=False)
    rig.send(1, pages=[1], start=1, last=True, aux_index=2)
    rig.wait_status(1, S.SUCCESS)
    rig.wait(lambda: rig.messenger.of_type(protocol.RoomStatus, 1), "room 1's Success message")
    assert _kinds(events, 1) == ["post", "TransferStarted", "post", "TransferStarted", f"status {S.SUCCESS}"]
    for b in range(BUFFERS):
        assert [rig.decode.page(b, p) for p in (10, 11)] == [rig.prefill.page(b, p) for p in (0, 1)]


def test_a_held_chunk_is_announced_before_it_waits_for_the_budget():
    budget_bytes = 2 * PAGE_BYTES * BUFFERS  # two pages of every buffer in flight
    with PrefillRig(config=MoriConfig(transfer_shards=2, transfer_timeout_ms=30000,
                                      max_inflight_bytes_per_peer=budget_bytes, peer_stall_ms=0)) as rig:
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
            # held, not posted, and decode already told it started
            assert _kinds(events, 7) == ["post", "TransferStarted", "TransferStarted"]
        finally:
            resume(rig)
        rig.wait_status(7, S.SUCCESS)
        rig.wait(lambda: rig.messenger.of_type(protocol.RoomStatus, 7), "room 7's Success message")
        assert _kinds(events, 7) == ["post", "TransferStarted", "TransferStarted", "post", f"status {S.SUCCESS}"]
        for b in range(BUFFERS):
            assert [rig.decode.page(b, p) for p in (40, 41, 42)] == [rig.prefill.page(b, p) for p in (0, 1, 2)]


def test_a_failed_chunk_is_still_announced_once_before_its_failure(rig):
    events = _timeline(rig)
    open_room(rig, 3, pages=[5])
    rig.send(3, pages=[10_000], last=True)  # beyond the prefill's buffers: the plan fails
    rig.wait_status(3, S.FAILED)
    rig.wait(lambda: rig.messenger.of_type(protocol.RoomStatus, 3), "room 3's failure message")
    assert _kinds(events, 3) == ["TransferStarted", f"status {S.FAILED}"]
