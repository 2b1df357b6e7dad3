"""The per-peer byte budget (SGLANG_MORI_MAX_INFLIGHT_BYTES_PER_PEER, issue 29) on a real prefill
service and softio engines: writes past it are held, not posted; a held write whose room ends is
dropped without a byte sent; the next room's write goes out right behind what was really posted.

A posted write cannot be withdrawn, and a peer's writes share ordered lanes: without the budget an
aborted room's unsent chunks go out ahead of every later room (the seed-31 throttle of issue 29).
The lanes are stalled here (a link that stopped moving bytes) so that "posted" and "finished" are
apart; every wait is on the service's own state, never a sleep.
"""

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from sglang_mori.backend import room_status as S
from sglang_mori.config import MoriConfig
from sglang_mori.metrics import TransferMetrics

from rig import BUFFERS, PAGE_BYTES, PrefillRig
from stalled_lanes import FakeClock, open_room, record_posts, resume, stall

CHUNK_BYTES = PAGE_BYTES * BUFFERS  # one page of every buffer
BUDGET = 2 * CHUNK_BYTES  # two pages' writes may be in flight per peer


def _rig(budget=BUDGET, timeout_ms=30000, stall_ms=0):
    # Rooms 7 and 8 map to different shards (2 shards): a held write of one does not hold the other's queue.
    # stall_ms 0: the budget binds from the first byte (the default binds once the peer stalled).
    rig = PrefillRig(config=MoriConfig(transfer_shards=2, transfer_timeout_ms=timeout_ms,
                                       max_inflight_bytes_per_peer=budget, peer_stall_ms=stall_ms))
    rig.registry = CollectorRegistry()
    rig.parts.metrics = TransferMetrics("prefill", registry=rig.registry)
    return rig


def _metric(rig, name) -> float:
    return rig.registry.get_sample_value(name, rig.parts.metrics.labels) or 0.0


def _budget(rig):
    return rig.service.p.peers.budget


def test_held_chunks_of_an_aborted_room_are_dropped_and_the_next_room_goes_out_behind_what_was_posted():
    with _rig() as rig:
        rig.register()
        posted = record_posts(rig)
        budget = _budget(rig)
        stall(rig)
        try:
            open_room(rig, 7, pages=[40, 41, 42, 43, 44])
            rig.send(7, pages=[0, 1], last=False)  # posted: fills the budget
            rig.wait(lambda: posted == [2 * CHUNK_BYTES], "room 7's first chunk posted")
            rig.send(7, pages=[2, 3, 4], start=2, last=True)  # past the budget: held
            rig.wait(lambda: budget.holding == 1, "room 7's second chunk held")
            open_room(rig, 8, pages=[50])  # the retry of another request, to the same decode
            rig.send(8, pages=[5], last=True)
            # Behind it on the stalled-decodes shard: not yet at the budget, not posted.
            rig.wait(lambda: rig.service.submitter.stalled_queue.qsize() == 1, "room 8's chunk queued behind it")
            assert posted == [2 * CHUNK_BYTES] and budget.holding == 1

            rig.abort(7)  # decode gave up on room 7 (its deadline passed on the slow link)
            rig.wait(lambda: _metric(rig, "sglang_mori_dropped_bytes_total") == 3 * CHUNK_BYTES,
                     "room 7's held chunk dropped")
            rig.wait(lambda: budget.holding == 1, "room 8's chunk held in its turn")
            assert posted == [2 * CHUNK_BYTES], "a held chunk of an aborted room was posted"
            assert _metric(rig, "sglang_mori_dropped_bytes_total") == 3 * CHUNK_BYTES
            # Room 7's posted chunk may still land: its abort waits for it, room 8 waits behind it.
            assert rig.sglang.acks_sent == [] and rig.sglang.status(8) != S.SUCCESS
        finally:
            resume(rig)
        rig.wait_status(8, S.SUCCESS)
        assert posted == [2 * CHUNK_BYTES, CHUNK_BYTES]  # room 8 went out right after what was posted
        assert rig.decode.page(0, 50) == rig.prefill.page(0, 5)
        rig.wait(lambda: rig.sglang.acks_sent, "room 7's abort ACK once its posted chunk finished")
        assert [ack[0] for ack in rig.sglang.acks_sent] == [7]
        for b in range(BUFFERS):
            assert [rig.decode.page(b, p) == rig.prefill.page(b, p - 40) for p in (40, 41)] == [True, True]
            assert [rig.decode.page(b, p) for p in (42, 43, 44)] == [bytes(PAGE_BYTES)] * 3, (
                "bytes of room 7's dropped chunk reached decode")
        assert _metric(rig, "sglang_mori_held_bytes_total") == 4 * CHUNK_BYTES
        rig.clear(7), rig.clear(8)
        rig.wait_idle()
        assert budget.total_bytes() == 0 and budget.holding == 0


def test_a_room_succeeds_only_after_its_held_chunk_was_posted_and_finished():
    with _rig() as rig:
        rig.register()
        posted = record_posts(rig)
        budget = _budget(rig)
        stall(rig)
        try:
            open_room(rig, 7, pages=[40, 41, 42])
            rig.send(7, pages=[0, 1], last=False)
            rig.wait(lambda: posted == [2 * CHUNK_BYTES], "the first chunk posted")
            rig.send(7, pages=[2], start=2, last=True)
            rig.wait(lambda: budget.holding == 1, "the last chunk held")
            assert budget.posted_bytes(rig.decode.engine.key) == 2 * CHUNK_BYTES
            assert rig.sglang.status(7) == S.TRANSFERRING
        finally:
            resume(rig)
        rig.wait_status(7, S.SUCCESS)
        assert posted == [2 * CHUNK_BYTES, CHUNK_BYTES]
        for b in range(BUFFERS):
            for p in (40, 41, 42):
                assert rig.decode.page(b, p) == rig.prefill.page(b, p - 40)
        assert _metric(rig, "sglang_mori_held_bytes_total") == CHUNK_BYTES
        assert _metric(rig, "sglang_mori_dropped_bytes_total") == 0
        rig.clear(7)
        rig.wait_idle()


def test_a_held_chunk_past_its_deadline_fails_its_room_without_being_posted():
    with _rig(timeout_ms=1500) as rig:
        rig.register()
        posted = record_posts(rig)
        budget = _budget(rig)
        stall(rig)
        try:
            open_room(rig, 7, pages=[40, 41])
            rig.send(7, pages=[0, 1], last=True)
            rig.wait(lambda: posted == [2 * CHUNK_BYTES], "room 7 posted")
            open_room(rig, 8, pages=[50])
            rig.send(8, pages=[5], last=True)
            rig.wait_status(8, S.FAILED)
            reason = rig.sglang.failure_records[8]
            assert "SGLANG_MORI_MAX_INFLIGHT_BYTES_PER_PEER" in reason and "in flight" in reason, reason
            assert posted == [2 * CHUNK_BYTES]
            assert _metric(rig, "sglang_mori_dropped_bytes_total") == CHUNK_BYTES
            assert budget.holding == 0
        finally:
            resume(rig)
        rig.clear(7), rig.clear(8)
        rig.wait_idle()
        assert rig.decode.page(0, 50) == bytes(PAGE_BYTES)


@pytest.mark.parametrize("budget", [0, 64 * CHUNK_BYTES])
def test_without_a_binding_budget_nothing_is_held(budget):
    """0 (no byte bound) and a budget above the load post every chunk at once, as before the budget."""
    with _rig(budget=budget) as rig:
        rig.register()
        posted = record_posts(rig)
        stall(rig)
        try:
            open_room(rig, 7, pages=[40, 41, 42, 43, 44])
            rig.send(7, pages=[0, 1], last=False)
            rig.send(7, pages=[2, 3, 4], start=2, last=True)
            rig.wait(lambda: posted == [2 * CHUNK_BYTES, 3 * CHUNK_BYTES], "both chunks posted")
            assert _budget(rig).holding == 0
        finally:
            resume(rig)
        rig.wait_status(7, S.SUCCESS)
        assert _metric(rig, "sglang_mori_held_bytes_total") == 0
        rig.clear(7)
        rig.wait_idle()


def test_a_chunk_larger_than_the_budget_is_posted_alone():
    with _rig(budget=CHUNK_BYTES) as rig:
        rig.register()
        posted = record_posts(rig)
        open_room(rig, 7, pages=list(range(40, 48)))
        rig.send(7, pages=np.arange(8), last=True)
        rig.wait_status(7, S.SUCCESS)
        assert posted == [8 * CHUNK_BYTES]
        rig.clear(7)
        rig.wait_idle()


def test_a_held_layer_group_of_an_aborted_room_is_dropped():
    """Layer-wise streaming posts through the same step (ChunkSubmitter.post_tracked): a layer
    group past the budget is held on the layer-wise worker, and dropped when decode aborts."""
    from sglang_mori.backend.prefill.layerwise.planner import LayerwisePlanner
    from sglang_mori.backend.prefill.layerwise.session import BatchView, ReqView

    layers = 4
    group_bytes = 3 * 2 * PAGE_BYTES  # 3 pages of one layer's K and V
    config = MoriConfig(transfer_shards=2, transfer_timeout_ms=30000, max_inflight_bytes_per_peer=group_bytes,
                        peer_stall_ms=0)  # the budget binds from the first byte
    with PrefillRig(config, buffers=2 * layers, planner_class=LayerwisePlanner) as rig:
        rig.register()
        posted = record_posts(rig)
        budget = _budget(rig)
        session = rig.layerwise(group_size=1)
        open_room(rig, 9, pages=[50, 51, 52])
        stall(rig)
        try:
            batch = session.begin_batch(BatchView([ReqView(
                room=9, prefix_len=0, extend_len=3, input_len=3, decode_prefix_len=0, start_send_idx=0,
                row=np.asarray([1, 2, 3]))], page_size=1))
            pool = rig.prefill.pool()
            session.on_layer(batch, pool, 0)
            rig.wait(lambda: posted == [group_bytes], "layer 0 posted")
            session.on_layer(batch, pool, 1)
            rig.wait(lambda: budget.holding == 1, "layer 1 held")
            rig.abort(9, generation=5)
            for layer in (2, 3):
                session.on_layer(batch, pool, layer)
            session.end_batch(batch)
            rig.wait(lambda: batch.done.is_set(), "the worker finished the batch")
            assert posted == [group_bytes] and budget.holding == 0
            assert rig.sglang.acks_sent == []  # layer 0's write may still land
        finally:
            resume(rig)
        rig.wait(lambda: rig.sglang.acks_sent, "the held ACK, once layer 0's write drained")
        for layer in range(1, layers):
            for buffer in (layer, layers + layer):
                assert [rig.decode.page(buffer, p) for p in (50, 51, 52)] == [bytes(PAGE_BYTES)] * 3
        assert rig.decode.page(0, 50) == rig.prefill.page(0, 1)


def test_the_budget_binds_only_once_the_peer_stopped_finishing_writes():
    """Default course (SGLANG_MORI_PEER_STALL_MS): while the peer finishes writes, a chunk past the
    budget is posted at once (a healthy link keeps its pipelining depth); once nothing finished for
    the stall window, the next chunk is held, and it goes out when writes finish again."""
    with _rig(stall_ms=500) as rig:
        rig.register()
        posted = record_posts(rig)
        budget = _budget(rig)
        clock = FakeClock()
        budget.use_clock(clock)
        stall(rig)
        try:
            open_room(rig, 7, pages=[40, 41, 42, 43, 44])
            rig.send(7, pages=[0, 1], last=False)  # fills the budget
            rig.wait(lambda: posted == [2 * CHUNK_BYTES], "room 7's first chunk posted")
            clock.now += 0.1  # within the window: the peer is not known to be stalled
            rig.send(7, pages=[2, 3, 4], start=2, last=True)
            rig.wait(lambda: posted == [2 * CHUNK_BYTES, 3 * CHUNK_BYTES], "room 7's second chunk posted past the budget")
            assert budget.holding == 0 and not budget.stalled(rig.decode.engine.key)
            clock.now += 0.5  # nothing finished for the window: stalled
            assert budget.stalled(rig.decode.engine.key)
            open_room(rig, 8, pages=[50])
            rig.send(8, pages=[5], last=True)
            rig.wait(lambda: budget.holding == 1, "room 8's chunk held toward the stalled peer")
            assert posted == [2 * CHUNK_BYTES, 3 * CHUNK_BYTES]
        finally:
            resume(rig)
        rig.wait_status(8, S.SUCCESS)  # writes finished: progress, and the held chunk went out
        assert posted == [2 * CHUNK_BYTES, 3 * CHUNK_BYTES, CHUNK_BYTES]
        rig.wait_status(7, S.SUCCESS)
        assert rig.decode.page(0, 50) == rig.prefill.page(0, 5)
        assert _metric(rig, "sglang_mori_held_bytes_total") == CHUNK_BYTES
        assert _metric(rig, "sglang_mori_dropped_bytes_total") == 0
        rig.clear(7), rig.clear(8)
        rig.wait_idle()
        assert budget.total_bytes() == 0 and budget.holding == 0
