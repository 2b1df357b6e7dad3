"""Decode's inbox with its arrival flag (arrival_flag.py, issue 28): the step thread's look at an
empty socket reads a flag poll(2) wrote, touching no socket; a message is read by the next look
after it arrives; none is lost, repeated, reordered or stranded when many senders race the flag's
re-arming; close() gets the thread out of poll(2)."""

from __future__ import annotations

import random
import struct
import threading
import time

import pytest
import zmq

from waiting import wait_until

WAIT_S = 10.0


@pytest.fixture
def flagged(monkeypatch):
    """A watched Inbox over a TCP PULL socket, its reading thread running (as decode's status
    thread), and a factory of PUSH sockets to it. The flag's tick is 60 s and the poller counts as
    active for 1 s: a message the flag failed to show would wait for the test's bound, not be
    rescued by a tick or taken by the thread from a stalled test poller."""
    from sglang_mori.backend import inbox as inbox_module

    monkeypatch.setattr(inbox_module, "POLLER_ACTIVE_S", 1.0)
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    got = []
    inbox = inbox_module.Inbox(pull, lambda frames, polled: got.append((frames, polled)), "test socket",
                               poller_backoff_s=60.0, watch_arrivals=True)
    assert inbox._flag is not None, "poll/eventfd/timerfd missing on this Linux"
    stop = threading.Event()

    def reader():
        while not stop.is_set():
            inbox.wait_and_drain(60_000)
        inbox.thread_done()

    thread = threading.Thread(target=reader, name="status-stand-in")
    thread.start()
    pushes = []

    def push():
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{port}")
        pushes.append(sock)
        return sock

    def armed():  # the poller is active and the thread waits in poll(2) with nothing shown
        inbox.drain_nowait()
        return inbox._flag.quiet()

    yield inbox, push, got, armed
    stop.set()
    inbox.close()
    thread.join(WAIT_S)
    assert not thread.is_alive()
    for sock in pushes + [pull]:
        sock.close(0)
    ctx.term()


def test_an_idle_look_reads_the_flag_and_touches_no_socket(flagged):
    inbox, push, got, armed = flagged
    sender = push()
    wait_until(armed, "the thread armed the flag", WAIT_S, interval_s=0.001)
    looks, peeks = inbox._look_seq, inbox._peeks
    real_get = inbox.sock.get
    try:
        inbox.sock.get = None  # any use of the socket would raise here
        assert [inbox.drain_nowait() for _ in range(1000)] == [0] * 1000
    finally:
        inbox.sock.get = real_get
    assert inbox._look_seq == looks and inbox._peeks == peeks + 1000
    # and a message that arrives is the next looks' to read, on the poller's thread
    sender.send_multipart([b"status", b"aux"])
    wait_until(lambda: inbox.drain_nowait() or got, "the poll read the message", WAIT_S, interval_s=0.0005)
    assert got == [([b"status", b"aux"], True)]
    assert (inbox.by_poller, inbox.by_thread) == (1, 0)
    wait_until(armed, "the flag armed again after the look", WAIT_S, interval_s=0.001)


def test_many_senders_racing_the_flag_lose_reorder_and_strand_nothing(flagged):
    """Eight senders, bursts at random moments, a poller looking at random intervals: every
    message is handled once, each sender's in order, and the last one without any tick or later
    arrival to rescue a message the flag did not show."""
    inbox, push, got, armed = flagged
    senders, per_sender = 8, 250
    sockets = [push() for _ in range(senders)]
    wait_until(armed, "the thread armed the flag", WAIT_S, interval_s=0.001)
    done = threading.Event()

    def poller():  # SGLang's step loop: a look per step, steps of random length
        rng = random.Random(1)
        end = time.monotonic() + 4 * WAIT_S
        while not done.is_set() and time.monotonic() < end:
            inbox.drain_nowait()
            if rng.random() < 0.5:
                time.sleep(rng.choice((0, 0.0001, 0.0005, 0.002)))

    def sender(i):
        rng = random.Random(100 + i)
        for seq in range(per_sender):
            sockets[i].send(struct.pack("<II", i, seq))
            if rng.random() < 0.1:
                time.sleep(rng.choice((0.0001, 0.001, 0.003)))

    threads = [threading.Thread(target=poller, name="scheduler-stand-in")]
    threads += [threading.Thread(target=sender, args=(i,), name=f"sender-{i}") for i in range(senders)]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: len(got) >= senders * per_sender, "every message handled", 3 * WAIT_S, interval_s=0.005)
    except AssertionError:
        raise AssertionError(f"{len(got)} handled; flag {list(inbox._flag.revents)}, looks {inbox._look_seq}/"
                             f"{inbox._look_done}, peeks {inbox._peeks}, poller alive {threads[0].is_alive()}, "
                             f"socket events {inbox.sock.get(zmq.EVENTS)}")
    finally:
        done.set()
        for t in threads:
            t.join(WAIT_S)
    seen = {}
    for frames, _ in got:
        i, seq = struct.unpack("<II", frames[0])
        seen.setdefault(i, []).append(seq)
    assert {i: seqs for i, seqs in seen.items()} == {i: list(range(per_sender)) for i in range(senders)}
    assert inbox.by_poller + inbox.by_thread == senders * per_sender
    assert inbox.by_poller > inbox.by_thread  # the poller read them, the thread at most a stalled few


def test_a_message_after_the_look_that_emptied_the_socket_is_shown_again(flagged):
    """The look that drains the socket leaves ZMQ's descriptor quiet; the next message must set
    the flag again (the thread armed after that look), however soon it comes."""
    inbox, push, got, armed = flagged
    sender = push()
    for n in range(1, 51):
        wait_until(armed, f"armed before message {n}", WAIT_S, interval_s=0.0002)
        sender.send(b"%d" % n)
        wait_until(lambda: inbox.drain_nowait() or len(got) == n, f"message {n} read", WAIT_S, interval_s=0.0002)
    assert [frames[0] for frames, _ in got] == [b"%d" % n for n in range(1, 51)]
    assert inbox.by_poller == 50


def test_close_gets_the_thread_out_of_its_wait_at_once(flagged):
    inbox, push, got, armed = flagged
    wait_until(armed, "the thread waiting in poll(2)", WAIT_S, interval_s=0.001)
    start = time.monotonic()
    inbox.close()  # returns once the thread is out of poll(2): the socket may be closed next
    assert time.monotonic() - start < 2.0  # not the 60 s tick
    assert inbox.drain_nowait() == 0 and not inbox._flag.quiet()


def test_after_the_thread_received_a_message_itself_the_next_one_still_sets_the_flag(monkeypatch):
    """ZMQ's descriptor signals an arrival only after a look found the socket empty; the thread's
    blocking receive (no poller active) ends with a message, not with such a look. Arming right
    after it, as a poller starts, left the next message unsignalled: never read by the poll."""
    from sglang_mori.backend import inbox as inbox_module

    monkeypatch.setattr(inbox_module, "POLLER_ACTIVE_S", 1.0)
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    for sock in (pull, push):
        sock.setsockopt(zmq.LINGER, 0)
    push.connect(f"tcp://127.0.0.1:{pull.bind_to_random_port('tcp://127.0.0.1')}")
    got = []
    inbox = inbox_module.Inbox(pull, lambda frames, polled: got.append((frames, polled)), "test socket",
                               poller_backoff_s=60.0, watch_arrivals=True)
    stop = threading.Event()
    thread = None
    try:
        assert inbox.wait_and_drain(1) == 0  # (makes its wake-up socket, whose connecting would signal)
        push.send(b"A")
        assert inbox.wait_and_drain(int(WAIT_S * 1000)) == 1  # no poller: the thread's receive takes it
        with inbox.lock:  # a poller's look finds the lock taken: the poller is active, read nothing
            assert inbox.drain_nowait() == 0

        def reader():
            while not stop.is_set():
                inbox.wait_and_drain(60_000)

        thread = threading.Thread(target=reader, name="status-stand-in")
        thread.start()
        wait_until(inbox._flag.quiet, "the thread armed the flag", WAIT_S, interval_s=0.001)
        push.send(b"B")
        wait_until(lambda: inbox.drain_nowait() or len(got) == 2, "the poll read B", 5.0, interval_s=0.001)
        assert [frames for frames, _ in got] == [[b"A"], [b"B"]]
    finally:
        stop.set()
        inbox.close()
        if thread is not None:
            thread.join(WAIT_S)
        push.close(0)
        pull.close(0)
        ctx.term()
