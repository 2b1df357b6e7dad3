"""A room whose own write already failed keeps that reason when another room marked the peer first.

The lane breaks under two rooms' writes. The completion thread concludes one of them and marks the
peer failed; the other room's write has failed too, but before the completion thread gets to it
its next chunk is submitted and reads "failed recently". That is a consequence of the same break:
the room's first cause (its own failed write) must win. On a loaded host this is how
test_reliability_lanes.py lost the lane's reason for most rooms of its failed-lane round.
"""

import sglang_mori.softio.faults as faults
from sglang_mori.backend import room_status as S
from sglang_mori.engine import WriteState

ROOMS = (71, 72)


def _failed_write(room) -> bool:
    return any(w.handle.state() is WriteState.FAILED for w in room.writes)


def test_a_room_with_a_failed_write_keeps_its_reason_when_its_next_chunk_finds_the_peer_marked(rig):
    key = rig.decode.engine.key
    engine = rig.prefill.engine.engine
    rooms = rig.service.p.rooms
    for lane in (0, 1):  # every lane held: both rooms' writes queue behind each other
        faults.stall_lane(engine, lane, key)
    for room in ROOMS:
        rig.new_attempt(room)
        rig.metadata(room, pages=list(range(17)) if room == ROOMS[0] else list(range(20, 37)))
        rig.claim(room)
        rig.send(room, pages=list(range(16)), last=False)
        rig.wait(lambda: rooms.get(room).writes and not rooms.get(room).submitting, f"room {room}'s writes posted")

    peers = rig.service.p.peers
    mark_failed = peers.mark_failed
    other = []

    def mark_then_next_chunk(engine_key, reason):
        news = mark_failed(engine_key, reason)
        if not other:
            # The room the completion thread has not concluded yet: its write failed with the lane,
            # and its next chunk comes now, before the completion thread looks at it.
            (room,) = [r for r in ROOMS if not rooms.get(r).concluded]
            other.append(room)
            rig.wait(lambda: _failed_write(rooms.get(room)), f"room {room}'s write failed with the lane")
            rig.send(room, pages=[40], last=True, start=16)
            rig.wait(lambda: rig.service.submitter.queued() == 0 and not rooms.get(room).submitting,
                     "the next chunk handled")
        return news

    peers.mark_failed = mark_then_next_chunk
    try:
        faults.fail_lane(engine, 1, key)
        faults.resume_lane(engine, 1, key)  # lane 1 breaks on the first queued batch
        for room in ROOMS:
            rig.wait_status(room, S.FAILED)
        rig.wait(lambda: other, "the peer marked failed")
        reasons = {r: rig.sglang.failure_records[r] for r in ROOMS}
        for room, reason in reasons.items():
            assert "injected lane failure" in reason and "failed recently" not in reason, (room, reasons)
    finally:
        faults.resume_lane(engine, None, key)
