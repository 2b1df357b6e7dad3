"""Layer-wise streaming of optimistic requests (SGLang's `--optimistic-prefill-attempts`): a request
that begins its forward with `pending_bootstrap` (decode's destinations not known yet) joins the
stream at the first layer hook after its room turned READY, with a catch-up write of the layers
already handed off; if its destinations do not come during the forward it goes chunk-wise
(`pending_bootstrap`), as it did before. Driven like test_layerwise.py: the session's calls as
hooks.py makes them, on real softio engines and service threads.

Layout: 4 layers MHA (8 KV buffers: K0..K3, V0..V3), page size 1, 256 bytes per page.
"""

import numpy as np
import pytest

import sglang_mori.softio.faults as faults
from sglang_mori import protocol
from sglang_mori.backend import room_status as S
from sglang_mori.backend.prefill.layerwise.planner import LayerwisePlanner
from sglang_mori.config import MoriConfig
from sglang_mori.softio.write_log import enable_write_log, get_write_log

from layerwise_rig import CountingMetrics
from rig import PrefillRig
from test_layerwise import LAYERS, assert_bytes, view
from test_layerwise_layouts import stub_sender_module  # noqa: F401 (a fixture)


@pytest.fixture
def rig():
    with PrefillRig(MoriConfig(transfer_shards=2, transfer_timeout_ms=5000), buffers=2 * LAYERS,
                    planner_class=LayerwisePlanner) as r:
        r.metrics = r.parts.metrics = CountingMetrics()
        r.register()
        yield r


def claim_pending(rig, room):
    """SGLang created the request's sender; decode's destinations have not arrived."""
    rig.new_attempt(room)
    assert rig.claim(room) is None
    assert rig.sglang.status(room) == S.BOOTSTRAPPING


def destinations(rig, room, dst):
    rig.metadata(room, pages=dst, aux_index=1)
    assert rig.sglang.status(room) == S.WAITING_FOR_INPUT


def finalize_and_send(rig, session, room, src):
    """SGLang's finalize_bootstrap after the forward (start_send_idx = decode's prefix, here 0),
    then send()'s last chunk of the whole request."""
    session.add_chunk(room, np.array(src), slice(0, len(src)), True, aux_index=2)


@pytest.mark.parametrize("group_size, arrive_after", [(1, 2), (1, 0), (3, 3), (0, 1)])
def test_destinations_arriving_mid_forward_stream_every_layer_byte_exact(rig, group_size, arrive_after):
    """Destinations arrive after layer `arrive_after - 1` ran: the next hook joins the room with a
    catch-up of every layer handed off so far; every layer is written once and lands byte-exact,
    and send() afterwards has nothing left but the aux data."""
    session = rig.layerwise(group_size=group_size)
    enable_write_log(rig.decode.engine.engine)
    src, dst = list(range(10, 22)), list(range(30, 42))
    claim_pending(rig, 1)
    batch = session.begin_batch(view(1, src, 0, 12, 12, pending_bootstrap=True))
    assert batch is not None and batch.streams == [] and len(batch.waiting) == 1
    pool = rig.prefill.pool()
    for layer in range(arrive_after):
        session.on_layer(batch, pool, layer)
    assert get_write_log(rig.decode.engine.engine) == []  # nothing can be written yet
    destinations(rig, 1, dst)
    for layer in range(arrive_after, LAYERS):
        session.on_layer(batch, pool, layer)
    session.end_batch(batch)
    rig.wait(lambda: batch.done.is_set(), "the worker finished the batch")
    # SGLang still holds it as pending_bootstrap: its poll must read WaitingForInput, never
    # Transferring (handle_pending_bootstrap raises on that)
    assert rig.sglang.status(1) == S.WAITING_FOR_INPUT
    assert rig.metrics.late == 1 and rig.metrics.fallbacks == []
    record = session.records[1]
    assert [(s.page_lo, s.page_hi, s.buffers) for s in record.coverage.segments] == [
        (0, 12, frozenset(range(2 * LAYERS)))]
    finalize_and_send(rig, session, 1, src)
    rig.wait_status(1, S.SUCCESS)
    assert_bytes(rig, src, dst)
    # each decode KV byte written exactly once: the catch-up did not repeat an open group
    assert_written_once(rig, dst)
    (done,) = rig.messenger.of_type(protocol.RoomStatus, 1)
    assert done.aux == [rig.prefill.aux[32:48].tobytes()]
    rig.clear(1)
    rig.wait_idle()


def test_catch_up_is_one_write_of_the_layers_already_handed_off(rig):
    """Group size 1, destinations after layer 1: layers 0 and 1 go in one catch-up write, layers 2
    and 3 one write each, and the catch-up announces the transfer once."""
    session = rig.layerwise(group_size=1)
    src, dst = [1, 2, 3, 4], [5, 6, 7, 8]
    claim_pending(rig, 2)
    batch = session.begin_batch(view(2, src, 0, 4, 4, pending_bootstrap=True))
    pool = rig.prefill.pool()
    session.on_layer(batch, pool, 0)
    session.on_layer(batch, pool, 1)
    assert rig.metrics.layerwise == 0
    destinations(rig, 2, dst)
    session.on_layer(batch, pool, 2)
    rig.wait(lambda: rig.metrics.layerwise == 2, "the catch-up write and layer 2's")
    session.on_layer(batch, pool, 3)
    session.end_batch(batch)
    rig.wait(lambda: batch.done.is_set(), "the worker finished the batch")
    assert rig.metrics.layerwise == 3
    assert len(rig.messenger.of_type(protocol.TransferStarted, 2)) == 1
    finalize_and_send(rig, session, 2, src)
    rig.wait_status(2, S.SUCCESS)
    assert_bytes(rig, src, dst)


def test_success_only_after_the_catch_up_write_lands(rig):
    """The catch-up write is stalled on the wire: send()'s last chunk (nothing left to write)
    must not conclude the room while it runs."""
    session = rig.layerwise(group_size=1)
    key = rig.decode.engine.key
    src, dst = [3, 4], [20, 21]
    claim_pending(rig, 3)
    batch = session.begin_batch(view(3, src, 0, 2, 2, pending_bootstrap=True))
    pool = rig.prefill.pool()
    session.on_layer(batch, pool, 0)
    destinations(rig, 3, dst)
    faults.stall_lane(rig.prefill.engine.engine, 0, key)
    faults.stall_lane(rig.prefill.engine.engine, 1, key)
    try:
        for layer in range(1, LAYERS):
            session.on_layer(batch, pool, layer)
        session.end_batch(batch)
        finalize_and_send(rig, session, 3, src)
        life = rig.service.p.rooms.get(3)
        rig.wait(lambda: len(life.writes) >= LAYERS and life.last_submitted and not life.submitting,
                 "the catch-up, every later layer and the last chunk tracked")
        assert not rig.service.success.try_succeed(life)
        assert rig.sglang.status(3) == S.WAITING_FOR_INPUT
        assert not rig.messenger.of_type(protocol.RoomStatus, 3)
    finally:
        faults.resume_lane(rig.prefill.engine.engine, None, key)
    rig.wait_status(3, S.SUCCESS)
    assert_bytes(rig, src, dst)


def test_destinations_published_after_send_go_chunk_wise_and_are_counted(rig):
    """The publishing thread lost the race: SGLang read WaitingForInput, finalized the request and
    called send() before our notification ran. send() moves everything chunk-wise (counted once),
    and the late notification posts nothing: each decode byte is written once."""
    session = rig.layerwise(group_size=1)
    enable_write_log(rig.decode.engine.engine)
    src, dst = [7, 8, 9], [1, 2, 3]
    claim_pending(rig, 4)
    batch = session.begin_batch(view(4, src, 0, 3, 3, pending_bootstrap=True))
    pool = rig.prefill.pool()
    for layer in range(LAYERS):
        session.on_layer(batch, pool, layer)
    session.end_batch(batch)
    rig.wait(lambda: batch.done.is_set(), "the worker finished the batch")
    assert rig.metrics.fallbacks == [] and rig.metrics.layerwise == 0  # it may still join
    delayed = []
    rig.service.effects.on_published = delayed.append  # the notification runs only later
    destinations(rig, 4, dst)
    finalize_and_send(rig, session, 4, src)
    assert rig.metrics.fallbacks == ["pending_bootstrap"]
    assert delayed == [4]
    session.late.published(4)
    rig.wait_status(4, S.SUCCESS)
    assert rig.metrics.late == 0 and rig.metrics.layerwise == 0 and rig.metrics.fallbacks == ["pending_bootstrap"]
    assert_bytes(rig, src, dst)
    assert_written_once(rig, dst)


def assert_written_once(rig, dst):
    """Each decode KV byte of the destination pages written exactly once."""
    counts = [np.zeros(len(a), np.int32) for a in rig.decode.kv]
    by_region = {d.id: b for b, d in enumerate(rig.decode.buffers.kv)}
    for r in get_write_log(rig.decode.engine.engine):
        if r.region_id in by_region:
            counts[by_region[r.region_id]][r.offset:r.offset + r.size] += 1
    item = len(rig.decode.page(0, 0))
    for b, c in enumerate(counts):
        assert all((c[p * item:(p + 1) * item] == 1).all() for p in dst), b


def test_ready_room_not_yet_published_to_sglang_waits_for_a_later_layer(rig):
    """READY in our registry but SGLang's status still Bootstrapping (the thread that made it
    READY has not published it yet): no join, since SGLang could still requeue the request."""
    session = rig.layerwise(group_size=1)
    src, dst = [1, 2], [3, 4]
    claim_pending(rig, 5)
    batch = session.begin_batch(view(5, src, 0, 2, 2, pending_bootstrap=True))
    pool = rig.prefill.pool()
    rig.service.effects.on_published = None  # the publishing thread has not told us yet either
    destinations(rig, 5, dst)
    rig.sglang.request_status[5] = S.BOOTSTRAPPING  # as if the publication had not happened yet
    session.on_layer(batch, pool, 0)
    assert batch.streams == [] and rig.metrics.late == 0
    rig.sglang.request_status[5] = S.WAITING_FOR_INPUT
    for layer in range(1, LAYERS):
        session.on_layer(batch, pool, layer)
    session.end_batch(batch)
    assert rig.metrics.late == 1
    finalize_and_send(rig, session, 5, src)
    rig.wait_status(5, S.SUCCESS)
    assert_bytes(rig, src, dst)


def test_room_aborted_after_joining_posts_nothing_more(rig):
    session = rig.layerwise(group_size=1)
    key = rig.decode.engine.key
    src, dst = [1, 2, 3], [50, 51, 52]
    claim_pending(rig, 6)
    batch = session.begin_batch(view(6, src, 0, 3, 3, pending_bootstrap=True))
    pool = rig.prefill.pool()
    session.on_layer(batch, pool, 0)
    destinations(rig, 6, dst)
    faults.stall_lane(rig.prefill.engine.engine, 0, key)
    faults.stall_lane(rig.prefill.engine.engine, 1, key)
    try:
        session.on_layer(batch, pool, 1)  # joins: catch-up of layer 0, then layer 1
        life = rig.service.p.rooms.get(6)
        rig.wait(lambda: len(life.writes) == 2, "the catch-up and layer 1's write on the wire")
        rig.abort(6, generation=5)  # decode aborts mid-forward
        assert rig.sglang.status(6) == S.FAILED
        session.on_layer(batch, pool, 2)
        session.on_layer(batch, pool, 3)
        session.end_batch(batch)
        rig.wait(lambda: batch.done.is_set(), "the worker finished the batch")
        assert len(life.writes) == 2  # nothing posted after the abort
        assert rig.sglang.acks_sent == []  # decode's pages stay held while the writes may land
    finally:
        faults.resume_lane(rig.prefill.engine.engine, None, key)
    rig.wait(lambda: rig.sglang.acks_sent, "the held ACK, once the written layers drained")
    assert rig.decode.page(2, 50) == bytes(256) and rig.decode.page(LAYERS + 3, 52) == bytes(256)


def test_room_failed_before_its_destinations_never_joins(rig):
    session = rig.layerwise(group_size=1)
    claim_pending(rig, 7)
    batch = session.begin_batch(view(7, [1, 2], 0, 2, 2, pending_bootstrap=True))
    pool = rig.prefill.pool()
    session.on_layer(batch, pool, 0)
    rig.abort(7, generation=2)  # decode gave up before sending destinations
    for layer in range(1, LAYERS):
        session.on_layer(batch, pool, layer)
    session.end_batch(batch)
    rig.wait(lambda: batch.done.is_set(), "the worker finished the batch")
    assert batch.waiting == [] and rig.metrics.layerwise == 0 and rig.metrics.late == 0
    assert rig.metrics.fallbacks == ["pending_bootstrap"]
    assert rig.sglang.status(7) == S.FAILED


def test_without_late_join_optimistic_requests_go_chunk_wise(rig):
    """Attention TP > 1 (assembly passes late_join=False): counted at publication, as before."""
    session = rig.layerwise(group_size=1)
    session.late_join = False
    claim_pending(rig, 8)
    assert session.begin_batch(view(8, [1, 2], 0, 2, 2, pending_bootstrap=True)) is None
    assert rig.metrics.fallbacks == ["pending_bootstrap"]


@pytest.mark.parametrize("decode_prefix, arrive_after", [(4, 1), (3, 2)])
def test_decode_prefix_learnt_mid_forward_agrees_with_finalize(rig, decode_prefix, arrive_after):
    """Decode holds the first `decode_prefix` tokens: its destinations start after them. The
    joined stream skips them by the same value SGLang's finalize_bootstrap reads
    (req_to_decode_prefix_len), so send() from start_send_idx = decode_prefix finds only the aux
    data left, decode's pages of the prefix stay untouched, and every other page lands. (The
    adapter hands SGLang the value by the same function, rooms.decode_prefix_len.)"""
    session = rig.layerwise(group_size=1)
    src, dst = list(range(10, 22)), list(range(30, 42))
    claim_pending(rig, 9)
    batch = session.begin_batch(view(9, src, 0, 12, 12, pending_bootstrap=True))
    pool = rig.prefill.pool()
    for layer in range(arrive_after):
        session.on_layer(batch, pool, layer)
    rig.service.control.on_metadata(rig.decode_service.record_destination(
        bootstrap_room=9, required_dst_info_num=1, kv_indices=np.asarray(dst[decode_prefix:]), aux_index=1,
        state_indices=None, decode_prefix_len=decode_prefix, is_dummy=False))
    for layer in range(arrive_after, LAYERS):
        session.on_layer(batch, pool, layer)
    session.end_batch(batch)
    assert rig.metrics.late == 1
    (stream,) = batch.streams
    assert (stream.rng.tok_lo, stream.dst_slice) == (decode_prefix, slice(0, 12 - decode_prefix))
    # finalize_bootstrap: start_send_idx = decode_prefix; send() of the rest, index_slice from 0
    session.add_chunk(9, np.array(src[decode_prefix:]), slice(0, 12 - decode_prefix), True, aux_index=2)
    rig.wait_status(9, S.SUCCESS)
    assert_bytes(rig, src[decode_prefix:], dst[decode_prefix:])
    assert all(rig.decode.page(b, p) == bytes(256) for b in range(2 * LAYERS) for p in dst[:decode_prefix])


def test_a_later_pass_still_pending_joins_the_room_already_streaming(rig):
    """Chunked prefill: pass 1 joined late; pass 2 was built before SGLang finalized the request
    (still pending) and joins at its first hook; send() after finalize has only the aux left."""
    session = rig.layerwise(group_size=1)
    src, dst = list(range(40, 52)), list(range(50, 62))
    claim_pending(rig, 10)
    pool = rig.prefill.pool()
    b1 = session.begin_batch(view(10, src, 0, 6, 12, pending_bootstrap=True))
    session.on_layer(b1, pool, 0)
    destinations(rig, 10, dst)
    for layer in range(1, LAYERS):
        session.on_layer(b1, pool, layer)
    session.end_batch(b1)
    b2 = session.begin_batch(view(10, src, 6, 6, 12, pending_bootstrap=True))
    for layer in range(LAYERS):
        session.on_layer(b2, pool, layer)
    session.end_batch(b2)
    assert (rig.metrics.late, rig.metrics.fallbacks) == (2, [])
    assert [s.dst_slice for s in b1.streams + b2.streams] == [slice(0, 6), slice(6, 12)]
    finalize_and_send(rig, session, 10, src)
    rig.wait_status(10, S.SUCCESS)
    assert_bytes(rig, src, dst)


# Real page sizes and both pool kinds, through hooks.py's AROUND hooks (SGLang's Req carries
# `pending_bootstrap`): destinations arrive after layer 1 of 4; decode may hold a prefix.
LATE_CASES = [("mha", 16, 0), ("mha", 16, 32), ("mla", 64, 64), ("mla", 1, 0)]


@pytest.mark.parametrize("pool, page, decode_prefix", LATE_CASES)
def test_late_destinations_through_the_hooks_land_byte_exact(pool, page, decode_prefix, stub_sender_module):
    from types import SimpleNamespace

    from layerwise_rig import Geometry, LayerwiseRig
    from sglang_mori.backend.prefill.layerwise.session import ReqView

    tokens = 3 * 64 + 5
    geometry = Geometry(is_mla=pool == "mla", layers=LAYERS, page_size=page, pages=2 * (tokens // page + 1) + 2)
    with LayerwiseRig(geometry, group_size=1, via_hooks=True) as lw:
        (p,) = lw.prefills
        req = lw.request(21, tokens, decode_prefix=decode_prefix)
        lw.claim_pending(req)
        # SGLang leaves decode's prefix and start_send_idx at 0 until finalize_bootstrap
        pending = ReqView(room=21, prefix_len=0, extend_len=tokens, input_len=tokens, decode_prefix_len=0,
                          start_send_idx=0, row=req.row, pending_bootstrap=True)
        batch = lw.run_batch_through_hooks(p, [pending], range(LAYERS),
                                           after_layer=lambda layer: layer == 1 and lw.destinations(p, req, 0))
        lw.wait(lambda: batch.done.is_set(), "the worker finished the batch")
        assert p.metrics.late == 1 and p.metrics.fallbacks == []
        assert p.sglang.status(21) == S.WAITING_FOR_INPUT
        # finalize_bootstrap: start_send_idx = decode's prefix; then send() of the last chunk
        lw._send(p, req, SimpleNamespace(start_send=decode_prefix, curr_idx=0), tokens, True, 0)
        lw.wait_success(21)
        assert lw.mismatches(req) == []
        assert lw.write_counts_off(req) == []  # every page once, decode's prefix never
        assert lw.streamed_pages(p, req) == set(range(decode_prefix // page, tokens // page))
