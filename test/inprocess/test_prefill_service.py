"""The prefill service in one process on softio: real engines, real threads, fake SGLang tables.

Each test drives the service the way SGLang's scheduler and decode's messages do and asserts what
arrived in decode's memory, which statuses SGLang saw, and which messages went to decode, including
the abort / drain / poison / replay races that otherwise only the multi-process harness reaches.
"""

import time

import numpy as np

import sglang_mori.softio.faults as faults
from sglang_mori import protocol
from sglang_mori.backend import room_status as S
from sglang_mori.backend.prefill.rooms import Phase

from rig import PrefillRig


def test_bytes_land_then_success_with_aux(rig):
    rig.new_attempt(1)
    rig.metadata(1, pages=[10, 11, 12], aux_index=2)
    assert rig.claim(1) is None
    assert rig.sglang.status(1) == S.WAITING_FOR_INPUT and 1 in rig.sglang.transfer_infos
    rig.send(1, pages=[0, 1], last=False)
    rig.send(1, pages=[5], last=True, start=2, aux_index=3)
    rig.wait_status(1, S.SUCCESS)
    for b in range(2):
        assert [rig.decode.page(b, p) for p in (10, 11, 12)] == [rig.prefill.page(b, p) for p in (0, 1, 5)]
    assert rig.service.p.peers.get(rig.decode.engine.key).open_pairs  # opened by the first write
    done = rig.success_message(1)
    assert done.status == S.SUCCESS and done.aux == [rig.prefill.aux[48:64].tobytes()]
    # The first chunk's, and the last one's only if its writes outlived SGLANG_MORI_ANNOUNCE_GRACE_MS
    # (test_announce_order.py pins down which).
    assert len(rig.messenger.of_type(protocol.TransferStarted, 1)) in (1, 2)
    rig.clear(1)
    rig.wait_idle()
    assert rig.sglang.outstanding.get(1) is None


def test_decode_status_applies_aux_before_success():
    with PrefillRig() as rig:
        rig.register()
        rig.new_attempt(4)
        rig.metadata(4, pages=[1], aux_index=5)
        rig.claim(4)
        rig.send(4, pages=[2], last=True, aux_index=1)
        rig.wait_status(4, S.SUCCESS)
        done = rig.success_message(4)
        rig.decode_service.on_status(done)  # what decode's status thread does with it
        assert rig.decode_sglang.status(4) == S.SUCCESS
        assert rig.decode.aux[5 * 16:6 * 16].tobytes() == rig.prefill.aux[16:32].tobytes()


def test_sender_before_metadata(rig):
    assert rig.claim(2) is None
    assert rig.sglang.status(2) == S.BOOTSTRAPPING
    rig.new_attempt(2)
    rig.metadata(2, pages=[7])
    assert rig.sglang.status(2) == S.WAITING_FOR_INPUT
    rig.send(2, pages=[3], last=True)
    rig.wait_status(2, S.SUCCESS)
    assert rig.decode.page(0, 7) == rig.prefill.page(0, 3)


def test_retract_rebootstrap_within_a_second_is_served_and_replays_are_not(rig):
    """Decode retracts a finished request and bootstraps the same room again: a new attempt."""
    rig.new_attempt(3)
    first = rig.metadata(3, pages=[20])
    rig.claim(3)
    rig.send(3, pages=[1], last=True)
    rig.wait_status(3, S.SUCCESS)
    rig.clear(3)
    t0 = time.monotonic()
    rig.service.control.on_metadata(first)  # a replay of the first life's metadata
    assert [e.reason for e in rig.rejections] == ["replayed"] and rig.service.p.rooms.get(3) is None
    rig.new_attempt(3)
    rig.metadata(3, pages=[30])  # the second life, before its sender exists
    assert rig.claim(3) is None
    rig.send(3, pages=[2], last=True)
    rig.wait_status(3, S.SUCCESS)
    assert time.monotonic() - t0 < 5.0
    assert rig.decode.page(0, 30) == rig.prefill.page(0, 2)


def test_new_attempt_after_an_abort_is_queued_for_the_next_life(rig):
    rig.new_attempt(5)
    rig.metadata(5, pages=[40])
    rig.claim(5)
    rig.abort(5, generation=1)  # decode retracts the request before prefill ran it...
    rig.new_attempt(5)
    rig.metadata(5, pages=[41])  # ...and bootstraps it again while the first sender is still here
    assert rig.service.p.rooms.get(5).next_life
    assert rig.sglang.status(5) == S.FAILED
    rig.clear(5)
    assert rig.claim(5) is None and rig.sglang.status(5) == S.WAITING_FOR_INPUT
    rig.send(5, pages=[6], last=True)
    rig.wait_status(5, S.SUCCESS)
    assert rig.decode.page(0, 41) == rig.prefill.page(0, 6)


def test_abort_before_the_request_arrives_fails_its_sender_at_once(rig):
    rig.new_attempt(6)
    rig.metadata(6, pages=[1])
    rig.abort(6, generation=9)
    assert rig.sglang.acks_sent == [] and [m.generation for m in rig.messenger.of_type(protocol.AbortAck, 6)] == [9]
    reason = rig.claim(6)
    assert reason == "Aborted by decode before the request reached prefill"
    assert rig.sglang.status(6) == S.FAILED and rig.sglang.failure_records[6] == reason


def test_abort_with_writes_on_the_wire_acks_only_after_they_drain(rig):
    key = rig.decode.engine.key
    faults.stall_lane(rig.prefill.engine.engine, 0, key)
    faults.stall_lane(rig.prefill.engine.engine, 1, key)
    try:
        rig.new_attempt(7)
        rig.metadata(7, pages=[50, 51])
        rig.claim(7)
        rig.send(7, pages=[8, 9], last=True)
        rig.wait(lambda: rig.service.p.rooms.get(7).writes, "writes submitted")
        rig.abort(7, generation=3)
        assert rig.sglang.status(7) == S.FAILED and rig.sglang.failure_records[7] == "Aborted by decode"
        assert rig.sglang.held_acks[7] == [("127.0.0.1", 17001, 3)]
        assert rig.messenger.of_type(protocol.AbortAck, 7) == []  # writes may still land
        assert rig.sglang.outstanding[7] > 0
    finally:
        faults.resume_lane(rig.prefill.engine.engine, None, key)
    rig.wait(lambda: rig.sglang.acks_sent, "the held ACK, once the writes drained")
    assert rig.sglang.acks_sent == [(7, "127.0.0.1", 17001, 3)]


def test_a_failed_lane_poisons_the_room_and_no_ack_is_sent(rig):
    key = rig.decode.engine.key
    faults.fail_lane(rig.prefill.engine.engine, 0, key)
    rig.new_attempt(8)
    rig.metadata(8, pages=list(range(16)))
    rig.claim(8)
    rig.send(8, pages=list(range(16, 32)), last=True)
    rig.wait_status(8, S.FAILED)
    assert "injected lane failure" in rig.sglang.failure_records[8]  # by its status or the peer event
    rig.abort(8, generation=4)
    rig.wait(lambda: rig.sglang.poisoned or rig.service.p.rooms.get(8).phase is Phase.POISONED, "the poison")
    assert rig.messenger.of_type(protocol.AbortAck, 8) == [] and rig.sglang.acks_sent == []


def test_bad_page_index_fails_one_room_not_the_next(rig):
    rig.new_attempt(9)
    rig.metadata(9, pages=[1000])  # decode's buffers hold 64 pages
    rig.claim(9)
    rig.send(9, pages=[0], last=True)
    rig.wait_status(9, S.FAILED)
    assert "out of range" in rig.sglang.failure_records[9]
    (told,) = rig.messenger.of_type(protocol.RoomStatus, 9)  # decode was told, with the reason
    assert told.status == S.FAILED and "out of range" in told.reason
    rig.new_attempt(10)
    rig.metadata(10, pages=[2])
    rig.claim(10)
    rig.send(10, pages=[3], last=True)
    rig.wait_status(10, S.SUCCESS)


def test_truncated_page_indices_fail_the_room_with_a_reason(rig):
    message = protocol.RoomMetadata(room=11, attempt=1, engine_key=rig.decode.engine.key, decode_ip="127.0.0.1",
                                    decode_port=17001, kv_indices=b"\x01\x02\x03")
    rig.service.control.on_metadata(message)
    assert rig.claim(11) == "room 11: page index list of 3 bytes is truncated"
    assert rig.sglang.status(11) == S.FAILED


def test_scheduler_abort_during_transfer_tells_decode(rig):
    key = rig.decode.engine.key
    faults.stall_lane(rig.prefill.engine.engine, 0, key)
    faults.stall_lane(rig.prefill.engine.engine, 1, key)
    try:
        rig.new_attempt(12)
        rig.metadata(12, pages=[5, 6])
        rig.claim(12)
        rig.send(12, pages=[1, 2], last=True)
        rig.wait(lambda: rig.service.p.rooms.get(12).writes, "writes submitted")
        rig.sglang.fail(12, "Aborted by AbortReq.")  # what CommonKVSender.abort() does
        rig.wait(lambda: rig.messenger.of_type(protocol.RoomStatus, 12), "the Failed status to decode")
        (failed,) = rig.messenger.of_type(protocol.RoomStatus, 12)
        assert failed.status == S.FAILED and failed.reason == "Aborted by AbortReq."
    finally:
        faults.resume_lane(rig.prefill.engine.engine, None, key)
    rig.clear(12)
    rig.wait_idle()


def test_a_different_attempt_for_a_live_room_is_refused(rig):
    rig.new_attempt(13)
    rig.metadata(13, pages=[1])
    rig.claim(13)
    rig.new_attempt(13)
    rig.metadata(13, pages=[2])  # not aborted first: forged, or a confused decode
    assert [e.reason for e in rig.rejections] == ["replayed"]
    assert rig.service.p.rooms.get(13).next_life == {}


def test_a_room_whose_only_destination_is_a_dummy_succeeds_without_writes(rig):
    """MLA with prefill TP > decode TP: only one prefill rank sends; the others get dummy metadata
    and must still conclude their rooms (Success, nothing written, nothing sent)."""
    rig.new_attempt(14)
    rig.metadata(14, pages=[9], is_dummy=True)
    rig.claim(14)
    rig.send(14, pages=[1], last=True)
    rig.wait_status(14, S.SUCCESS)
    assert rig.decode.page(0, 9) == bytes(256)
    assert rig.messenger.of_type(protocol.RoomStatus, 14) == [] and rig.messenger.of_type(protocol.TransferStarted, 14) == []
    # No engine session was opened to a peer that never received a byte.
    assert rig.service.p.peers.get(rig.decode.engine.key).open_pairs == set()
    rig.clear(14)
    rig.wait_idle()


def test_a_decode_engine_dead_before_its_first_write_fails_the_room_with_a_reason(rig):
    faults.kill_engine(rig.decode.engine.engine)
    rig.new_attempt(15)
    rig.metadata(15, pages=[1])
    rig.claim(15)
    rig.send(15, pages=[1], last=True)
    rig.wait_status(15, S.FAILED)
    reason = rig.sglang.failure_records[15]
    assert rig.decode.engine.key in reason, reason
    # The peer is now in its fail-fast window: the next room fails at once, with the same cause.
    rig.new_attempt(16)
    rig.metadata(16, pages=[2])
    rig.claim(16)
    rig.send(16, pages=[2], last=True)
    rig.wait_status(16, S.FAILED)
    assert "failed recently" in rig.sglang.failure_records[16]


def test_a_region_pair_that_cannot_be_opened_fails_before_any_byte_is_posted(rig):
    """The engine opens each (local, remote) region pair's session the first time it meets it, and
    inside one batch_write that can raise after the earlier pairs were posted: their writes would
    then be in flight with no status, and the room could never prove it drained. Here decode's
    second KV buffer is gone (deregistered, as a dying decode's would be) while its first is fine:
    the room must fail naming the peer, nothing may land, and the room must drain."""
    decode = rig.decode.engine
    decode.engine.deregister_memory(rig.decode.buffers.kv[1])
    rig.new_attempt(18)
    rig.metadata(18, pages=[4, 5])
    rig.claim(18)
    rig.send(18, pages=[0, 1], last=True)
    rig.wait_status(18, S.FAILED)
    reason = rig.sglang.failure_records[18]
    assert decode.key in reason and "size mismatch" in reason, reason
    assert rig.decode.page(0, 4) == bytes(256) and rig.decode.page(0, 5) == bytes(256)
    assert rig.decode.page(1, 4) == bytes(256)
    rig.clear(18)
    rig.wait_idle()  # every write the room issued is accounted for: nothing left draining


def test_no_failure_is_recorded_for_a_cleared_sender_and_a_stale_one_is_not_adopted(rig):
    """The scheduler clears a sender while our thread fails its room: SGLang would keep a failure
    record nobody pops, and a later request reusing the id would adopt it as its own."""
    rig.new_attempt(17)
    rig.metadata(17, pages=[1])
    rig.claim(17)
    rig.sglang.clear(17)  # SGLang's clear() ran; our release() has not yet
    assert rig.service.fail(17, "lost the race", "other")
    assert 17 not in rig.sglang.failure_records
    rig.service.release(17)
    rig.sglang.failure_records[17] = "left by an earlier life"  # the window SGLang shares
    rig.new_attempt(17)
    rig.metadata(17, pages=[2])
    assert rig.claim(17) is None
    assert 17 not in rig.sglang.failure_records
    rig.send(17, pages=[3], last=True)
    rig.wait_status(17, S.SUCCESS)


def test_decode_context_parallel_is_refused_at_registration_with_both_sides():
    """A DCP decode stripes tokens over its ranks; the relayout is MLA-only, so an MHA pair is
    refused at registration (copying pages would be accepted, then wrong)."""
    with PrefillRig() as rig:
        rig.decode_service.p.identity.dcp_size = 2
        rig.decode_service.p.identity.dcp_rank = 1
        rig.register()
        peer = rig.service.p.peers.get(rig.decode.engine.key)
        assert "prefill dcp_size=1 dcp_rank=0, decode dcp_size=2 dcp_rank=1" in peer.rejected
        assert "MLA KV only" in peer.rejected
        rig.new_attempt(1)
        rig.metadata(1, pages=[1])
        assert rig.claim(1) is None
        rig.send(1, pages=[1], last=True)
        rig.wait_status(1, S.FAILED)
        assert "decode dcp_size=2 dcp_rank=1" in rig.sglang.failure_records[1]
        assert rig.decode.page(0, 1) == bytes(256)


def test_decode_context_parallel_mla_is_relaid_out_byte_exact():
    """MLA prefill (DCP 1) into decode DCP rank 1 of 2, through Register, RoomMetadata and two
    chunks (SGLang's num_kv_tokens and index_slice) after a decode prefix of 2 tokens: the rank
    receives the tokens at odd absolute positions, packed into its pages; nothing else is written."""
    import msgspec

    from sglang_mori.backend.plans import KVPlanner

    with PrefillRig() as rig:
        mla = dict(is_mla=True, kv_physical_layout=None)
        rig.parts.planner = KVPlanner(msgspec.structs.replace(rig.prefill.layout, **mla), rig.prefill.buffers)
        rig.decode_service.p.layout = msgspec.structs.replace(rig.decode.layout, dcp_size=2, dcp_rank=1, **mla)
        rig.decode_service.p.identity.dcp_size = 2
        rig.decode_service.p.identity.dcp_rank = 1
        rig.register()
        peer = rig.service.p.peers.get(rig.decode.engine.key)
        assert peer.rejected is None
        rig.new_attempt(5)
        # 7 tokens after a prefix of 2 (page_size 1, virtual pages of 2 tokens: 4 of them).
        rig.service.control.on_metadata(rig.decode_service.record_destination(
            bootstrap_room=5, required_dst_info_num=1, kv_indices=np.asarray([20, 21, 22, 23]), aux_index=0,
            state_indices=None, decode_prefix_len=2, is_dummy=False))
        assert rig.claim(5) is None
        src = list(range(10, 17))
        rig.service.add_chunk(5, np.asarray(src[:4]), slice(0, 4), False, num_kv_tokens=4)
        rig.service.add_chunk(5, np.asarray(src[4:]), slice(4, 7), True, aux_index=0, num_kv_tokens=3)
        rig.wait_status(5, S.SUCCESS)
        # Absolute positions 3, 5, 7 (relative 1, 3, 5) are this rank's: local slots 0, 1, 2.
        expected = {20: 11, 21: 13, 22: 15}
        for buffer in range(len(rig.decode.kv)):
            for page in range(64):
                want = rig.prefill.page(buffer, expected[page]) if page in expected else bytes(256)
                assert rig.decode.page(buffer, page) == want, (buffer, page)


def test_a_rank_that_does_not_own_aux_sends_success_without_it():
    """Pipeline parallel: only the last stage computes output ids and draft hidden states; an
    earlier stage's aux buffer is stale and must never land in decode's slot."""
    with PrefillRig() as rig:
        rig.parts.owns_aux = False
        rig.register()
        rig.new_attempt(1)
        rig.metadata(1, pages=[4], aux_index=2)
        rig.claim(1)
        rig.send(1, pages=[0], last=True, aux_index=3)
        rig.wait_status(1, S.SUCCESS)
        done = rig.success_message(1)
        assert done.status == S.SUCCESS and done.aux is None
        rig.decode_service.on_status(done)
        assert rig.decode.aux[32:48].tobytes() == bytes(16)  # decode's slot untouched
        assert rig.decode.page(0, 4) == rig.prefill.page(0, 0)  # the KV still moved
