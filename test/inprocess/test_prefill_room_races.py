"""Threads that read prefill rooms and then act, against what changes the rooms in between.

Success: a completion pass reads a room's writes (its verdict) and its submit flags (last chunk tracked, no
submitter at work) and then decides. If the last chunk's `end_submit` lands between those reads,
a decision built from them would send Success, with aux, while the last chunk's writes still run:
decode would read pages still being written. These tests hold the real completion thread right
after its verdict (a hook on the room's `verdict`, released by a threading.Event) while the last
chunk is tracked, and check what went to decode.

A decode peer's failure, and a queued chunk: each acts on the room life it was for, never on
whatever life holds the room id once it acts (a retract-rebootstrap may have replaced it).
"""

import threading

import numpy as np

import sglang_mori.softio.faults as faults
from sglang_mori import protocol
from sglang_mori.backend import room_status as S
from sglang_mori.backend.prefill.rooms import Phase
from sglang_mori.backend.prefill.submitter import Chunk
from sglang_mori.engine import WriteState

from interleave import AfterRelease
from rig import WAIT_S
from test_prefill_room_properties import RoomMachine


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

    def recording_send(endpoint, message, **kw):
        if isinstance(message, protocol.RoomStatus) and message.status == S.SUCCESS:
            seen.append([w.handle.state() for w in list(life.writes)])
        return send(endpoint, message, **kw)

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


def test_a_peer_failure_fails_the_lives_it_found_not_the_room_ids_next_life():
    m = RoomMachine()
    rooms = m.parts.rooms
    m.claim(1)
    m._metadata(1, "decode-a", attempt=1, required=1)
    m.submit(1, writes=1, last=False)
    first = rooms.get(1)

    def retract_and_rebootstrap_on_another_decode():
        m.sglang_abort(1)  # the scheduler aborts the request...
        m._metadata(1, "decode-b", attempt=2, required=1)  # ...a new attempt is queued for the next life
        m.retract(1)  # the first sender is cleared: the next life takes the room id
        m.claim(1)

    rooms.lock = AfterRelease(rooms.lock, retract_and_rebootstrap_on_another_decode)
    m.service.control.fail_rooms_of_peer("decode-a", "decode engine decode-a failed")
    second = rooms.get(1)
    assert second is not first and [t.engine_key for t in second.targets.values()] == ["decode-b"]
    assert not second.concluded, second.reason
    assert m.sglang.status(1) == S.WAITING_FOR_INPUT
    assert first.failed
    m.teardown()


def test_a_chunk_queued_for_a_life_is_never_written_for_the_next_life_of_its_room_id():
    """A chunk waits in its shard's queue (a full in-flight budget holds the shard) while its life
    fails, its sender is cleared and a retract-rebootstrap's next life is claimed under the same
    room id: the chunk belongs to the life it was handed over for and goes nowhere."""
    m = RoomMachine()
    rooms = m.parts.rooms
    m.claim(1)
    m._metadata(1, "decode-a", attempt=1, required=1)
    first = rooms.get(1)
    chunk = Chunk(room=1, kv_indices=np.arange(4), index_slice=slice(0, 4), is_last=True, aux_index=0,
                  state_indices=None, num_kv_tokens=1)
    m.submitter.enqueue(chunk)
    m.sglang_abort(1)
    m._metadata(1, "decode-b", attempt=2, required=1)
    m.retract(1)
    m.claim(1)
    second = rooms.get(1)
    assert second is not first and second.claimed and second.phase is Phase.READY
    shard = m.submitter.queues[1 % len(m.submitter.queues)]
    shard.put(None)
    m.submitter.run_shard(shard)
    assert (second.writes, second.submitting, second.last_submitted) == ([], 0, False)
    assert m.sglang.status(1) == S.WAITING_FOR_INPUT and not m.writes
    m.teardown()


def test_full_shard_queue_fails_the_chunk_life_with_backpressure():
    """SGLANG_MORI_MAX_QUEUED_CHUNKS bounds a shard's queue: a chunk handed over while its shard
    holds that many fails its own room (backpressure), the queued one stays queued."""
    m = RoomMachine()
    m.submitter.max_queued = 1
    shard = m.submitter.queues[0]
    rooms = [len(m.submitter.queues) * k for k in (1, 2)]  # both map to shard 0
    for room in rooms:
        m.claim(room)
        m._metadata(room, "decode-a", attempt=room, required=1)
        m.submitter.enqueue(Chunk(room=room, kv_indices=np.arange(4), index_slice=slice(0, 4), is_last=True,
                                  aux_index=0, state_indices=None, num_kv_tokens=1))
    assert shard.qsize() == 1
    assert m.sglang.status(rooms[0]) == S.WAITING_FOR_INPUT
    assert m.sglang.status(rooms[1]) == S.FAILED
    assert "transfer queue full (1 chunks" in (m.sglang.failure_reason(rooms[1]) or "")
    m.teardown()
