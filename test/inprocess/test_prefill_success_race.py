"""The completion thread's Success decision against a submitter that tracks the last chunk mid-pass.

A completion pass reads a room's writes (its verdict) and its submit flags (last chunk tracked, no
submitter at work) and then decides. If the last chunk's `end_submit` lands between those reads,
a decision built from them would send Success, with aux, while the last chunk's writes still run:
decode would read pages still being written. These tests hold the real completion thread right
after its verdict (a hook on the room's `verdict`, released by a threading.Event) while the last
chunk is tracked, and check what went to decode.
"""

import threading

import sglang_mori.softio.faults as faults
from sglang_mori import protocol
from sglang_mori.backend import room_status as S
from sglang_mori.engine import WriteState

from rig import WAIT_S


class HeldPass:
    """Holds the completion thread's next verdict over `life` taken outside the registry lock
    (a verdict inside it is the locked re-check, which must never block) until `release()`;
    `finished` is set when that pass's `advance` returned."""

    def __init__(self, rig, life):
        self.rooms = rig.service.p.rooms
        self.held = threading.Event()
        self.go = threading.Event()
        self.finished = threading.Event()
        self.verdict_then = None
        completion = rig.service.completion
        verdict, advance = life.verdict, completion.advance

        def held_verdict(now):
            out = verdict(now)
            if not self.held.is_set() and out[0] is WriteState.SUCCEEDED and not self.rooms.lock.locked():
                self.verdict_then = out
                self.held.set()
                self.go.wait(WAIT_S)
            return out

        def watched_advance(r, now):
            try:
                advance(r, now)
            finally:
                if self.held.is_set() and r is life:
                    self.finished.set()

        life.verdict = held_verdict
        completion.advance = watched_advance

    def release(self):
        self.go.set()
        assert self.finished.wait(WAIT_S), "the held completion pass did not finish"


def record_write_states_at_success(rig, life):
    """The state of each of the life's writes when a Success message left for decode."""
    seen = []
    send = rig.messenger.send

    def recording_send(endpoint, message):
        if isinstance(message, protocol.RoomStatus) and message.status == S.SUCCESS:
            seen.append([w.handle.state() for w in list(life.writes)])
        return send(endpoint, message)

    rig.messenger.send = recording_send
    return seen


def test_success_is_not_sent_over_a_last_chunk_tracked_during_the_pass(rig):
    engine, key = rig.prefill.engine.engine, rig.decode.engine.key
    rig.new_attempt(11)
    rig.metadata(11, pages=[20, 21], aux_index=1)
    assert rig.claim(11) is None
    rig.send(11, pages=[0], last=False)
    life = rig.service.p.rooms.get(11)
    rig.wait(lambda: life.writes and all(w.handle.state() is WriteState.SUCCEEDED for w in life.writes),
             "the first chunk landed")
    at_success = record_write_states_at_success(rig, life)
    held = HeldPass(rig, life)
    faults.stall_lane(engine, 0, key)
    faults.stall_lane(engine, 1, key)
    try:
        assert held.held.wait(WAIT_S), "the completion pass never took a verdict over the landed chunk"
        rig.send(11, pages=[1], last=True, start=1, aux_index=2)
        rig.wait(lambda: life.last_submitted and not life.submitting, "the last chunk tracked")
        assert any(w.handle.state() is WriteState.RUNNING for w in life.writes)
        held.release()
        # The pass that read its verdict before the last chunk was tracked decided nothing.
        assert rig.messenger.of_type(protocol.RoomStatus, 11) == [], at_success
        assert rig.sglang.status(11) == S.TRANSFERRING
        assert not life.concluded
    finally:
        held.go.set()
        faults.resume_lane(engine, None, key)
    rig.wait_status(11, S.SUCCESS)
    (done,) = rig.messenger.of_type(protocol.RoomStatus, 11)
    assert done.aux == [rig.prefill.aux[32:48].tobytes()]
    assert at_success == [[WriteState.SUCCEEDED] * len(life.writes)]
    for b in range(2):
        assert [rig.decode.page(b, p) for p in (20, 21)] == [rig.prefill.page(b, p) for p in (0, 1)]
