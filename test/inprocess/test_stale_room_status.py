"""A status of an earlier decode attempt never lands on the room id's next receiver.

Decode retracts a request and a new receiver of the same bootstrap_room registers new pages; the
old attempt's Success (or Failed) from prefill arrives only then. Applied to the new receiver, a
Success would make decode take its new, unwritten pages for filled (corrupt output) and a Failed
would fail a request that is fine. Prefill echoes the attempt of each destination in every
RoomStatus it sends there; decode applies a status only to the receiver attempt it names and counts
the others as stale.
"""

import numpy as np

from sglang_mori import protocol
from sglang_mori.backend import room_status as S
from sglang_mori.backend.decode.rooms import DecodePhase

from rig import AUX_BYTES, PrefillRig

ROOM = 41
OLD_AUX, NEW_AUX = 0, 3


def _retract_and_rebootstrap(rig, old_attempt: int) -> int:
    """Decode's receiver of the old attempt is cleared; a new receiver of the same room id publishes
    new pages (its metadata is not delivered to prefill yet). Returns the new attempt."""
    rig.decode_sglang.clear(ROOM)
    rig.decode_service.forget(ROOM, old_attempt)
    new_attempt = rig.new_attempt(ROOM)
    rig.decode_service.record_destination(
        bootstrap_room=ROOM, required_dst_info_num=1, kv_indices=np.asarray([20, 21]), aux_index=NEW_AUX,
        state_indices=None, decode_prefix_len=None, is_dummy=False)
    return new_attempt


def _aux_slot(rig, slot: int) -> bytes:
    return rig.decode.aux[slot * AUX_BYTES:(slot + 1) * AUX_BYTES].tobytes()


def _first_attempt_claimed(rig):
    """The room's first receiver attempt, its destination recorded and the room claimed by prefill:
    (decode service, that attempt's id)."""
    rig.register()
    first = rig.new_attempt(ROOM)
    rig.metadata(ROOM, pages=[1, 2], aux_index=OLD_AUX)
    rig.claim(ROOM)
    return rig.decode_service, first


def test_a_late_success_of_the_old_attempt_leaves_the_new_receiver_waiting():
    with PrefillRig() as rig:
        svc, first = _first_attempt_claimed(rig)
        rig.send(ROOM, pages=[3, 4], last=True, aux_index=1)
        rig.wait_status(ROOM, S.SUCCESS)
        (late,) = rig.messenger.of_type(protocol.RoomStatus, ROOM)  # prefill's Success, still on the way
        second = _retract_and_rebootstrap(rig, first)
        new_slot_before = _aux_slot(rig, NEW_AUX)

        svc.handle(protocol.encode(late))

        assert rig.decode_sglang.status(ROOM) == S.BOOTSTRAPPING, "the old attempt's Success was applied"
        assert svc.p.rooms.get(ROOM).phase is DecodePhase.AWAITING_PREFILL
        assert _aux_slot(rig, NEW_AUX) == new_slot_before  # its aux bytes were not copied either
        assert svc.stale_statuses == 1
        assert rig.decode_sglang.prefill_statuses == []

        # The new attempt's own Success, from the same prefill, is applied as usual.
        rig.service.control.on_metadata(svc.record_destination(
            bootstrap_room=ROOM, required_dst_info_num=1, kv_indices=np.asarray([20, 21]), aux_index=NEW_AUX,
            state_indices=None, decode_prefix_len=None, is_dummy=False))
        rig.clear(ROOM)  # the first life's sender is done; the queued attempt starts the next life
        rig.claim(ROOM)
        rig.send(ROOM, pages=[5, 6], last=True, aux_index=2)
        rig.wait(lambda: len(rig.messenger.of_type(protocol.RoomStatus, ROOM)) == 2, "the second Success")
        own = rig.messenger.of_type(protocol.RoomStatus, ROOM)[1]
        assert (late.attempt, own.attempt) == (first, second)
        svc.handle(protocol.encode(own))
        assert rig.decode_sglang.status(ROOM) == S.SUCCESS
        assert _aux_slot(rig, NEW_AUX) == rig.prefill.aux[2 * AUX_BYTES:3 * AUX_BYTES].tobytes()
        assert [rig.decode.page(b, p) for b in range(2) for p in (20, 21)] == \
            [rig.prefill.page(b, p) for b in range(2) for p in (5, 6)]
        assert svc.stale_statuses == 1


def test_a_late_failure_of_the_old_attempt_does_not_fail_the_new_receiver():
    with PrefillRig() as rig:
        svc, first = _first_attempt_claimed(rig)
        assert rig.service.fail(ROOM, "the lane broke")  # prefill fails it and tells decode
        (late,) = rig.messenger.of_type(protocol.RoomStatus, ROOM)
        assert late.status == S.FAILED
        _retract_and_rebootstrap(rig, first)

        svc.handle(protocol.encode(late))

        assert rig.decode_sglang.status(ROOM) == S.BOOTSTRAPPING, rig.decode_sglang.failure_records.get(ROOM)
        assert svc.p.rooms.get(ROOM).open
        assert late.attempt == first and svc.stale_statuses == 1


def test_a_status_for_an_attempt_decode_never_made_is_stale():
    with PrefillRig() as rig:
        svc = rig.decode_service
        rig.new_attempt(ROOM)
        svc.handle(protocol.encode(protocol.RoomStatus(room=ROOM, attempt=12345, status=S.FAILED, prefill_rank=0,
                                                       reason="forged")))
        assert rig.decode_sglang.status(ROOM) == S.BOOTSTRAPPING
        assert svc.stale_statuses == 1
