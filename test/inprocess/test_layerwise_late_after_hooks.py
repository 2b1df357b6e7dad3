"""Optimistic requests joining the layer-wise stream *after* the forward's layer hooks (late.py).

On a GPU the hooks run while the scheduler launches the forward, milliseconds before the device
runs it; destinations that arrive while the device computes can only join after the hooks. Here
the hooks' calls are made as hooks.py makes them, with stand-in device events (each layer its
own), and decode's destinations arrive after `end_batch`: the request joins when they are
published to SGLang, every group already fired is caught up against the event it was posted with,
and `send()` moves only what was not streamed. Real softio engines and service threads.

Layout: 4 layers MHA (8 KV buffers: K0..K3, V0..V3), page size 1, 256 bytes per page.
"""

import threading

import pytest

import sglang_mori.softio.faults as faults
from sglang_mori import protocol
from sglang_mori.backend import room_status as S
from sglang_mori.backend.prefill.layerwise.session import BatchView, ReqView
from sglang_mori.softio.write_log import enable_write_log, get_write_log

from test_layerwise import LAYERS, assert_bytes, rig, view  # noqa: F401 (rig: a fixture)
from test_layerwise_late_destinations import assert_written_once, claim_pending, destinations, finalize_and_send
from test_layerwise_layouts import stub_sender_module  # noqa: F401 (a fixture)

WAIT_S = 20.0


class FakeEvent:
    """What hooks.py records after a layer on a GPU: the worker synchronizes on it before posting.
    `gate`: synchronize() blocks until it is set (a layer the device has not finished)."""

    def __init__(self, name: str, gate: threading.Event = None):
        self.name, self.gate = name, gate

    def synchronize(self) -> None:
        if self.gate is not None:
            assert self.gate.wait(WAIT_S), f"{self.name} never released"

    def __repr__(self):
        return self.name


def record_submits(session):
    """Every group the worker posts: (room, buffers, event, writes tracked)."""
    calls = []
    original = session.worker.submit

    def submit(stream, buffers, event):
        tracked = original(stream, buffers, event)
        calls.append((stream.room, buffers, event, tracked))
        return tracked

    session.worker.submit = submit
    return calls


def run_hooks(session, rig, batch, events, layers=range(LAYERS)):
    pool = rig.prefill.pool()
    for layer in layers:
        session.on_layer(batch, pool, layer, events[layer])


def posted(calls, room):
    return [(buffers, event) for r, buffers, event, _ in calls if r == room]


@pytest.mark.parametrize("group_size", [1, 0])
def test_destinations_after_the_hooks_join_each_group_against_its_own_event(rig, group_size):
    session = rig.layerwise(group_size=group_size)
    enable_write_log(rig.decode.engine.engine)
    calls = record_submits(session)
    events = [FakeEvent(f"layer{i}") for i in range(LAYERS)]
    src, dst = list(range(10, 18)), list(range(30, 38))
    claim_pending(rig, 1)
    batch = session.begin_batch(view(1, src, 0, 8, 8, pending_bootstrap=True))
    run_hooks(session, rig, batch, events)
    session.end_batch(batch)
    rig.wait(lambda: batch.done.is_set(), "the worker finished the batch")
    assert calls == [] and rig.metrics.fallbacks == [] and rig.metrics.late == 0
    key = rig.decode.engine.key
    faults.stall_lane(rig.prefill.engine.engine, 0, key)
    faults.stall_lane(rig.prefill.engine.engine, 1, key)
    try:
        destinations(rig, 1, dst)  # published to SGLang: the request joins at once
        assert rig.metrics.late == 1 and rig.metrics.late_after_hooks == 1
        groups = list(batch.groups)
        assert len(groups) >= 2 and all(e is not None for _, e in groups)
        rig.wait(lambda: len(posted(calls, 1)) == len(groups), "every catch-up write posted")
        assert posted(calls, 1) == groups  # each fired group with the event it was posted with
        # SGLang still holds it as pending: its poll reads WaitingForInput until finalize_bootstrap
        assert rig.sglang.status(1) == S.WAITING_FOR_INPUT
        record = session.records[1]
        assert [(s.page_lo, s.page_hi, s.buffers) for s in record.coverage.segments] == [
            (0, 8, frozenset(range(2 * LAYERS)))]
        finalize_and_send(rig, session, 1, src)  # nothing left but the aux data
        life = rig.service.p.rooms.get(1)
        rig.wait(lambda: life.last_submitted and life.submitting == 0, "send()'s last chunk tracked")
        assert rig.sglang.status(1) != S.SUCCESS  # the catch-up writes are still on the wire
    finally:
        faults.resume_lane(rig.prefill.engine.engine, None, key)
    rig.wait_status(1, S.SUCCESS)
    assert_bytes(rig, src, dst)
    assert_written_once(rig, dst)
    assert rig.metrics.fallbacks == []
    rig.clear(1)
    rig.wait_idle()


def test_two_requests_one_joins_during_the_hooks_one_after(rig):
    """Room 5's destinations arrive after layer 1's hook (it joins when they are published, the
    forward still launching), room 6's after end_batch: each gets every group exactly once,
    each with its own event."""
    session = rig.layerwise(group_size=1)
    enable_write_log(rig.decode.engine.engine)
    calls = record_submits(session)
    events = [FakeEvent(f"layer{i}") for i in range(LAYERS)]
    src5, dst5, src6, dst6 = [1, 2, 3], [40, 41, 42], [4, 5, 6, 7], [43, 44, 45, 46]
    claim_pending(rig, 5)
    claim_pending(rig, 6)
    batch = session.begin_batch(BatchView([
        ReqView(room=5, prefix_len=0, extend_len=3, input_len=3, decode_prefix_len=0, start_send_idx=0,
                row=src5, pending_bootstrap=True),
        ReqView(room=6, prefix_len=0, extend_len=4, input_len=4, decode_prefix_len=0, start_send_idx=0,
                row=src6, pending_bootstrap=True)], page_size=1))
    run_hooks(session, rig, batch, events, layers=range(2))
    destinations(rig, 5, dst5)
    assert rig.metrics.late == 1 and rig.metrics.late_after_hooks == 0
    run_hooks(session, rig, batch, events, layers=range(2, LAYERS))
    session.end_batch(batch)
    rig.wait(lambda: batch.done.is_set(), "the worker finished the batch")
    assert posted(calls, 6) == []
    destinations(rig, 6, dst6)
    assert rig.metrics.late == 2 and rig.metrics.late_after_hooks == 1
    groups = list(batch.groups)
    assert [e for _, e in groups] == events
    rig.wait(lambda: len(posted(calls, 6)) == LAYERS, "room 6's catch-up writes")
    assert posted(calls, 5) == groups and posted(calls, 6) == groups
    finalize_and_send(rig, session, 5, src5)
    finalize_and_send(rig, session, 6, src6)
    rig.wait_status(5, S.SUCCESS)
    rig.wait_status(6, S.SUCCESS)
    assert_bytes(rig, src5, dst5)
    assert_bytes(rig, src6, dst6)
    assert_written_once(rig, dst5 + dst6)
    assert rig.metrics.fallbacks == []


def test_abort_between_the_batch_end_and_the_destinations_posts_nothing(rig):
    session = rig.layerwise(group_size=1)
    enable_write_log(rig.decode.engine.engine)
    calls = record_submits(session)
    claim_pending(rig, 3)
    batch = session.begin_batch(view(3, [1, 2], 0, 2, 2, pending_bootstrap=True))
    run_hooks(session, rig, batch, [FakeEvent(f"layer{i}") for i in range(LAYERS)])
    session.end_batch(batch)
    rig.wait(lambda: batch.done.is_set(), "the worker finished the batch")
    rig.abort(3, generation=4)  # decode gave up before its destinations were sent
    assert rig.sglang.status(3) == S.FAILED
    assert rig.messenger.of_type(protocol.AbortAck, 3)  # no write can land: decode's pages go back at once
    session.late.published(3)  # a publication racing the abort finds the room concluded
    assert calls == [] and rig.metrics.late == 0
    # The next batch forgets it, counted once.
    claim_pending(rig, 9)
    session.begin_batch(view(9, [5, 6], 0, 2, 2, pending_bootstrap=True))
    assert 3 not in session.late.rooms and rig.metrics.fallbacks == ["pending_bootstrap"]
    assert calls == [] and get_write_log(rig.decode.engine.engine) == []


def test_abort_during_the_catch_up_posts_no_later_group(rig):
    """The worker waits on layer 1's event (the device has not finished it) when decode aborts:
    layers 2 and 3, not begun yet, are never posted, and decode's pages stay held until the
    writes already posted drained."""
    session = rig.layerwise(group_size=1)
    calls = record_submits(session)
    gate = threading.Event()
    events = [FakeEvent("layer0"), FakeEvent("layer1", gate), FakeEvent("layer2"), FakeEvent("layer3")]
    src, dst = [1, 2, 3], [50, 51, 52]
    claim_pending(rig, 7)
    batch = session.begin_batch(view(7, src, 0, 3, 3, pending_bootstrap=True))
    run_hooks(session, rig, batch, events)
    session.end_batch(batch)
    rig.wait(lambda: batch.done.is_set(), "the worker finished the batch")
    destinations(rig, 7, dst)
    rig.wait(lambda: len(calls) == 1, "layer 0's catch-up posted, the worker waiting on layer 1")
    rig.abort(7, generation=6)
    assert rig.sglang.status(7) == S.FAILED
    gate.set()
    rig.wait(lambda: len(calls) == LAYERS, "the worker went through every catch-up item")
    assert [tracked for _, _, _, tracked in calls] == [1, 1, 0, 0]  # nothing posted after the abort
    life = rig.service.p.rooms.get(7) or rig.service.p.rooms.draining_lives(7)[0]
    rig.wait(lambda: life.layerwise.pending_batches == 0, "the late stream's end marker")
    rig.wait(lambda: rig.sglang.acks_sent, "the held ACK, once the posted writes drained")
    assert rig.decode.page(2, 52) == bytes(256) and rig.decode.page(LAYERS + 3, 52) == bytes(256)


def test_a_middle_chunk_stops_waiting_at_the_batch_end(rig):
    """A pass that does not complete its request: SGLang may release and requeue the request after
    it without looking at the status, so it goes chunk-wise from the batch's end, counted once."""
    session = rig.layerwise(group_size=1)
    enable_write_log(rig.decode.engine.engine)
    calls = record_submits(session)
    src, dst = list(range(40, 52)), list(range(50, 62))
    claim_pending(rig, 11)
    batch = session.begin_batch(view(11, src, 0, 6, 12, pending_bootstrap=True))
    run_hooks(session, rig, batch, [None] * LAYERS)
    session.end_batch(batch)
    assert rig.metrics.fallbacks == ["pending_bootstrap"] and 11 not in session.late.rooms
    destinations(rig, 11, dst)
    b2 = session.begin_batch(view(11, src, 6, 6, 12))  # finalized: the last pass streams as usual
    run_hooks(session, rig, b2, [None] * LAYERS)
    session.end_batch(b2)
    finalize_and_send(rig, session, 11, src)
    rig.wait_status(11, S.SUCCESS)
    assert posted(calls, 11) and all(buffers for buffers, _ in posted(calls, 11))
    assert rig.metrics.late == 0 and rig.metrics.fallbacks == ["pending_bootstrap"]
    assert_bytes(rig, src, dst)
    assert_written_once(rig, dst)


# Real page sizes and both pool kinds, through hooks.py's AROUND hooks: the destinations arrive
# after run_batch returned; decode may hold a prefix.
AFTER_CASES = [("mha", 16, 0), ("mha", 16, 32), ("mla", 64, 64), ("mla", 1, 0)]


@pytest.mark.parametrize("pool, page, decode_prefix", AFTER_CASES)
def test_destinations_after_run_batch_through_the_hooks_land_byte_exact(pool, page, decode_prefix,
                                                                        stub_sender_module):  # noqa: F811
    from types import SimpleNamespace

    from layerwise_rig import Geometry, LayerwiseRig

    tokens = 3 * 64 + 5
    geometry = Geometry(is_mla=pool == "mla", layers=LAYERS, page_size=page, pages=2 * (tokens // page + 1) + 2)
    with LayerwiseRig(geometry, group_size=1, via_hooks=True) as lw:
        (p,) = lw.prefills
        req = lw.request(22, tokens, decode_prefix=decode_prefix)
        lw.claim_pending(req)
        pending = ReqView(room=22, prefix_len=0, extend_len=tokens, input_len=tokens, decode_prefix_len=0,
                          start_send_idx=0, row=req.row, pending_bootstrap=True)
        batch = lw.run_batch_through_hooks(p, [pending], range(LAYERS))
        lw.wait(lambda: batch.done.is_set(), "the worker finished the batch")
        assert p.metrics.late == 0 and p.metrics.fallbacks == [] and p.metrics.layerwise == 0
        lw.destinations(p, req, 0)
        assert (p.metrics.late, p.metrics.late_after_hooks) == (1, 1)
        assert p.sglang.status(22) == S.WAITING_FOR_INPUT
        lw._send(p, req, SimpleNamespace(start_send=decode_prefix, curr_idx=0), tokens, True, 0)
        lw.wait_success(22)
        assert p.metrics.layerwise == 1  # CPU: no device events, the catch-up is one write
        assert lw.mismatches(req) == []
        assert lw.write_counts_off(req) == []  # every page once, decode's prefix never
        assert lw.streamed_pages(p, req) == set(range(decode_prefix // page, tokens // page))
        assert p.metrics.fallbacks == []


def test_an_end_batch_that_raises_leaves_no_request_waiting(rig, monkeypatch):
    """end_batch failed before recording the batch's end: its waiting request goes chunk-wise
    (counted once) and a later publication posts nothing for it (it would never get its end)."""
    session = rig.layerwise(group_size=1)
    enable_write_log(rig.decode.engine.engine)
    calls = record_submits(session)
    src, dst = [1, 2], [3, 4]
    claim_pending(rig, 12)
    batch = session.begin_batch(view(12, src, 0, 2, 2, pending_bootstrap=True))
    run_hooks(session, rig, batch, [None] * LAYERS)

    def boom(*args):
        raise RuntimeError("end_batch failed")

    monkeypatch.setattr(session.late, "at_end", boom)
    with pytest.raises(RuntimeError):
        session.end_batch(batch)
    rig.wait(lambda: batch.done.is_set(), "the worker finished the batch")
    assert rig.metrics.fallbacks == ["pending_bootstrap"] and 12 not in session.late.rooms
    destinations(rig, 12, dst)
    finalize_and_send(rig, session, 12, src)
    rig.wait_status(12, S.SUCCESS)
    assert calls == [] and rig.metrics.late == 0 and rig.metrics.fallbacks == ["pending_bootstrap"]
    assert_bytes(rig, src, dst)
    assert_written_once(rig, dst)


def requeue_through_the_hook(session, room):
    """SGLang's optimistic_release_and_requeue through hooks.py's AROUND hook: True once the
    original ran (it releases the request's pages)."""
    from types import SimpleNamespace

    from sglang_mori.backend.prefill.layerwise import hooks

    scheduler = SimpleNamespace(disagg_prefill_bootstrap_queue=SimpleNamespace(
        kv_manager=SimpleNamespace(layerwise=session)))
    ran = []
    hooks.around_requeue(lambda scheduler, req: ran.append(req), scheduler, SimpleNamespace(bootstrap_room=room))
    return ran != []


def test_a_request_requeued_before_its_destinations_never_joins(rig):
    """SGLang read Bootstrapping and releases the parked request's pages: the destinations
    published after that must not start writes from them."""
    session = rig.layerwise(group_size=1)
    calls = record_submits(session)
    claim_pending(rig, 13)
    batch = session.begin_batch(view(13, [1, 2], 0, 2, 2, pending_bootstrap=True))
    run_hooks(session, rig, batch, [None] * LAYERS)
    session.end_batch(batch)
    assert requeue_through_the_hook(session, 13)
    assert rig.metrics.fallbacks == ["pending_bootstrap"] and 13 not in session.late.rooms
    assert session.hazards == []  # nothing of it was written
    destinations(rig, 13, [3, 4])
    rig.wait(lambda: batch.done.is_set(), "the worker finished the batch")
    assert calls == [] and rig.metrics.late == 0


def test_a_request_requeued_after_it_joined_holds_the_next_forward_until_its_writes_end(rig):
    """The publication won the race with SGLang's requeue (its poll had read Bootstrapping): the
    joined writes read pages SGLang now releases, so the next forward (the only thing that could
    rewrite them) waits until they are terminal."""
    session = rig.layerwise(group_size=1)
    key = rig.decode.engine.key
    src, dst = [5, 6, 7], [8, 9, 10]
    claim_pending(rig, 14)
    batch = session.begin_batch(view(14, src, 0, 3, 3, pending_bootstrap=True))
    run_hooks(session, rig, batch, [None] * LAYERS)
    session.end_batch(batch)
    faults.stall_lane(rig.prefill.engine.engine, 0, key)
    faults.stall_lane(rig.prefill.engine.engine, 1, key)
    released = threading.Event()
    try:
        destinations(rig, 14, dst)
        assert rig.metrics.late_after_hooks == 1
        assert requeue_through_the_hook(session, 14)
        assert [r.life.room for r in session.hazards] == [14]
        waiter = threading.Thread(target=lambda: (session.wait_hazards(), released.set()), daemon=True)
        waiter.start()
        assert not released.wait(0.3)  # the next forward waits for the writes on the wire
    finally:
        faults.resume_lane(rig.prefill.engine.engine, None, key)
    assert released.wait(WAIT_S)
    waiter.join(WAIT_S)
    assert rig.metrics.fallbacks == []


class DoneEvent(FakeEvent):
    """A layer the device has finished: query() says so without waiting."""

    def query(self) -> bool:
        return True


def test_catch_up_merges_the_groups_the_device_finished():
    """Layers 0-1 finished on the device when the request joins: one write for them (against
    layer 1's completed event), then layers 2 and 3 each against its own event."""
    from sglang_mori.backend.prefill.layerwise.late import catch_up

    events = [DoneEvent("layer0"), DoneEvent("layer1"), FakeEvent("layer2"), FakeEvent("layer3")]
    groups = [(frozenset({i, LAYERS + i}), e) for i, e in enumerate(events)]
    assert catch_up(groups) == [(frozenset({0, 1, LAYERS, LAYERS + 1}), events[1]), groups[2], groups[3]]
    assert catch_up([(g, None) for g, _ in groups]) == [(frozenset(range(2 * LAYERS)), None)]
    assert catch_up(groups[2:]) == groups[2:]
