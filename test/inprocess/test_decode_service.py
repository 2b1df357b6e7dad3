"""The decode service in one process: statuses, aux copies, deadlines (fake clock), attempts."""

import threading

from sglang_mori import protocol
from sglang_mori.backend import room_status as S
from sglang_mori.backend.decode.rooms import DecodePhase
from sglang_mori.backend.failure_reasons import PROTOCOL

from interleave import AfterRelease
from rig import AUX_BYTES, PrefillRig


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def decode_rig(clock=None):
    rig = PrefillRig()
    if clock is not None:
        rig.decode_service.p.clock = clock
    return rig


def test_transfer_deadline_restarts_per_chunk_and_fails_a_stalled_room():
    clock = Clock()
    rig = decode_rig(clock)
    svc = rig.decode_service
    attempt = rig.new_attempt(1)
    rig.metadata(1, pages=[1])
    svc.enforce_deadlines(clock.now + 10_000)
    assert rig.decode_sglang.status(1) == S.BOOTSTRAPPING  # no deadline before prefill starts
    svc.handle(protocol.encode(protocol.TransferStarted(room=1, attempt=attempt, prefill_rank=0)))
    clock.now += svc.deadline_s - 1
    svc.handle(protocol.encode(protocol.TransferStarted(room=1, attempt=attempt, prefill_rank=0)))  # the next chunk
    svc.enforce_deadlines(clock.now + svc.deadline_s - 0.5)
    assert rig.decode_sglang.status(1) == S.BOOTSTRAPPING
    svc.enforce_deadlines(clock.now + svc.deadline_s + 0.5)
    assert rig.decode_sglang.status(1) == S.FAILED
    assert "not complete" in rig.decode_sglang.failure_records[1]
    assert svc.p.rooms.get(1).phase is DecodePhase.FAILED


def test_aux_that_does_not_fit_fails_the_room_with_a_reason():
    rig = decode_rig()
    attempt = rig.new_attempt(2)
    rig.metadata(2, pages=[1], aux_index=1)
    rig.decode_service.on_status(protocol.RoomStatus(room=2, attempt=attempt, status=S.SUCCESS, prefill_rank=0, aux=[b"x" * 3]))
    assert rig.decode_sglang.status(2) == S.FAILED
    assert rig.decode_sglang.failure_records[2].startswith("aux item of 3 bytes for slot 1 does not fit")


def test_aux_of_the_right_size_lands_in_its_slot_and_a_negative_slot_writes_nothing():
    rig = decode_rig()
    item = AUX_BYTES
    good, bad = rig.new_attempt(4), None
    rig.metadata(4, pages=[1], aux_index=3)
    rig.decode_service.on_status(protocol.RoomStatus(room=4, attempt=good, status=S.SUCCESS, prefill_rank=0,
                                                     aux=[bytes(range(item))]))
    assert rig.decode_sglang.status(4) == S.SUCCESS
    assert rig.decode.aux[3 * item:4 * item].tobytes() == bytes(range(item))
    before = rig.decode.aux.copy()
    bad = rig.new_attempt(5)
    rig.metadata(5, pages=[1], aux_index=-1)  # would index the slot view from its end
    rig.decode_service.on_status(protocol.RoomStatus(room=5, attempt=bad, status=S.SUCCESS, prefill_rank=0,
                                                     aux=[b"\xff" * item]))
    assert rig.decode_sglang.status(5) == S.FAILED
    assert "does not fit" in rig.decode_sglang.failure_records[5]
    assert (rig.decode.aux == before).all()


def test_status_for_a_cleared_room_changes_nothing():
    rig = decode_rig()
    rig.decode_service.on_status(protocol.RoomStatus(room=3, attempt=1, status=S.FAILED, prefill_rank=0, reason="x"))
    assert rig.decode_sglang.prefill_statuses == [] and rig.decode_sglang.status(3) is None


def test_each_receiver_is_a_new_attempt_and_its_clear_leaves_a_newer_one_alone():
    rig = decode_rig()
    svc = rig.decode_service
    first = rig.new_attempt(4)
    a = rig.metadata(4, pages=[1])
    second = rig.new_attempt(4)
    b = rig.metadata(4, pages=[2])
    assert first != second and (a.attempt, b.attempt) == (first, second)
    svc.forget(4, first)  # the old receiver's late clear
    assert svc.p.rooms.attempt_of(4) == second
    assert svc.abort_message(4, generation=1).attempt == second
    svc.forget(4, second)
    assert svc.p.rooms.get(4) is None


def test_abort_ack_is_recorded_only_with_a_generation():
    rig = decode_rig()
    svc = rig.decode_service
    svc.handle(protocol.encode(protocol.AbortAck(room=5, prefill_rank=2, generation=None)))
    svc.handle(protocol.encode(protocol.AbortAck(room=5, prefill_rank=2, generation=7)))
    assert rig.decode_sglang.abort_acks_noted == [(5, 2, 7)]


def test_messages_meant_for_prefill_are_rejected():
    rig = decode_rig()
    rig.decode_service.handle(protocol.encode(rig.decode_service.registration()))
    assert [e.reason for e in rig.rejections] == ["malformed"]


class CountingMetrics:
    def __init__(self):
        self.requests: list = []

    def request_finished(self, ok, reason=None):
        self.requests.append(ok)

    def __getattr__(self, name):  # every other metric
        return lambda *a, **k: None


def test_a_failure_decided_on_another_thread_never_splits_a_success():
    """A prefill Success and a failure decided on the scheduler thread (here: a duplicate room)
    at once: the room ends one way in SGLang and in the registry, counted once. The failure is
    started right after SGLang recorded the Success and before the status thread closed the
    registry's room; it must wait for that decision, and then find the room over."""
    rig = decode_rig()
    svc = rig.decode_service
    svc.p.metrics = metrics = CountingMetrics()
    attempt = rig.new_attempt(6)
    rig.metadata(6, pages=[1], aux_index=0)
    svc.handle(protocol.encode(protocol.TransferStarted(room=6, attempt=attempt, prefill_rank=0)))
    failing = threading.Thread(target=svc.fail, args=(6, "duplicate room", PROTOCOL))
    apply = rig.decode_sglang.apply_prefill_status

    def apply_then_fail_elsewhere(room, status, prefill_rank, reason):
        apply(room, status, prefill_rank, reason)
        free = []

        def probe():
            if svc.p.rooms.lock.acquire(blocking=False):
                svc.p.rooms.lock.release()
                free.append(True)

        prober = threading.Thread(target=probe)
        prober.start()
        prober.join()
        if free:
            failing.start()
            failing.join()  # nothing holds the decision together: the failure runs now
        else:
            failing.start()  # waits for the lock this decision holds

    rig.decode_sglang.apply_prefill_status = apply_then_fail_elsewhere
    svc.on_status(protocol.RoomStatus(room=6, attempt=attempt, status=S.SUCCESS, prefill_rank=0, aux=[b"a" * 16]))
    failing.join()
    assert rig.decode_sglang.status(6) == S.SUCCESS
    assert svc.p.rooms.get(6).phase is DecodePhase.SUCCEEDED
    assert metrics.requests == [True]


def test_a_deadline_fails_the_attempt_that_expired_not_the_rooms_next_receiver():
    clock = Clock()
    rig = decode_rig(clock)
    svc = rig.decode_service
    first = rig.new_attempt(7)
    rig.metadata(7, pages=[1])
    svc.handle(protocol.encode(protocol.TransferStarted(room=7, attempt=first, prefill_rank=0)))

    def receiver_cleared_and_a_new_one_started():
        rig.decode_sglang.clear(7)
        svc.forget(7, first)
        rig.new_attempt(7)

    svc.p.rooms.lock = AfterRelease(svc.p.rooms.lock, receiver_cleared_and_a_new_one_started)
    svc.enforce_deadlines(clock.now + svc.deadline_s + 1)
    assert svc.p.rooms.attempt_of(7) != first
    assert rig.decode_sglang.status(7) == S.BOOTSTRAPPING, rig.decode_sglang.failure_records.get(7)
    assert svc.p.rooms.get(7).phase is DecodePhase.AWAITING_PREFILL


def test_a_late_transfer_started_of_an_earlier_attempt_never_restarts_the_next_receivers_deadline():
    clock = Clock()
    rig = decode_rig(clock)
    svc = rig.decode_service
    first = rig.new_attempt(8)
    rig.metadata(8, pages=[1])
    svc.handle(protocol.encode(protocol.TransferStarted(room=8, attempt=first, prefill_rank=0)))
    # Decode retracts the request and bootstraps it again: a new receiver of the same room id.
    rig.decode_sglang.clear(8)
    svc.forget(8, first)
    second = rig.new_attempt(8)
    rig.metadata(8, pages=[2])
    # The first attempt's TransferStarted, still on the wire, opens no deadline for the second.
    svc.handle(protocol.encode(protocol.TransferStarted(room=8, attempt=first, prefill_rank=0)))
    assert svc.p.rooms.get(8).phase is DecodePhase.AWAITING_PREFILL
    svc.handle(protocol.encode(protocol.TransferStarted(room=8, attempt=second, prefill_rank=0)))
    started = clock.now
    # Near the second attempt's deadline another late one of the first arrives: it restarts nothing.
    clock.now = started + svc.deadline_s - 1
    svc.handle(protocol.encode(protocol.TransferStarted(room=8, attempt=first, prefill_rank=0)))
    svc.enforce_deadlines(started + svc.deadline_s + 0.5)
    assert rig.decode_sglang.status(8) == S.FAILED
    assert "not complete" in rig.decode_sglang.failure_records[8]
    assert svc.p.rooms.attempt_of(8) == second


def test_a_success_with_no_transfer_started_concludes_a_room_awaiting_prefill():
    # Issue 28: a last chunk whose writes finish within SGLANG_MORI_ANNOUNCE_GRACE_MS sends decode
    # its Success only, so the room goes from AWAITING_PREFILL straight to SUCCEEDED.
    clock = Clock()
    rig = decode_rig(clock)
    svc = rig.decode_service
    attempt = rig.new_attempt(9)
    rig.metadata(9, pages=[1], aux_index=2)
    assert svc.p.rooms.get(9).phase is DecodePhase.AWAITING_PREFILL
    svc.handle(protocol.encode(protocol.RoomStatus(room=9, attempt=attempt, status=S.SUCCESS, prefill_rank=0,
                                                   aux=[bytes(range(AUX_BYTES))])))
    assert rig.decode_sglang.status(9) == S.SUCCESS
    assert svc.p.rooms.get(9).phase is DecodePhase.SUCCEEDED
    assert rig.decode.aux[2 * AUX_BYTES:3 * AUX_BYTES].tobytes() == bytes(range(AUX_BYTES))
    # A TransferStarted that still comes after it (another prefill thread's) reopens nothing and
    # starts no deadline that could fail the concluded room.
    svc.handle(protocol.encode(protocol.TransferStarted(room=9, attempt=attempt, prefill_rank=0)))
    svc.enforce_deadlines(clock.now + svc.deadline_s + 1)
    assert svc.p.rooms.get(9).phase is DecodePhase.SUCCEEDED and rig.decode_sglang.status(9) == S.SUCCESS
