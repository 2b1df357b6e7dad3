"""Layer-wise streaming on the in-process rig: the session is driven the way hooks.py drives it
(begin_batch before the forward, on_layer after each attention layer, end_batch after it, then
SGLang's send() through add_chunk), on real softio engines and the real service threads.

Layout: 4 layers MHA (8 KV buffers: K0..K3, V0..V3), page size 1, 256 bytes per page.
"""

import threading
import time

import numpy as np
import pytest

import sglang_mori.softio.faults as faults
from sglang_mori import protocol
from sglang_mori.backend import room_status as S
from sglang_mori.backend.prefill.layerwise.planner import LayerwisePlanner
from sglang_mori.backend.prefill.layerwise.session import BatchView, ReqView, group_ends
from sglang_mori.config import MoriConfig
from sglang_mori.softio.write_log import enable_write_log, get_write_log

from layerwise_rig import CountingMetrics
from rig import PrefillRig

LAYERS = 4


@pytest.fixture
def rig():
    with PrefillRig(MoriConfig(transfer_shards=2, transfer_timeout_ms=5000), buffers=2 * LAYERS,
                    planner_class=LayerwisePlanner) as r:
        r.metrics = r.parts.metrics = CountingMetrics()
        r.register()
        yield r


def view(room, row, prefix, extend, input_len, start_send=0, **kw):
    return BatchView([ReqView(room=room, prefix_len=prefix, extend_len=extend, input_len=input_len,
                              decode_prefix_len=0, start_send_idx=start_send, row=np.asarray(row), **kw)],
                     page_size=1)


def forward(session, rig, batch, layers=range(LAYERS), per_layer_s=0.0):
    """What the attention hook does during one forward; returns when the forward 'ended'."""
    pool = rig.prefill.pool()
    for layer in layers:
        time.sleep(per_layer_s)
        session.on_layer(batch, pool, layer)
    time.sleep(per_layer_s)
    end = time.monotonic()
    session.end_batch(batch)
    return end


def open_room(rig, room, dst_pages):
    rig.new_attempt(room)
    rig.metadata(room, pages=dst_pages, aux_index=1)
    assert rig.claim(room) is None


def assert_bytes(rig, src_pages, dst_pages):
    for b in range(2 * LAYERS):
        assert [rig.decode.page(b, p) for p in dst_pages] == [rig.prefill.page(b, p) for p in src_pages], b


def test_streamed_layers_land_byte_exact_and_send_adds_only_aux(rig):
    session = rig.layerwise()
    src, dst = list(range(10, 22)), list(range(30, 42))
    open_room(rig, 1, dst)
    batch = session.begin_batch(view(1, src, 0, 12, 12))
    assert batch is not None and rig.sglang.status(1) == S.TRANSFERRING
    forward(session, rig, batch)
    session.add_chunk(1, np.array(src), slice(0, 12), True, aux_index=2)
    rig.wait_status(1, S.SUCCESS)
    assert_bytes(rig, src, dst)
    assert rig.metrics.layerwise == LAYERS  # one write per layer (one peer)
    (done,) = rig.messenger.of_type(protocol.RoomStatus, 1)
    assert done.aux == [rig.prefill.aux[32:48].tobytes()]
    rig.clear(1)
    rig.wait_idle()


def test_layer_groups_and_chunked_passes(rig):
    session = rig.layerwise(group_size=3)
    src, dst = list(range(0, 20)), list(range(40, 60))
    open_room(rig, 2, dst)
    # pass 1: tokens 0..8; pass 2 is published before pass 1's send (overlap scheduler order)
    b1 = session.begin_batch(view(2, src, 0, 8, 20))
    forward(session, rig, b1)
    b2 = session.begin_batch(view(2, src, 8, 12, 20, start_send=0))
    assert b2.streams[0].dst_slice == slice(8, 20)
    session.add_chunk(2, np.array(src[:8]), slice(0, 8), False)  # pass 1's send, late
    forward(session, rig, b2)
    session.add_chunk(2, np.array(src[8:]), slice(8, 20), True, aux_index=0)
    rig.wait_status(2, S.SUCCESS)
    assert_bytes(rig, src, dst)
    assert rig.metrics.layerwise == 4  # two groups (3 + 1 layers) per pass


def test_halving_groups_write_where_they_end_and_announce_once(rig):
    """Group size 0: a write where each halving group ends (session.group_ends; with 4 layers that
    is every layer), one TransferStarted for the forward's streamed groups, not one per group."""
    session = rig.layerwise(group_size=0)
    src, dst = list(range(20, 28)), list(range(30, 38))
    open_room(rig, 7, dst)
    batch = session.begin_batch(view(7, src, 0, 8, 8))
    forward(session, rig, batch)
    session.add_chunk(7, np.array(src), slice(0, 8), True, aux_index=0)
    rig.wait_status(7, S.SUCCESS)
    assert_bytes(rig, src, dst)
    assert rig.metrics.layerwise == len(group_ends(LAYERS))
    # one for the streamed groups (not one per group); send()'s last chunk had nothing left to
    # write and announces nothing
    assert len(rig.messenger.of_type(protocol.TransferStarted, 7)) == 1


def test_a_short_batch_goes_chunk_wise_and_is_counted(rig):
    session = rig.layerwise(min_batch_tokens=9)
    src, dst = list(range(40, 48)), list(range(50, 58))
    open_room(rig, 8, dst)
    assert session.begin_batch(view(8, src, 0, 8, 8)) is None  # 8 new tokens < 9
    assert rig.metrics.fallbacks == ["short_batch"]
    session.add_chunk(8, np.array(src), slice(0, 8), True, aux_index=0)
    rig.wait_status(8, S.SUCCESS)
    assert_bytes(rig, src, dst)
    assert rig.metrics.layerwise == 0


def test_layers_the_hook_never_saw_go_with_send(rig):
    session = rig.layerwise()
    src, dst = [5, 6, 7, 8], [1, 2, 3, 4]
    open_room(rig, 3, dst)
    batch = session.begin_batch(view(3, src, 0, 4, 4))
    forward(session, rig, batch, layers=[0, 1])  # e.g. the last layers run in a graph without the hook
    session.add_chunk(3, np.array(src), slice(0, 4), True, aux_index=0)
    rig.wait_status(3, S.SUCCESS)
    assert_bytes(rig, src, dst)
    assert rig.metrics.layerwise == 2


def test_a_forward_that_never_calls_the_hook_is_counted_and_sent_chunk_wise(rig):
    session = rig.layerwise()
    open_room(rig, 4, [9, 10])
    batch = session.begin_batch(view(4, [1, 2], 0, 2, 2))
    forward(session, rig, batch, layers=[])
    session.add_chunk(4, np.array([1, 2]), slice(0, 2), True, aux_index=0)
    rig.wait_status(4, S.SUCCESS)
    assert_bytes(rig, [1, 2], [9, 10])
    assert rig.metrics.fallbacks == ["no_layer_hook"] and rig.metrics.layerwise == 0


def test_unmapped_pool_stops_the_batch_and_send_covers_the_rest(rig):
    session = rig.layerwise()
    open_room(rig, 5, [11, 12, 13])
    batch = session.begin_batch(view(5, [4, 5, 6], 0, 3, 3))
    pool = rig.prefill.pool()
    session.on_layer(batch, pool, 0)
    session.on_layer(batch, type("Quantized", (), {"k_buffer": [np.zeros(4)] * 4, "v_buffer": pool.v_buffer})(), 1)
    session.on_layer(batch, pool, 2)  # ignored: the batch stopped
    session.end_batch(batch)
    session.add_chunk(5, np.array([4, 5, 6]), slice(0, 3), True, aux_index=0)
    rig.wait_status(5, S.SUCCESS)
    assert_bytes(rig, [4, 5, 6], [11, 12, 13])
    assert rig.metrics.fallbacks == ["unmapped_pool"] and rig.metrics.layerwise == 1


def test_requests_that_cannot_stream_are_counted(rig):
    session = rig.layerwise(min_tokens=8)
    open_room(rig, 6, [1, 2])
    assert session.begin_batch(view(6, [1, 2], 0, 2, 2)) is None  # 2 new tokens < 8
    # an optimistic request too few tokens to stream even once its destinations come
    assert session.begin_batch(view(6, [1, 2], 0, 2, 2, pending_bootstrap=True)) is None
    assert session.begin_batch(view(77, list(range(10)), 0, 10, 10)) is None  # no metadata yet
    assert session.begin_batch(BatchView([], 1, fallback="speculative")) is None
    assert rig.metrics.fallbacks == ["below_min_tokens", "below_min_tokens", "not_ready", "speculative"]
    session.add_chunk(6, np.array([1, 2]), slice(0, 2), True, aux_index=0)  # plain chunk-wise
    rig.wait_status(6, S.SUCCESS)


def test_success_waits_for_streamed_writes_still_on_the_wire(rig):
    """The last send() finds everything streamed; the room must not report Success while a layer
    write is stalled, nor before the worker tracked every group of the batch."""
    session = rig.layerwise()
    key = rig.decode.engine.key
    open_room(rig, 7, [20, 21])
    faults.stall_lane(rig.prefill.engine.engine, 0, key)
    faults.stall_lane(rig.prefill.engine.engine, 1, key)
    try:
        batch = session.begin_batch(view(7, [3, 4], 0, 2, 2))
        forward(session, rig, batch)
        session.add_chunk(7, np.array([3, 4]), slice(0, 2), True, aux_index=0)
        life = rig.service.p.rooms.get(7)
        # send() had nothing left to write: the last chunk adds no write of its own
        rig.wait(lambda: len(life.writes) >= LAYERS and life.last_submitted and not life.submitting,
                 "every layer write and the last chunk tracked, the worker's token returned")
        assert not rig.service.success.try_succeed(life)  # every thread's decision: not while writes run
        assert rig.sglang.status(7) == S.TRANSFERRING
        assert not rig.messenger.of_type(protocol.RoomStatus, 7)
    finally:
        faults.resume_lane(rig.prefill.engine.engine, None, key)
    rig.wait_status(7, S.SUCCESS)
    assert_bytes(rig, [3, 4], [20, 21])


def test_first_write_lands_before_the_forward_ends(rig):
    """Overlap, from the target's write log: a layer's pages are on decode while later layers are
    still being computed. The forward does not go past its second layer until layer 0's write is in
    decode's log (bounded wait), so a backend that only writes at the forward's end fails here
    whatever the machine's load, and no wall-clock margin is involved."""
    session = rig.layerwise()
    enable_write_log(rig.decode.engine.engine)
    src, dst = list(range(30)), list(range(30, 60))
    open_room(rig, 8, dst)
    batch = session.begin_batch(view(8, src, 0, 30, 30))
    pool = rig.prefill.pool()
    session.on_layer(batch, pool, 0)
    rig.wait(lambda: get_write_log(rig.decode.engine.engine), "layer 0's write on decode, mid-forward")
    landed_mid_forward = len(get_write_log(rig.decode.engine.engine))
    for layer in range(1, LAYERS):
        session.on_layer(batch, pool, layer)
    session.end_batch(batch)
    session.add_chunk(8, np.array(src), slice(0, 30), True, aux_index=0)
    rig.wait_status(8, S.SUCCESS)
    assert landed_mid_forward >= 1
    assert_bytes(rig, src, dst)


def test_abort_mid_stream_acks_only_after_streamed_writes_drain(rig):
    session = rig.layerwise()
    key = rig.decode.engine.key
    open_room(rig, 9, [50, 51, 52])
    faults.stall_lane(rig.prefill.engine.engine, 0, key)
    faults.stall_lane(rig.prefill.engine.engine, 1, key)
    try:
        batch = session.begin_batch(view(9, [1, 2, 3], 0, 3, 3))
        pool = rig.prefill.pool()
        session.on_layer(batch, pool, 0)
        session.on_layer(batch, pool, 1)
        rig.wait(lambda: len(rig.service.p.rooms.get(9).writes) == 2, "two layer writes on the wire")
        rig.abort(9, generation=5)  # decode aborts mid-forward
        assert rig.sglang.status(9) == S.FAILED
        session.on_layer(batch, pool, 2)
        session.on_layer(batch, pool, 3)
        session.end_batch(batch)
        rig.wait(lambda: batch.done.is_set(), "the worker finished the batch")
        assert len(rig.service.p.rooms.get(9).writes) == 2  # nothing posted after the abort
        assert rig.messenger.of_type(protocol.AbortAck, 9) == [] and rig.sglang.acks_sent == []
    finally:
        faults.resume_lane(rig.prefill.engine.engine, None, key)
    rig.wait(lambda: rig.sglang.acks_sent, "the held ACK, once the streamed writes drained")
    assert rig.sglang.acks_sent == [(9, "127.0.0.1", 17001, 5)]
    # layers 2 and 3 never reached decode
    assert rig.decode.page(2, 50) == bytes(256) and rig.decode.page(LAYERS + 3, 52) == bytes(256)


def test_radix_checkpoint_that_moves_a_streamed_page_holds_the_next_forward(rig):
    session = rig.layerwise()
    key = rig.decode.engine.key
    src = [10, 11, 12]
    open_room(rig, 10, [1, 2, 3])
    faults.stall_lane(rig.prefill.engine.engine, 0, key)
    faults.stall_lane(rig.prefill.engine.engine, 1, key)
    released = threading.Event()
    try:
        batch = session.begin_batch(view(10, src, 0, 3, 3))
        forward(session, rig, batch)
        # unchanged pages: no hazard
        assert session.after_checkpoint(10, np.array(src), 1) is False
        # dedup into the radix tree: page 11 now reads from page 40 and 11 is free
        assert session.after_checkpoint(10, np.array([10, 40, 12]), 1) is True
        waiter = threading.Thread(target=lambda: (session.wait_hazards(), released.set()), daemon=True)
        waiter.start()
        time.sleep(0.3)
        assert not released.is_set()  # the next forward (which could rewrite page 11) waits
    finally:
        faults.resume_lane(rig.prefill.engine.engine, None, key)
    assert released.wait(10)
    session.add_chunk(10, np.array([10, 40, 12]), slice(0, 3), True, aux_index=0)
    rig.wait_status(10, S.SUCCESS)
    assert_bytes(rig, src, [1, 2, 3])


def test_a_layer_that_runs_twice_is_not_counted_as_streamed(rig):
    session = rig.layerwise()
    open_room(rig, 11, [7, 8])
    batch = session.begin_batch(view(11, [1, 2], 0, 2, 2))
    pool = rig.prefill.pool()
    session.on_layer(batch, pool, 0)
    session.on_layer(batch, pool, 0)  # again: the first hand-off may have been incomplete
    session.end_batch(batch)
    assert session.records[11].coverage.segments == []  # layer 0 was the only one handed off
    session.add_chunk(11, np.array([1, 2]), slice(0, 2), True, aux_index=0)
    rig.wait_status(11, S.SUCCESS)
    assert_bytes(rig, [1, 2], [7, 8])
    assert rig.metrics.fallbacks == ["other"]


def test_a_failing_publication_gives_its_tokens_back(rig):
    session = rig.layerwise()
    open_room(rig, 12, [3, 4])
    open_room(rig, 13, [5, 6])

    class BadRow:
        def __getitem__(self, item):
            raise RuntimeError("req_to_token unreadable")

    good = ReqView(room=12, prefix_len=0, extend_len=2, input_len=2, decode_prefix_len=0, start_send_idx=0,
                   row=np.array([1, 2]))
    bad = ReqView(room=13, prefix_len=0, extend_len=2, input_len=2, decode_prefix_len=0, start_send_idx=0,
                  row=BadRow())
    with pytest.raises(RuntimeError):
        session.begin_batch(BatchView([good, bad], page_size=1))
    rig.wait(lambda: rig.service.p.rooms.get(12).submitting == 0, "room 12's batch token given back")
    for room, src, dst in ((12, [1, 2], [3, 4]), (13, [9, 10], [5, 6])):
        session.add_chunk(room, np.array(src), slice(0, 2), True, aux_index=0)  # chunk-wise
        rig.wait_status(room, S.SUCCESS)
        assert_bytes(rig, src, dst)
