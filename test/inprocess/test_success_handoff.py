"""Who decides a room's Success (prefill/success.py), on the in-process rig with layer-wise on.

Layer-wise streaming writes a room's pages during the forward, so SGLang's last `send()` often has
nothing left to write: that chunk is tracked on the scheduler's own thread and, when every
streamed write is done, Success goes out from there (no shard hop, no completion wake-up). These
tests pin which thread sent it, that it never goes out while a write of the room runs or an
earlier chunk of it still waits for its shard, and the bytes that landed.
"""

import threading
from types import SimpleNamespace

import numpy as np
import pytest

from sglang_mori import protocol
from sglang_mori.backend import room_status as S
from sglang_mori.backend.prefill.layerwise.planner import LayerwisePlanner
from sglang_mori.config import MoriConfig

from layerwise_rig import CountingMetrics
from rig import WAIT_S, PrefillRig
from test_layerwise import LAYERS, assert_bytes, forward, open_room, view


@pytest.fixture
def rig():
    with PrefillRig(MoriConfig(transfer_shards=1, transfer_timeout_ms=5000), buffers=2 * LAYERS,
                    planner_class=LayerwisePlanner) as r:
        r.metrics = r.parts.metrics = CountingMetrics()
        r.register()
        yield r


def successes(rig, room):
    return [m for m in rig.messenger.of_type(protocol.RoomStatus, room) if m.status == S.SUCCESS]


def success_senders(rig, room):
    """The threads that sent the room's Success, in order."""
    return [name for message, name in rig.messenger.threads
            if isinstance(message, protocol.RoomStatus) and message.room == room and message.status == S.SUCCESS]


def streamed_and_done(rig, room):
    """Every streamed write tracked and finished, the worker's batch token returned."""
    life = rig.service.p.rooms.get(room)
    rig.wait(lambda: life.writes and not life.submitting and not life.unfinished(),
             f"room {room}'s streamed writes done")
    return life


def test_a_last_send_with_nothing_left_succeeds_on_the_schedulers_thread(rig):
    session = rig.layerwise()
    src, dst = list(range(10, 18)), list(range(30, 38))
    open_room(rig, 1, dst)
    forward(session, rig, session.begin_batch(view(1, src, 0, 8, 8)))
    streamed_and_done(rig, 1)
    session.add_chunk(1, np.array(src), slice(0, 8), True, aux_index=2)
    # Decided inside send(): no shard thread, no completion thread in between.
    assert rig.sglang.status(1) == S.SUCCESS
    (done,) = successes(rig, 1)
    assert done.aux == [rig.prefill.aux[32:48].tobytes()]
    senders = [name for message, name in rig.messenger.threads if message is done]
    assert senders == [threading.current_thread().name]
    assert done in rig.messenger.nonblocking  # the scheduler never waits on a full send queue
    assert_bytes(rig, src, dst)


def test_the_last_send_waits_behind_an_earlier_chunk_still_queued_for_its_shard(rig):
    """Pass 1 went chunk-wise and its chunk still waits for the (held) shard; pass 2 streamed
    everything. The last send() must not conclude the room before pass 1's writes are tracked
    and done: it queues behind them."""
    session = rig.layerwise()
    src, dst = list(range(0, 8)), list(range(40, 48))
    open_room(rig, 2, dst)
    submitter = rig.service.submitter
    shard_may_go, real_submit = threading.Event(), submitter.submit

    def held_submit(chunk, **kw):
        assert shard_may_go.wait(WAIT_S)
        real_submit(chunk, **kw)

    submitter.submit = held_submit
    rig.service.add_chunk(2, np.array(src[:4]), slice(0, 4), False)  # pass 1, chunk-wise
    forward(session, rig, session.begin_batch(view(2, src, 4, 4, 8, start_send=4)))  # pass 2 streams
    life = rig.service.p.rooms.get(2)
    rig.wait(lambda: not life.submitting and not life.unfinished(), "pass 2's streamed writes done")
    session.add_chunk(2, np.array(src[4:]), slice(4, 8), True, aux_index=0)
    assert rig.sglang.status(2) == S.TRANSFERRING and not successes(rig, 2)
    assert life.queued == 2 and not life.last_submitted  # pass 1's chunk, then the last one behind it
    shard_may_go.set()
    rig.wait_status(2, S.SUCCESS)
    assert len(successes(rig, 2)) == 1
    assert_bytes(rig, src, dst)


def test_the_last_send_before_the_workers_batch_end_succeeds_once_the_worker_is_done(rig):
    """send() comes while the worker has not processed the batch's end marker (its token still
    held): not concluded there; Success once the worker returns the token, exactly once."""
    session = rig.layerwise()
    src, dst = list(range(20, 28)), list(range(50, 58))
    open_room(rig, 3, dst)
    worker = session.worker
    end_may_go, real_end = threading.Event(), worker._end

    def held_end(batch):
        assert end_may_go.wait(WAIT_S)
        real_end(batch)

    worker._end = held_end
    forward(session, rig, session.begin_batch(view(3, src, 0, 8, 8)))
    life = rig.service.p.rooms.get(3)
    rig.wait(lambda: len(life.writes) == LAYERS and not life.unfinished(), "every layer's write done")
    session.add_chunk(3, np.array(src), slice(0, 8), True, aux_index=0)
    assert life.last_submitted and life.submitting == 1  # tracked here; the worker's token remains
    assert rig.sglang.status(3) == S.TRANSFERRING and not successes(rig, 3)
    end_may_go.set()
    rig.wait_status(3, S.SUCCESS)
    assert len(successes(rig, 3)) == 1
    assert_bytes(rig, src, dst)


def sglang_send(session, room, kv_indices, total_pages, state_indices, aux_index):
    """SGLang 0.5.23's own `CommonKVSender.send` for one sender (its code, unbound, over a stand-in
    holding what it reads), reaching our manager's `add_transfer_request` with the arguments SGLang
    passes. For a last chunk `_send_kv_chunk` builds `state_indices = [payload() for each of
    kv_args.state_types]`: an empty list, not None, for a model without state (a plain Llama)."""
    import types

    from sglang.srt.disaggregation.common.conn import CommonKVSender

    from sglang_mori.backend.manager import MoriKVManager

    manager = SimpleNamespace(layerwise=session, cp=SimpleNamespace(skips_replicated_state=False),
                              kv_shard_size=1, enable_all_cp_ranks_for_transfer=False, is_dummy_cp_rank=False)
    manager.prepare_send_state_indices = types.MethodType(MoriKVManager.prepare_send_state_indices, manager)
    manager.add_transfer_request = types.MethodType(MoriKVManager.add_transfer_request, manager)
    sender = SimpleNamespace(conclude_state=None, curr_idx=0, num_kv_indices=total_pages, kv_mgr=manager,
                             bootstrap_room=room, aux_index=aux_index, _transfer_start_time=None,
                             _early_send_wait_event=None, trace_ctx=SimpleNamespace(copy_for_thread=lambda: None),
                             _transfer_num_kv_indices=0, _transfer_num_state_indices=0)
    for name in ("_prepare_send_indices", "_record_transfer_indices"):
        setattr(sender, name, types.MethodType(getattr(CommonKVSender, name), sender))
    CommonKVSender.send(sender, np.asarray(kv_indices, dtype=np.int32), state_indices, num_kv_tokens=len(kv_indices))


def test_sglangs_last_send_of_a_model_without_state_succeeds_on_the_schedulers_thread(rig):
    """SGLang's real call order for one 8-token room, layer-wise: the forward's layer hooks and
    its end marker, the worker done with the batch (its token back, every write terminal), then
    SGLang's own send() with the state list it builds for a model without state ([]). Every page
    was streamed: Success must leave from the scheduler's thread inside send(), not from a shard
    thread after an empty write or from the completion thread."""
    session = rig.layerwise()
    src, dst = list(range(40, 48)), list(range(0, 8))
    open_room(rig, 4, dst)
    forward(session, rig, session.begin_batch(view(4, src, 0, 8, 8)))
    streamed_and_done(rig, 4)
    sglang_send(session, 4, src, total_pages=8, state_indices=[], aux_index=1)
    inside_send = success_senders(rig, 4)
    rig.wait_status(4, S.SUCCESS)
    assert inside_send == [threading.current_thread().name], (
        f"not decided inside send(): decided later on {success_senders(rig, 4)}")
    assert not rig.messenger.of_type(protocol.TransferStarted, 4)[1:]  # announced once, by the stream
    assert_bytes(rig, src, dst)


@pytest.mark.parametrize("tokens, deciders", [
    (32, {"MainThread"}),  # whole pages: every page streamed, the last send() writes nothing
    # a trailing partial page is never streamed: the last send() writes it through a shard, and
    # the shard (write done while it posted) or the completion thread concludes
    (30, {"mori-shard-0", "mori-completion"}),
])
def test_through_sglangs_hooks_who_decides_a_chunked_prefills_success(tokens, deciders):
    """SGLang's order through hooks.py (run_batch around the forward, the attention hook per layer,
    the end marker), two passes, each pass's send() after its writes ended: the room is concluded
    inside the last send() exactly when that send has nothing left to write."""
    import sglang_mori.backend.sender  # noqa: F401 - the real class hooks.py recognises senders by

    from layerwise_rig import Geometry, LayerwiseRig

    geometry = Geometry(is_mla=False, layers=LAYERS, page_size=4, pages=24)
    with LayerwiseRig(geometry, config=MoriConfig(transfer_shards=1, transfer_timeout_ms=5000),
                      via_hooks=True) as lw:
        req = lw.request(5, tokens)
        lw.open(req, aux_index=0)
        lw.prefill_chunked(req, chunk_tokens=16)
        lw.wait_success(5)
        (prefill,) = lw.prefills
        senders = [name for message, name in prefill.messenger.threads
                   if isinstance(message, protocol.RoomStatus) and message.status == S.SUCCESS]
        assert len(senders) == 1 and senders[0] in deciders, senders
        assert lw.mismatches(req) == []
