"""The messages SGLang's scheduler polls for are read by the scheduler's own poll (inbox.py, issue 27):
decode's destinations on prefill and prefill's Success on decode take effect inside `poll_inbox`,
with no thread of ours running; the reading thread and the poller share the socket without losing,
repeating or reordering a message; stale and bad messages read by the poller are handled as the
thread handles them."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import zmq

from sglang_mori import protocol
from sglang_mori.backend import room_status as S

from rig import AUX_BYTES, PrefillRig
from waiting import wait_until

WAIT_S = 10.0


@pytest.fixture
def sockets():
    """Two PULL sockets (prefill's control socket, decode's status socket) and a PUSH to each."""
    ctx = zmq.Context()
    made = []

    def pull():
        sock = ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(f"tcp://127.0.0.1:{port}")
        made.extend([sock, push])
        return sock, push

    yield pull
    for sock in made:
        sock.close(0)
    ctx.term()


def poll_until(service, predicate, what):
    """SGLang's scheduler loop, reduced to its polls: poll_inbox, then read the table."""
    def polled():
        service.poll_inbox()
        return predicate()
    return wait_until(polled, what, WAIT_S, interval_s=0.001)


def metadata_frames(rig, room, pages, aux_index=0):
    return protocol.encode(rig.decode_service.record_destination(
        bootstrap_room=room, required_dst_info_num=1, kv_indices=np.asarray(pages), aux_index=aux_index,
        state_indices=None, decode_prefix_len=None, is_dummy=False))


def test_destinations_reach_sglang_through_the_poll_with_no_control_thread(sockets):
    control, push = sockets()
    with PrefillRig(control_socket=control, start_threads=False) as rig:
        assert not rig.service.threads  # nothing of ours reads the socket but the poll
        rig.new_attempt(1)
        assert rig.claim(1) is None
        # Register and metadata back to back: handled in order, or the metadata names an unknown peer.
        push.send_multipart(protocol.encode(rig.decode_service.registration()))
        push.send_multipart(metadata_frames(rig, 1, [3, 4]))
        poll_until(rig.service, lambda: rig.sglang.status(1) == S.WAITING_FOR_INPUT, "room 1 published")
        assert list(rig.sglang.transfer_infos[1].values())[0].kv_indices.tolist() == [3, 4]
        assert (rig.service.inbox.by_poller, rig.service.inbox.by_thread) == (2, 0)
        assert rig.rejections == []


def test_bad_metadata_read_by_the_poll_fails_that_room_with_a_reason(sockets):
    control, push = sockets()
    with PrefillRig(control_socket=control, start_threads=False) as rig:
        push.send_multipart(protocol.encode(rig.decode_service.registration()))
        rig.new_attempt(2)
        assert rig.claim(2) is None
        message = rig.decode_service.record_destination(
            bootstrap_room=2, required_dst_info_num=1, kv_indices=np.asarray([1, 2]), aux_index=0,
            state_indices=None, decode_prefix_len=None, is_dummy=False)
        message.kv_indices = b"\x01\x02\x03"  # not a whole number of int32 page indices
        push.send_multipart([b"garbage"])  # undecodable: rejected, nothing else happens
        push.send_multipart(protocol.encode(message))
        poll_until(rig.service, lambda: rig.sglang.status(2) == S.FAILED, "room 2 failed")
        assert rig.sglang.failure_reason(2)
        assert len(rig.rejections) == 2
        assert rig.service.inbox.by_poller == 3


def test_poll_and_control_thread_share_the_socket_each_message_once_in_order(sockets):
    control, push = sockets()
    rooms = list(range(10, 70))
    with PrefillRig(control_socket=control) as rig:
        stop = threading.Event()

        def scheduler():  # polls as fast as SGLang's loop, bounded
            end = time.monotonic() + WAIT_S
            while not stop.is_set() and time.monotonic() < end:
                rig.service.poll_inbox()

        poller = threading.Thread(target=scheduler, name="scheduler-stand-in")
        poller.start()
        try:
            for room in rooms:
                rig.new_attempt(room)
                assert rig.claim(room) is None
            push.send_multipart(protocol.encode(rig.decode_service.registration()))
            for room in rooms:
                push.send_multipart(metadata_frames(rig, room, [room % 60, room % 60 + 1]))
            rig.wait(lambda: all(rig.sglang.status(r) == S.WAITING_FOR_INPUT for r in rooms), "every room published")
        finally:
            stop.set()
            poller.join(WAIT_S)
        inbox = rig.service.inbox
        assert inbox.by_poller + inbox.by_thread == len(rooms) + 1
        assert rig.rejections == []  # no replay, no metadata before its Register
        for room in rooms:
            assert list(rig.sglang.transfer_infos[room].values())[0].kv_indices.tolist() == [room % 60, room % 60 + 1]


def test_the_thread_wakes_for_a_message_after_the_poll_emptied_the_socket(sockets):
    """The reading thread waits on the socket's descriptor, which signals new arrivals only: a
    message sent after a poll took the earlier ones must still wake it, not its timeout."""
    control, push = sockets()
    with PrefillRig(control_socket=control, start_threads=False) as rig:
        inbox = rig.service.inbox
        push.send_multipart([b"first"])
        wait_until(lambda: inbox.drain_nowait(), "the poll took the first message", WAIT_S, interval_s=0.001)
        sent = threading.Timer(0.05, push.send_multipart, ([b"second"],))
        sent.start()
        start = time.monotonic()
        handled = 0
        for _ in range(20):  # the first call may return at once: the poll was just active
            handled += inbox.wait_and_drain(5000)
            if handled:
                break
        assert handled == 1
        assert time.monotonic() - start < 2.0  # woken by the arrival, not by the 5 s timeout
        sent.join()
        assert len(rig.rejections) == 2  # both read, both rejected as undecodable


def test_success_reaches_decode_through_the_poll_and_stale_attempts_are_dropped(sockets):
    status_sock, push = sockets()
    with PrefillRig(decode_socket=status_sock, start_threads=False) as rig:
        decode = rig.decode_service
        old = rig.new_attempt(5)
        decode.record_destination(bootstrap_room=5, required_dst_info_num=1, kv_indices=np.asarray([1]),
                                  aux_index=3, state_indices=None, decode_prefix_len=None, is_dummy=False)
        new = rig.new_attempt(5)  # retracted and bootstrapped again: the room's receiver is `new`
        assert new != old
        decode.record_destination(bootstrap_room=5, required_dst_info_num=1, kv_indices=np.asarray([1]),
                                  aux_index=3, state_indices=None, decode_prefix_len=None, is_dummy=False)
        aux = bytes(range(100, 100 + AUX_BYTES))
        push.send_multipart(protocol.encode(protocol.RoomStatus(room=5, attempt=old, status=S.SUCCESS,
                                                                prefill_rank=0, aux=[bytes(AUX_BYTES)])))
        push.send_multipart(protocol.encode(protocol.RoomStatus(room=5, attempt=new, status=S.SUCCESS,
                                                                prefill_rank=0, aux=[aux])))
        poll_until(decode, lambda: rig.decode_sglang.status(5) == S.SUCCESS, "room 5 succeeded")
        assert decode.stale_statuses == 1
        assert rig.decode.aux[3 * AUX_BYTES:4 * AUX_BYTES].tobytes() == aux
        assert (decode.inbox.by_poller, decode.inbox.by_thread) == (2, 0)


def test_a_closed_inbox_reads_nothing(sockets):
    control, push = sockets()
    rig = PrefillRig(control_socket=control, start_threads=False)
    with rig:
        push.send_multipart([b"x"])
    # stopped: the manager closes the socket next, and a late poll must not touch it
    assert rig.service.inbox.drain_nowait() == 0
    assert rig.service.inbox.wait_and_drain(1) == 0


def test_while_the_poll_is_active_the_thread_leaves_arrivals_to_it(sockets):
    """The control thread, waiting on the socket since a quiet spell, is woken when SGLang starts
    polling, and from then on stays off the socket: the destinations are read by the poll."""
    control, push = sockets()
    rooms = [3, 4, 5, 6, 7]
    with PrefillRig(control_socket=control) as rig:
        push.send_multipart(protocol.encode(rig.decode_service.registration()))
        rig.wait(lambda: rig.service.inbox.by_thread == 1, "the thread took the registration (no poller yet)")
        for room in rooms:
            rig.new_attempt(room)
            assert rig.claim(room) is None
            stop = threading.Event()
            polls = []

            def scheduler():  # SGLang's bootstrap queue polling the sender, bounded
                end = time.monotonic() + WAIT_S
                while not stop.is_set() and time.monotonic() < end:
                    rig.service.poll_inbox()
                    polls.append(rig.sglang.status(room))
                    time.sleep(0.0002)

            poller = threading.Thread(target=scheduler, name="scheduler-stand-in")
            poller.start()
            try:
                rig.wait(lambda: len(polls) > 20, "the poll running")
                push.send_multipart(metadata_frames(rig, room, [room, room + 1]))
                rig.wait(lambda: polls[-1] == S.WAITING_FOR_INPUT, f"the poll saw room {room} published")
            finally:
                stop.set()
                poller.join(WAIT_S)
        inbox = rig.service.inbox
        assert inbox.by_poller + inbox.by_thread == 1 + len(rooms)
        # The thread looks every POLLER_ACTIVE_S while the poll runs: on a machine that stalls the
        # poller that long it may take one; it never takes most.
        assert inbox.by_poller >= len(rooms) - 1


def test_replies_to_a_message_the_poll_read_never_block_the_scheduler(sockets):
    """An Abort read by SGLang's poll is answered (AbortAck) without waiting on a full queue: a
    decode that stopped reading must not stall the scheduler for the send timeout."""
    control, push = sockets()
    with PrefillRig(control_socket=control, start_threads=False) as rig:
        push.send_multipart(protocol.encode(rig.decode_service.registration()))
        rig.new_attempt(8)
        assert rig.claim(8) is None
        push.send_multipart(metadata_frames(rig, 8, [1, 2]))
        poll_until(rig.service, lambda: rig.sglang.status(8) == S.WAITING_FOR_INPUT, "room 8 published")
        push.send_multipart(protocol.encode(rig.decode_service.abort_message(8, generation=4)))
        poll_until(rig.service, lambda: rig.messenger.of_type(protocol.AbortAck, 8), "the AbortAck")
        assert [m.generation for m in rig.messenger.nonblocking if isinstance(m, protocol.AbortAck)] == [4]
        assert rig.sglang.status(8) == S.FAILED
        # the control thread's own transitions still block (the flag is per thread and message)
        assert rig.service.control._local.never_block is False


def manager_over(service, sglang, waits):
    """Our MoriKVManager's check_status over a service and fake SGLang tables (no __init__: no
    engine, no SGLang server), as SGLang's sender and receiver poll() call it."""
    from sglang_mori.backend.manager import MoriKVManager

    mgr = MoriKVManager.__new__(MoriKVManager)
    mgr.service, mgr.request_status = service, sglang.request_status
    mgr._staging_outstanding, mgr.defer_decode_allocation = {}, False
    mgr._inbox_waits = waits  # what __init__ sets for the role
    return mgr


def test_sglangs_own_polls_see_destinations_and_success_through_our_check_status(sockets):
    """SGLang 0.5.23's CommonKVSender / CommonKVReceiver poll code, unbound, over our manager's
    check_status: the sender's poll returns WaitingForInput and the receiver's Success in the
    poll after the message arrived, with no thread of ours running."""
    import types

    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.common.conn import CommonKVReceiver, CommonKVSender

    from sglang_mori.backend.manager import DECODE_INBOX_WAITS, PREFILL_INBOX_WAITS

    control, to_prefill = sockets()
    status_sock, to_decode = sockets()
    with PrefillRig(control_socket=control, decode_socket=status_sock, start_threads=False) as rig:
        prefill_mgr = manager_over(rig.service, rig.sglang, PREFILL_INBOX_WAITS)
        decode_mgr = manager_over(rig.decode_service, rig.decode_sglang, DECODE_INBOX_WAITS)
        sender = SimpleNamespace(conclude_state=None, bootstrap_room=9, kv_mgr=prefill_mgr, init_time=None)
        sender._check_bootstrap_timeout = types.MethodType(CommonKVSender._check_bootstrap_timeout, sender)
        receiver = SimpleNamespace(conclude_state=None, bootstrap_room=9, kv_mgr=decode_mgr, _prefill_wait_start=None)

        def sender_poll():
            return CommonKVSender._poll_with_status(sender, prefill_mgr.check_status)

        def receiver_poll():
            return CommonKVReceiver._poll(receiver)

        to_prefill.send_multipart(protocol.encode(rig.decode_service.registration()))
        attempt = rig.new_attempt(9)
        assert rig.claim(9) is None
        to_prefill.send_multipart(metadata_frames(rig, 9, [2, 3], aux_index=1))
        wait_until(lambda: sender_poll() == KVPoll.WaitingForInput, "SGLang's sender poll: WaitingForInput",
                   WAIT_S, interval_s=0.001)
        assert rig.service.inbox.by_poller == 2 and rig.service.inbox.by_thread == 0
        assert receiver_poll() == KVPoll.Bootstrapping
        aux = bytes(range(7, 7 + AUX_BYTES))
        to_decode.send_multipart(protocol.encode(protocol.RoomStatus(room=9, attempt=attempt, status=S.SUCCESS,
                                                                     prefill_rank=0, aux=[aux])))
        wait_until(lambda: receiver_poll() == KVPoll.Success, "SGLang's receiver poll: Success", WAIT_S,
                   interval_s=0.001)
        assert rig.decode.aux[AUX_BYTES:2 * AUX_BYTES].tobytes() == aux
        assert rig.decode_service.inbox.by_poller == 1 and rig.decode_service.inbox.by_thread == 0


def test_the_reading_threads_leave_no_socket_behind(sockets):
    """Each service's reading thread makes a wake-up socket; stopping the service closes it (a
    socket left open would hang the context's termination). The default: no arrival flag."""
    control, _ = sockets()
    status_sock, _ = sockets()
    with PrefillRig(control_socket=control, decode_socket=status_sock) as rig:
        inboxes = (rig.service.inbox, rig.decode_service.inbox)
        assert rig.decode_service.inbox._flag is None
        rig.wait(lambda: all(i._waker is not None for i in inboxes), "both threads waiting")
        wakers = [i._waker for i in inboxes]
    assert all(i._waker is None for i in inboxes)
    assert all(w.closed for w in wakers)


def test_with_the_arrival_flag_decode_waits_in_poll_and_closes_its_descriptors(sockets):
    """SGLANG_MORI_DECODE_ARRIVAL_FLAG=1: decode's thread waits in poll(2) and makes no wake-up
    socket; its eventfd and timerfd close with it. Prefill's thread is as without the flag."""
    from sglang_mori.config import MoriConfig

    control, _ = sockets()
    status_sock, _ = sockets()
    config = MoriConfig(transfer_shards=2, transfer_timeout_ms=5000, decode_arrival_flag=True)
    with PrefillRig(config=config, control_socket=control, decode_socket=status_sock) as rig:
        prefill, decode = rig.service.inbox, rig.decode_service.inbox
        rig.wait(lambda: prefill._waker is not None and decode._flag.quiet(), "both threads waiting")
        waker = prefill._waker
        assert decode._waker is None
    assert prefill._waker is None and waker.closed
    assert decode._flag.wake_fd == decode._flag.tick_fd == -1


def test_with_poll_reads_off_the_poll_leaves_the_socket_to_our_thread(sockets):
    """SGLANG_MORI_POLL_READS=0 (no statuses read the socket): check_status only reads the table."""
    from sglang_mori.config import MoriConfig

    assert MoriConfig.from_env({"SGLANG_MORI_POLL_READS": "0"}).poll_reads is False
    control, push = sockets()
    with PrefillRig(control_socket=control, start_threads=False) as rig:
        mgr = manager_over(rig.service, rig.sglang, ())
        push.send_multipart(protocol.encode(rig.decode_service.registration()))
        rig.new_attempt(11)
        assert rig.claim(11) is None
        push.send_multipart(metadata_frames(rig, 11, [1]))
        for _ in range(200):
            assert mgr.check_status(11) == S.BOOTSTRAPPING
            time.sleep(0.001)  # 0.2 s for the messages to arrive; the poll must not read them
        assert rig.service.inbox.by_poller == 0
        # still queued for the thread, in order (one message per wait: a Register, then its metadata)
        assert [rig.service.inbox.wait_and_drain(1000) for _ in range(2)] == [1, 1]
        assert rig.sglang.status(11) == S.WAITING_FOR_INPUT


@pytest.fixture(params=["off", "process"])
def plain_inbox(sockets, monkeypatch, request):
    """An Inbox over a bare PULL socket that records what it handles, and its PUSH; the poller
    counts as active for 1 s (not 5 ms), so a stalled test thread still counts as polling. Also
    with decode's watcher process (SGLANG_MORI_DECODE_ARRIVAL_FLAG=process), whose reading thread
    takes the same turns on the socket."""
    from sglang_mori.backend import inbox as inbox_module

    monkeypatch.setattr(inbox_module, "POLLER_ACTIVE_S", 1.0)
    pull, push = sockets()
    got = []
    box = inbox_module.Inbox(pull, lambda frames, polled: got.append((frames, polled)), "test socket",
                             watch_arrivals=request.param)
    assert (box._watcher is not None) == (request.param == "process")
    yield box, push, got
    box.close()


def test_a_poll_starting_wakes_the_thread_out_of_its_receive(plain_inbox):
    """The reading thread waits inside a blocking receive with the lock held; the first poll after
    a quiet spell must get it out (long before its 60 s receive timeout), so the message the poll
    waits for is read by the poll, not by the thread."""
    inbox, push, got = plain_inbox
    returned = []
    stop = threading.Event()

    def reader():
        while not stop.is_set():
            returned.append(inbox.wait_and_drain(60_000))
        inbox.thread_done()

    thread = threading.Thread(target=reader, name="reading-thread")
    thread.start()
    try:
        wait_until(lambda: inbox._waker is not None and inbox.lock.locked(), "the thread in its receive", WAIT_S)
        assert inbox.drain_nowait() == 0  # the lock is the thread's: this poll only wakes it
        wait_until(lambda: returned, "the thread out of its receive", WAIT_S, interval_s=0.001)
        assert returned[0] == 0  # woken by the token, which is no message
        push.send_multipart([b"for the poller"])
        poll_until(SimpleNamespace(poll_inbox=inbox.drain_nowait), lambda: got, "the poll read it")
        assert got == [([b"for the poller"], True)]
        assert (inbox.by_poller, inbox.by_thread) == (1, 0)
    finally:
        stop.set()
        inbox.close()
        thread.join(WAIT_S)
    assert not thread.is_alive()


def test_close_takes_the_thread_out_of_its_receive_at_once(plain_inbox):
    inbox, push, got = plain_inbox
    thread = threading.Thread(target=inbox.wait_and_drain, args=(60_000,), name="reading-thread")
    thread.start()
    wait_until(lambda: inbox._waker is not None and inbox.lock.locked(), "the thread in its receive", WAIT_S)
    start = time.monotonic()
    inbox.close()  # returns once the thread is out of the socket: it may be closed next
    assert time.monotonic() - start < WAIT_S
    thread.join(WAIT_S)
    assert not thread.is_alive()
    assert inbox._waker is None and got == []


def test_a_wake_up_token_read_by_the_poll_is_no_message(plain_inbox):
    """A poll with no thread in the socket reads its own wake-up token and drops it; a real
    message, even an empty frame, is handled."""
    inbox, push, got = plain_inbox
    assert inbox.wait_and_drain(1) == 0  # makes the wake-up socket, times out
    assert inbox.drain_nowait() == 0  # quiet spell over: sends the token, then reads and drops it
    assert got == []
    push.send_multipart([b""])
    poll_until(SimpleNamespace(poll_inbox=inbox.drain_nowait), lambda: got, "the empty frame")
    assert got == [([b""], True)]


def test_while_polled_the_reading_thread_looks_only_as_often_as_its_backoff(sockets, monkeypatch):
    """Each look of the reading thread is a wake-up that takes the GIL from the scheduler: while a
    poller is active, an inbox with a backoff (decode's: its deadline sweep interval) sleeps that
    long before it looks again, and a message that arrives meanwhile is the poll's."""
    from sglang_mori.backend import inbox as inbox_module

    monkeypatch.setattr(inbox_module, "POLLER_ACTIVE_S", 1.0)  # a stalled test still counts as polling
    pull, push = sockets()
    got = []
    inbox = inbox_module.Inbox(pull, lambda frames, polled: got.append((frames, polled)), "test socket",
                               poller_backoff_s=0.05)
    try:
        assert inbox.drain_nowait() == 0  # a poller is active from here
        push.send_multipart([b"for the poller"])
        start = time.monotonic()
        assert inbox.wait_and_drain(60_000) == 0  # off the socket for the backoff, not 60 s
        assert 0.04 <= time.monotonic() - start < 0.5  # not POLLER_ACTIVE_S (1 s here)
        assert got == []
        poll_until(SimpleNamespace(poll_inbox=inbox.drain_nowait), lambda: got, "the poll read it")
        assert got == [([b"for the poller"], True)]
    finally:
        inbox.close()


def test_decode_status_thread_backs_off_for_its_sweep_interval_while_polled(sockets):
    from sglang_mori.backend.decode.service import DecodeService
    from sglang_mori.config import MoriConfig

    pull, _ = sockets()
    parts = SimpleNamespace(config=MoriConfig(wait_poll_ms=80), control_socket=pull, rooms=None,
                            aux=SimpleNamespace(ptrs=[], item_lens=[], buffer_lens=[]))
    service = DecodeService(parts, reject=lambda *a: None)
    try:
        assert service.inbox.poller_backoff_s == pytest.approx(0.08)
    finally:
        service.inbox.close()
