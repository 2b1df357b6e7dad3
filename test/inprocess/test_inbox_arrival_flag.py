"""Decode's inbox with its arrival flag (arrival_flag.py, issue 28): the step thread's look at an
empty socket reads a flag poll(2) wrote, touching no socket; a message is read by the next look
after it arrives (or by the woken thread, whichever is first); none is lost, repeated, reordered
or stranded when many senders race the flag's re-arming; close() gets the thread out of poll(2)."""

from __future__ import annotations

import threading
import time

import pytest
import zmq

from racing_senders import race
from waiting import wait_until
from zmq_pair import pull_push

WAIT_S = 10.0


@pytest.fixture
def flagged():
    """A watched Inbox over a TCP PULL socket, its reading thread running (as decode's status
    thread), and a factory of PUSH sockets to it. The flag's tick is 60 s: a message that poll(2)
    failed to show would wait for the test's bound, not be rescued by a tick."""
    from sglang_mori.backend import inbox as inbox_module

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

    def armed():  # the thread waits in poll(2) with nothing shown
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
    sender.send(b"connected")  # (the connection's attachment signals too: over before the idle looks)
    wait_until(lambda: got, "the first message read", WAIT_S, interval_s=0.001)
    got.clear()
    wait_until(armed, "the thread armed the flag", WAIT_S, interval_s=0.001)
    real_get = inbox.sock.get
    try:
        inbox.sock.get = None  # any use of the socket would raise here
        assert [inbox.drain_nowait() for _ in range(1000)] == [0] * 1000
    finally:
        inbox.sock.get = real_get
    # and a message that arrives is read whole, once, by the poll or the woken thread
    sender.send_multipart([b"status", b"aux"])
    wait_until(lambda: inbox.drain_nowait() or got, "the message read", WAIT_S, interval_s=0.0005)
    assert [frames for frames, _ in got] == [[b"status", b"aux"]]
    assert inbox.by_poller + inbox.by_thread == 2
    wait_until(armed, "the flag armed again", WAIT_S, interval_s=0.001)


def test_with_no_poller_the_woken_thread_reads_each_message(flagged):
    inbox, push, got, armed = flagged
    sender = push()
    for n in range(1, 21):
        sender.send(b"%d" % n)
        wait_until(lambda: len(got) == n, f"message {n} read by the thread", WAIT_S, interval_s=0.0005)
    assert got == [([b"%d" % n], False) for n in range(1, 21)]
    assert (inbox.by_poller, inbox.by_thread) == (0, 20)


def test_many_senders_racing_the_flag_lose_reorder_and_strand_nothing(flagged):
    """Eight senders, bursts at random moments, a poller looking at random intervals: every
    message is handled once, each sender's in order, the last ones with no tick or later arrival
    to rescue a message that poll(2) did not show."""
    inbox, push, got, armed = flagged
    senders, per_sender = 8, 250
    sockets = [push() for _ in range(senders)]
    wait_until(armed, "the thread armed the flag", WAIT_S, interval_s=0.001)

    def step(rng):  # SGLang's step loop: a look per step, steps of random length
        if rng.random() < 0.5:
            time.sleep(rng.choice((0, 0.0001, 0.0005, 0.002)))

    race(sockets, inbox.drain_nowait, got, step, per_sender, WAIT_S,
         describe=lambda: f"flag {list(inbox._flag.revents)}, socket events {inbox.sock.get(zmq.EVENTS)}")
    assert inbox.by_poller + inbox.by_thread == senders * per_sender


def test_a_message_after_the_look_that_emptied_the_socket_is_shown_again(flagged):
    """The look that drains the socket leaves ZMQ's descriptor quiet; the next message must set
    the flag again (the thread arms after that look), however soon it comes."""
    inbox, push, got, armed = flagged
    sender = push()
    for n in range(1, 51):
        wait_until(armed, f"armed before message {n}", WAIT_S, interval_s=0.0002)
        sender.send(b"%d" % n)
        wait_until(lambda: inbox.drain_nowait() or len(got) == n, f"message {n} read", WAIT_S, interval_s=0.0002)
    assert [frames[0] for frames, _ in got] == [b"%d" % n for n in range(1, 51)]
    assert inbox.by_poller + inbox.by_thread == 50


def test_close_gets_the_thread_out_of_its_wait_at_once(flagged):
    inbox, push, got, armed = flagged
    wait_until(armed, "the thread waiting in poll(2)", WAIT_S, interval_s=0.001)
    start = time.monotonic()
    inbox.close()  # returns once the thread is out of poll(2): the socket may be closed next
    assert time.monotonic() - start < 2.0  # not the 60 s tick
    assert inbox.drain_nowait() == 0 and not inbox._flag.quiet()


def test_a_message_sent_before_the_thread_first_waits_is_read_and_so_is_the_next():
    """A socket's first pipe starts as not empty to ZMQ (its descriptor signals the pipe's
    attachment, not the message): the message waiting when the thread first arms must be read,
    and the one after it too."""
    from sglang_mori.backend import inbox as inbox_module

    ctx = zmq.Context()
    pull, push = pull_push(ctx)
    got = []
    inbox = inbox_module.Inbox(pull, lambda frames, polled: got.append(frames), "test socket",
                               poller_backoff_s=60.0, watch_arrivals=True)
    stop = threading.Event()

    def reader():
        while not stop.is_set():
            inbox.wait_and_drain(60_000)

    thread = threading.Thread(target=reader, name="status-stand-in")
    try:
        push.send(b"A")
        thread.start()
        wait_until(lambda: got, "A read", WAIT_S, interval_s=0.001)
        push.send(b"B")
        wait_until(lambda: len(got) == 2, "B read", WAIT_S, interval_s=0.001)
        assert got == [[b"A"], [b"B"]]
    finally:
        stop.set()
        inbox.close()
        if thread.is_alive():
            thread.join(WAIT_S)
        push.close(0)
        pull.close(0)
        ctx.term()
