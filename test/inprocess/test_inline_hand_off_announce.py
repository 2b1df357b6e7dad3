"""A last chunk whose inline post hands it over (HAND_OFF: its first contact with the decode peer
would dial it, which only a shard does) is announced exactly as a shard-posted one: nothing from
the handing-over thread, then at most one TransferStarted, held back by the shard and sent by the
completion thread only if the writes outlive SGLANG_MORI_ANNOUNCE_GRACE_MS (announce.py), always
before the room's status."""

import pytest

from sglang_mori import protocol
from sglang_mori.backend import room_status as S
from sglang_mori.config import MoriConfig

from rig import BUFFERS, PrefillRig
from stalled_lanes import open_room, resume, stall
from test_announce_order import _kinds, _sent, _timeline


@pytest.mark.parametrize("slow", [False, True])
def test_a_handed_off_last_chunk_is_announced_at_most_once_by_the_completion_thread(slow):
    grace_ms = 200 if slow else 1000  # slow: the writes stall past it; quick: they end well within it
    config = MoriConfig(transfer_shards=1, transfer_timeout_ms=30000, announce_grace_ms=grace_ms, inline_post="on")
    with PrefillRig(config=config) as rig:
        rig.register()
        events = _timeline(rig)
        if slow:
            stall(rig)
        try:
            open_room(rig, 5, pages=[20])
            rig.send(5, pages=[4], last=True, aux_index=1)  # no session open yet: handed to the shard
            if slow:
                rig.wait(lambda: _sent(events, 5, protocol.TransferStarted), "room 5's late TransferStarted")
                assert _kinds(events, 5) == ["post", "TransferStarted"]
        finally:
            if slow:
                resume(rig)
        rig.wait_status(5, S.SUCCESS)
        rig.wait(lambda: rig.messenger.of_type(protocol.RoomStatus, 5), "room 5's Success message")
        assert rig.service.submitter.inline_posts == 0
        assert [thread for kind, _, _, thread in events if kind == "post"] == ["mori-shard-0"]
        expected = ["post", "TransferStarted", f"status {S.SUCCESS}"] if slow else ["post", f"status {S.SUCCESS}"]
        assert _kinds(events, 5) == expected
        if slow:
            [(_, thread)] = _sent(events, 5, protocol.TransferStarted)
            assert thread == "mori-completion"
        assert [rig.decode.page(b, 20) for b in range(BUFFERS)] == [rig.prefill.page(b, 4) for b in range(BUFFERS)]
