"""A room whose writes stay on the wire after it failed: decode releases its pages at SGLang's
deferred-release timeout (SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT) whether or not
prefill acked, and gives them to the next request. Prefill must have stopped those writes by then.

The lanes are stalled (a link whose bytes stopped moving), decode aborts the room, this test plays
decode's release timer, then the new owner's bytes go into the pages and the link comes back: no
byte of the aborted room may land there afterwards.
"""

import numpy as np

import sglang_mori.softio.faults as faults
from sglang_mori import protocol
from sglang_mori.backend import room_status as S
from sglang_mori.config import MoriConfig

from fake_sglang import FakeSGLang
from rig import PAGE_BYTES, PrefillRig
from waiting import wait_until

RELEASE_TIMEOUT_S = 6.0  # decode's deferred-release timeout in this test
FENCE_MARGIN_S = 3.0  # prefill fences that long before it


def _rig():
    # A deadline well past the fence: room 9 must fail by the fence, not by its own deadline.
    return PrefillRig(config=MoriConfig(transfer_shards=2, transfer_timeout_ms=30000,
                                        drain_fence_margin_s=FENCE_MARGIN_S),
                      sglang=FakeSGLang(decode_release_timeout_s=RELEASE_TIMEOUT_S))


def _writes_settled(rig, room_life) -> bool:
    return all(w.handle.quiescent() for w in room_life.writes)


def test_writes_stuck_past_decodes_release_never_land_in_reused_pages():
    with _rig() as rig:
        rig.register()
        key = rig.decode.engine.key
        engine = rig.prefill.engine.engine
        faults.stall_lane(engine, 0, key)
        faults.stall_lane(engine, 1, key)
        try:
            rig.new_attempt(7)
            rig.metadata(7, pages=[50, 51])
            rig.claim(7)
            rig.send(7, pages=[8, 9], last=True)
            life = rig.wait(lambda: rig.service.p.rooms.get(7), "room 7")
            rig.wait(lambda: life.writes, "writes submitted")
            rig.new_attempt(9)  # another request, queued behind room 7 on the same stalled lanes
            rig.metadata(9, pages=[60])
            rig.claim(9)
            rig.send(9, pages=[4], last=True)
            rig.wait(lambda: rig.service.p.rooms.get(9).writes, "room 9's writes submitted")
            rig.abort(7, generation=3)  # decode's KV wait timed out: it aborts and holds the pages
            assert rig.sglang.failure_records[7] == "Aborted by decode"
            # Decode's deferred release: the held ACK, or its timeout, whichever comes first.
            try:
                wait_until(lambda: rig.sglang.acks_sent, "the abort ACK", RELEASE_TIMEOUT_S)
            except AssertionError:
                pass  # SGLang releases anyway ("releasing anyway")
            # The pages go to the next request, which fills them.
            reused = np.full(PAGE_BYTES, 0xEE, dtype=np.uint8)
            for buf in rig.decode.kv:
                for page in (50, 51):
                    buf[page * PAGE_BYTES:(page + 1) * PAGE_BYTES] = reused
        finally:
            faults.resume_lane(engine, None, key)  # the link comes back
        rig.wait(lambda: _writes_settled(rig, life), "room 7's writes settled")
        for b in range(len(rig.decode.kv)):
            for page in (50, 51):
                assert rig.decode.page(b, page) == reused.tobytes(), (
                    f"a write of aborted room 7 landed in reused page {page} of buffer {b}")
        assert rig.sglang.acks_sent == [(7, "127.0.0.1", 17001, 3)]  # released on proof, not timeout
        # Room 9's write shared the fenced lanes: it fails, with the fence as its cause, and decode
        # is told; nothing of it landed either.
        rig.wait_status(9, S.FAILED)
        assert "fenced" in rig.sglang.failure_records[9] and "room 7" in rig.sglang.failure_records[9]
        (told,) = rig.messenger.of_type(protocol.RoomStatus, 9)
        assert told.status == S.FAILED and "fenced" in told.reason
        assert rig.decode.page(0, 60) == bytes(PAGE_BYTES)

        # The peer serves the next request (its lanes were rebuilt, it was not marked failed).
        rig.new_attempt(8)
        rig.metadata(8, pages=[52])
        rig.claim(8)
        rig.send(8, pages=[3], last=True)
        rig.wait_status(8, S.SUCCESS)
        assert rig.decode.page(0, 52) == rig.prefill.page(0, 3)
        assert 8 not in rig.sglang.failure_records
