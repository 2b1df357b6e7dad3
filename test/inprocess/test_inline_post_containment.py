"""A bug in an inline post (SGLANG_MORI_INLINE_POST) fails that room, never the thread that handed
the chunk over: SGLang's scheduler in its `send()`, or the transfer process's reader, which would
log the record as failed and leave the room open with its chunk lost. A shard contains the same
bug (run_shard fails the chunk's room); the inline path must too. The bug is injected where
`post_tracked` itself does not catch it: the Success attempt after the writes are tracked."""

import pytest

from sglang_mori import protocol
from sglang_mori.backend import room_status as S
from sglang_mori.config import MoriConfig

from rig import PrefillRig
from stalled_lanes import open_room, resume, stall
from test_inline_post import warm_up


@pytest.mark.parametrize("mode", ["on", "off"])
def test_a_bug_after_the_post_fails_its_room_not_the_caller(mode):
    with PrefillRig(MoriConfig(transfer_shards=1, transfer_timeout_ms=30000, inline_post=mode)) as rig:
        rig.register()
        warm_up(rig)
        submitter = rig.service.submitter
        real_success = submitter.success

        class BuggySuccess:  # only the submitter's own Success attempt: the completion thread's is real
            def try_succeed(self, r, **kw):
                if r.room == 5:
                    raise RuntimeError("success bug")
                return real_success.try_succeed(r, **kw)

        submitter.success = BuggySuccess()
        open_room(rig, 5, pages=[50])
        # The lanes stalled: the write stays running, so only the bug can conclude the room.
        stall(rig)
        try:
            rig.send(5, pages=[3], last=True)  # must return: the bug is the room's, not send()'s
            rig.wait_status(5, S.FAILED)
            assert "internal error while sending KV" in rig.sglang.failure_reason(5)
            rig.wait(lambda: rig.messenger.of_type(protocol.RoomStatus, 5), "room 5's Failed to decode")
            (failed,) = rig.messenger.of_type(protocol.RoomStatus, 5)
            assert failed.status == S.FAILED and "success bug" in failed.reason
        finally:
            resume(rig)
        submitter.success = real_success
        open_room(rig, 6, pages=[51])
        rig.send(6, pages=[4], last=True)
        rig.wait_status(6, S.SUCCESS)
        rig.clear(5), rig.clear(6), rig.clear(90)
        rig.wait_idle()
