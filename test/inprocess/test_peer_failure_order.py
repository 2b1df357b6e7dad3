"""A room whose own write broke the decode peer fails with that write's reason.

Once prefill marks a peer failed, every submission to it fails fast with "failed recently". The
room whose write broke the peer must be concluded before that mark: otherwise its next chunk,
submitted in between, concludes it with "failed recently" and its real cause (the lane that broke)
is lost. test_reliability_lanes.py relied on that cause to find the rooms of the failed lane, and
failed on a loaded host when the completion thread was preempted right after the mark.
"""

import sglang_mori.softio.faults as faults
from sglang_mori.backend import room_status as S

ROOM = 51


def test_the_next_chunk_right_after_the_peer_is_marked_failed_keeps_the_rooms_own_reason(rig):
    """The completion thread marks the peer failed; the room's next chunk is submitted and handled
    right then (as a preempted completion thread allows). The room keeps the lane's reason."""
    key = rig.decode.engine.key
    peers = rig.service.p.peers
    mark_failed = peers.mark_failed
    submitted_after_mark = []

    def mark_then_next_chunk(engine_key, reason):
        news = mark_failed(engine_key, reason)
        if not submitted_after_mark:
            submitted_after_mark.append(True)
            rig.send(ROOM, pages=[40], last=True, start=16)
            rig.wait(lambda: rig.service.submitter.queued() == 0 and not rig.service.p.rooms.get(ROOM).submitting,
                     "the next chunk handled")
        return news

    peers.mark_failed = mark_then_next_chunk
    faults.fail_lane(rig.prefill.engine.engine, 1, key)
    rig.new_attempt(ROOM)
    rig.metadata(ROOM, pages=list(range(17)))
    rig.claim(ROOM)
    rig.send(ROOM, pages=list(range(16)), last=False)
    rig.wait_status(ROOM, S.FAILED)
    rig.wait(lambda: submitted_after_mark, "the peer marked failed")
    reason = rig.sglang.failure_records[ROOM]
    assert "injected lane failure" in reason and "failed recently" not in reason, reason
