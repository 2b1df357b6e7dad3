"""An inline post (SGLANG_MORI_INLINE_POST) whose engine call raises after part of the chunk was
posted (SubmitError carries the handle of what was issued) fails its room through the failure door
from the handing-over thread, yet keeps what was posted tracked: SGLang's outstanding count holds
the room's pages until that write is drained, as on a shard."""

from sglang_mori import protocol
from sglang_mori.backend import room_status as S
from sglang_mori.config import MoriConfig
from sglang_mori.engine import SubmitError

from rig import PrefillRig
from stalled_lanes import open_room, resume, stall
from test_inline_post import warm_up


def test_a_partly_posted_inline_chunk_fails_its_room_and_holds_its_pages_until_drained():
    with PrefillRig(MoriConfig(transfer_shards=1, transfer_timeout_ms=30000, inline_post="on")) as rig:
        rig.register()
        warm_up(rig)
        engine = rig.prefill.engine
        real_write = engine.write

        def write(peer_key, batch, **kw):
            handle = real_write(peer_key, batch, **kw)  # posted, then the call raises
            raise SubmitError("send queue refused the rest", handle)

        engine.write = write
        stall(rig)  # what was posted stays in flight
        try:
            open_room(rig, 5, pages=[50, 51])
            rig.send(5, pages=[3, 4], last=True)
            # Failed before send() returned, by this thread, through the door, decode told.
            assert rig.sglang.status(5) == S.FAILED
            assert "send queue refused the rest" in rig.sglang.failure_reason(5)
            (failed,) = rig.messenger.of_type(protocol.RoomStatus, 5)
            assert failed.status == S.FAILED
            assert rig.service.submitter.inline_posts == 1
            # The posted write is tracked: SGLang keeps the room's pages while it may still land.
            assert rig.sglang.outstanding.get(5, 0) == 1
        finally:
            engine.write = real_write
            resume(rig)
        rig.wait(lambda: not rig.sglang.outstanding.get(5), "room 5's posted write drained")
        rig.clear(5), rig.clear(90)
        rig.wait_idle()
