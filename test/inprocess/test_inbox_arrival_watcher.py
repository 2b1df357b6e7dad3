"""Decode's inbox with its arrival watcher process (SGLANG_MORI_DECODE_ARRIVAL_FLAG=process,
arrival_watcher.py, issue 28): the step thread's look at an empty socket reads a byte a child
process writes; no message is lost, repeated, reordered or stranded with racing senders, the
reading thread taking turns on the socket and random polls; the child's death is noticed and the
inbox looks for real from then; close() ends the child and reaps it."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import pytest
import zmq

from racing_senders import race
from waiting import wait_until
from zmq_pair import pull_push

WAIT_S = 10.0


class _Rig:
    def __init__(self, backoff_s: float, thread: bool):
        from sglang_mori.backend import inbox as inbox_module

        self.ctx = zmq.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        self.port = self.pull.bind_to_random_port("tcp://127.0.0.1")
        self.got = []
        self.inbox = inbox_module.Inbox(self.pull, lambda frames, polled: self.got.append((frames, polled)),
                                        "test socket", poller_backoff_s=backoff_s, watch_arrivals="process")
        assert self.inbox._watcher is not None, "the watcher process did not start"
        self.pushes = []
        self.stop = threading.Event()
        self.thread = None
        if thread:  # decode's status thread, as DecodeService runs it
            def reader():
                while not self.stop.is_set():
                    self.inbox.wait_and_drain(int(backoff_s * 1000))
                self.inbox.thread_done()

            self.thread = threading.Thread(target=reader, name="status-stand-in")
            self.thread.start()

    def push(self):
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{self.port}")
        self.pushes.append(sock)
        return sock

    def quiet(self) -> bool:  # the byte says: nothing arrived since the last empty look
        q = self.inbox._quiet
        return q is not None and q[0] == 0

    def close(self):
        self.stop.set()
        self.inbox.close()
        if self.thread is not None:
            self.thread.join(WAIT_S)
            assert not self.thread.is_alive()
        for sock in self.pushes + [self.pull]:
            sock.close(0)
        self.ctx.term()


def _reaped(pid: int) -> bool:
    """The child is gone and no zombie is left (its /proc entry goes when it is reaped)."""
    return not os.path.exists(f"/proc/{pid}")


@pytest.fixture
def rig():
    """No reading thread: every message is the poll's to read (a 60 s backoff never matters)."""
    r = _Rig(60.0, thread=False)
    yield r
    r.close()


def test_an_idle_look_reads_the_byte_and_touches_no_socket(rig):
    inbox = rig.inbox
    sender = rig.push()
    sender.send(b"connected")
    wait_until(lambda: inbox.drain_nowait() or rig.got, "the first message read", WAIT_S, interval_s=0.001)
    wait_until(lambda: inbox.drain_nowait() == 0 and rig.quiet(), "quiet after an empty look", WAIT_S,
               interval_s=0.001)
    real_sock = inbox.sock
    try:
        inbox.sock = None  # any use of the socket would raise here
        assert [inbox.drain_nowait() for _ in range(1000)] == [0] * 1000
    finally:
        inbox.sock = real_sock
    assert inbox._quiet_looks >= 1000


def test_until_the_child_watches_every_look_is_real(rig):
    """A 0 written before the child's epoll is set up would hide an arrival until the child
    runs: looks leave the byte at 1 until the child says it watches."""
    inbox, sender = rig.inbox, rig.push()
    flag = inbox._quiet
    wait_until(lambda: flag[1], "the child watching", WAIT_S, interval_s=0.001)
    flag[1] = 0  # as during the child's start-up
    try:
        assert [inbox.drain_nowait() for _ in range(3)] == [0, 0, 0] and flag[0] == 1
        sender.send(b"during start-up")
        wait_until(lambda: inbox.drain_nowait() or rig.got, "read by a real look", WAIT_S, interval_s=0.001)
        assert flag[0] == 1  # still not trusted
    finally:
        flag[1] = 1
    wait_until(lambda: inbox.drain_nowait() == 0 and rig.quiet(), "quiet once it watches", WAIT_S,
               interval_s=0.001)


def test_a_message_right_after_the_emptying_look_is_shown_by_the_child(rig):
    """Only the poll reads here: the child must set the byte for each message sent just after
    the look that emptied the socket (and cleared it), however soon it comes."""
    inbox, sender = rig.inbox, rig.push()
    for n in range(1, 51):
        wait_until(lambda: inbox.drain_nowait() == 0 and rig.quiet(), f"quiet before message {n}", WAIT_S,
                   interval_s=0.0002)
        sender.send(b"%d" % n)
        wait_until(lambda: not rig.quiet(), f"the child showed message {n}", WAIT_S, interval_s=0.0002)
        wait_until(lambda: inbox.drain_nowait(), f"message {n} read by the poll", WAIT_S, interval_s=0.0002)
    assert rig.got == [([b"%d" % n], True) for n in range(1, 51)]


class _ArrivalAfterTheEmptyCheck:
    """The inbox's socket, but the first look's final `get(zmq.EVENTS)` that says empty (once
    armed) sends one more message and returns only when the child has shown it: an arrival in the
    narrowest gap there is, between a drain's last check and whatever the look does after it."""

    def __init__(self, sock, sender, quiet_byte):
        self.sock, self.sender, self.quiet_byte = sock, sender, quiet_byte
        self.armed = False

    def get(self, option):
        value = self.sock.get(option)
        if option == zmq.EVENTS and not value & zmq.POLLIN and self.armed:
            self.armed = False
            self.sender.send(b"in the gap")
            wait_until(lambda: self.quiet_byte[0] == 1, "the child showed the arrival in the gap", WAIT_S,
                       interval_s=0.0002)
        return value

    def recv(self, *args):
        return self.sock.recv(*args)


def test_an_arrival_right_after_the_drains_last_check_is_not_hidden(rig):
    """The byte is cleared before the drain, never after it: an arrival the child shows once the
    drain's last check said empty must stay shown (cleared after, it would stay unread: no thread
    reads here and no later message comes). Fails with the byte cleared after the drain."""
    inbox, sender = rig.inbox, rig.push()
    sender.send(b"first")
    wait_until(lambda: inbox.drain_nowait() or rig.got, "the first message read", WAIT_S, interval_s=0.001)
    wait_until(lambda: inbox.drain_nowait() == 0 and rig.quiet(), "quiet", WAIT_S, interval_s=0.001)
    gap = _ArrivalAfterTheEmptyCheck(inbox.sock, sender, inbox._quiet)
    inbox.sock = gap
    gap.armed = True
    sender.send(b"second")
    wait_until(lambda: inbox.drain_nowait() or len(rig.got) == 2, "the second message read", WAIT_S,
               interval_s=0.001)
    assert not gap.armed  # the gap's message went out after the look's last check
    wait_until(lambda: inbox.drain_nowait() or len(rig.got) == 3, "the message sent in the gap read", WAIT_S,
               interval_s=0.001)
    assert [f for f, _ in rig.got] == [[b"first"], [b"second"], [b"in the gap"]]
    inbox.sock = gap.sock


def test_a_look_the_byte_sent_for_nothing_leaves_the_next_arrival_shown(rig):
    """The watched look receives at once (session 22): a byte set with nothing waiting (a signal
    of a message an earlier drain read) makes that receive fail, and that failed receive must be
    the look that found the socket empty: the next arrival still sets the byte and is read by the
    poll, 30 times in a row. (Fails, checked, if the failed receive leaves the look unfinished:
    the byte then stays 1 and the wait for quiet times out.)"""
    inbox, sender = rig.inbox, rig.push()
    sender.send(b"connected")
    wait_until(lambda: inbox.drain_nowait() or rig.got, "the first message read", WAIT_S, interval_s=0.001)
    wait_until(lambda: inbox.drain_nowait() == 0 and rig.quiet(), "quiet", WAIT_S, interval_s=0.001)
    q = inbox._quiet
    for n in range(30):
        looks = inbox.poller_looks
        q[0] = 1  # a signal for nothing
        assert inbox.drain_nowait() == 0 and inbox.poller_looks == looks + 1  # a real look, nothing read
        assert q[0] == 0, "a look that found nothing left the byte set"
        sender.send(b"%d" % n)
        wait_until(lambda: q[0] == 1, f"message {n} shown by the child", WAIT_S, interval_s=0.0002)
        assert inbox.drain_nowait() == 1
    assert [f for f, _ in rig.got[1:]] == [[b"%d" % n] for n in range(30)]


def test_a_multipart_message_is_received_whole_by_the_watched_look(rig):
    """The watched look's first receive is followed by the message's other frames, and the next
    message starts a new one: three frames, then one, then two, in one drain."""
    inbox, sender = rig.inbox, rig.push()
    sender.send_multipart([b"a", b"b", b"c"])
    sender.send(b"d")
    sender.send_multipart([b"e", b"f"])
    wait_until(lambda: inbox.drain_nowait() or len(rig.got) >= 3, "three messages read", WAIT_S,
               interval_s=0.001)
    wait_until(lambda: len(rig.got) == 3 or inbox.drain_nowait(), "three messages read", WAIT_S,
               interval_s=0.001)
    assert [f for f, _ in rig.got] == [[b"a", b"b", b"c"], [b"d"], [b"e", b"f"]]


def test_polls_that_only_read_messages_keep_the_thread_off_the_socket():
    """A poller whose every look reads a message (no empty look: the byte set at each step) is
    still a poller: the reading thread must see it and stay off the socket (its receive would take
    the GIL from the scheduler and leave messages ZMQ signals no more). The watched look reads no
    clock (session 22); the thread counts its looks. Fails if the thread sees only empty looks."""
    r = _Rig(0.1, thread=True)
    try:
        inbox, sender = r.inbox, r.push()
        q = inbox._quiet
        sender.send(b"connected")
        wait_until(lambda: inbox.drain_nowait() or r.got, "the first message read", WAIT_S, interval_s=0.001)
        # empty looks for three backoffs: the thread leaves the socket to the poller
        end = time.monotonic() + 0.3
        while time.monotonic() < end:
            inbox.drain_nowait()
            time.sleep(0.001)
        by_thread = inbox.by_thread
        for n in range(60):  # steps of 10 ms, each with a message and only real looks
            sender.send(b"%d" % n)
            while len(r.got) < n + 2:
                wait_until(lambda: q[0] == 1 or len(r.got) >= n + 2, f"message {n} shown", WAIT_S,
                           interval_s=0.0002)
                inbox.drain_nowait()
            time.sleep(0.01)  # the step's stand-in
        assert inbox.by_thread == by_thread, "the reading thread took messages from an active poller"
        assert [f for f, _ in r.got[1:]] == [[b"%d" % n] for n in range(60)]
    finally:
        r.close()


@pytest.mark.parametrize("thread", [True, False], ids=["with-thread", "poll-only"])
def test_many_senders_racing_the_poll_lose_reorder_and_strand_nothing(thread):
    """Eight senders in bursts, a poller looking at random intervals with pauses longer than the
    reading thread's backoff (so the thread takes turns on the socket, setting the byte): every
    message is handled once, each sender's in order, none left behind the byte. Poll-only: no
    thread rescues a message the byte failed to show (the last ones have no later arrival either)."""
    r = _Rig(0.02, thread=thread)
    try:
        senders, per_sender = 8, 250
        sockets = [r.push() for _ in range(senders)]

        def step(rng):  # SGLang's step loop, idle now and then
            x = rng.random()
            if x < 0.02:
                time.sleep(0.05)  # no poller for a while: the reading thread's turn
            elif x < 0.5:
                time.sleep(rng.choice((0, 0.0001, 0.0005, 0.002)))

        race(sockets, r.inbox.drain_nowait, r.got, step, per_sender, WAIT_S)
        assert r.inbox.by_poller + r.inbox.by_thread == senders * per_sender
        if thread:
            assert r.inbox.by_poller > 0 and r.inbox.by_thread > 0  # both readers took turns
        assert r.inbox._watcher is not None  # (still the watcher's inbox, not a fallback)
    finally:
        r.close()


def test_the_childs_death_is_noticed_and_nothing_is_stranded(caplog):
    """The child killed while the byte is 0: a message then sent is behind a byte nobody will set; the
    reading thread notices the death at its next wake, the inbox looks for real from then."""
    r = _Rig(0.02, thread=True)
    try:
        inbox, sender = r.inbox, r.push()
        sender.send(b"before")
        wait_until(lambda: inbox.drain_nowait() or r.got, "the first message read", WAIT_S, interval_s=0.001)
        wait_until(lambda: inbox.drain_nowait() == 0 and r.quiet(), "quiet", WAIT_S, interval_s=0.001)
        pid = inbox._watcher.pid
        with caplog.at_level(logging.WARNING, logger="sglang_mori.backend.inbox"):
            os.kill(pid, signal.SIGKILL)
            sender.send(b"after")
            wait_until(lambda: inbox.drain_nowait() or len(r.got) == 2, "the message after the death read",
                       WAIT_S, interval_s=0.001)
        assert [f for f, _ in r.got] == [[b"before"], [b"after"]]
        wait_until(lambda: inbox._watcher is None, "the death noticed", WAIT_S, interval_s=0.001)
        assert "arrival watcher process" in caplog.text and str(pid) in caplog.text
        wait_until(lambda: _reaped(pid), "the dead child reaped", WAIT_S, interval_s=0.001)
        # from now on the poll looks for real: a message is read by a poll or the thread
        sender.send(b"later")
        wait_until(lambda: inbox.drain_nowait() or len(r.got) == 3, "a later message read", WAIT_S,
                   interval_s=0.001)
        assert [f for f, _ in r.got][-1] == [b"later"]
    finally:
        r.close()


def test_close_ends_the_child_and_reaps_it():
    r = _Rig(60.0, thread=True)
    pid = r.inbox._watcher.pid
    assert os.path.exists(f"/proc/{pid}")
    start = time.monotonic()
    r.close()
    assert time.monotonic() - start < 2.0
    assert _reaped(pid)  # ended and reaped: no zombie
    assert r.inbox.drain_nowait() == 0


def test_without_a_child_the_inbox_looks_at_the_socket(monkeypatch, caplog):
    from sglang_mori.backend import inbox as inbox_module

    def no_child(fd):
        raise OSError("no child here")

    monkeypatch.setattr(inbox_module, "ArrivalWatcher", no_child)
    ctx = zmq.Context()
    pull, push = pull_push(ctx)
    got = []
    with caplog.at_level(logging.WARNING, logger="sglang_mori.backend.inbox"):
        inbox = inbox_module.Inbox(pull, lambda frames, polled: got.append(frames), "test socket",
                                   poller_backoff_s=60.0, watch_arrivals="process")
    try:
        assert inbox._watcher is None and inbox._quiet is None
        assert "no arrival watcher process (no child here)" in caplog.text
        push.send(b"x")
        wait_until(lambda: inbox.drain_nowait(), "x read by a plain look", WAIT_S, interval_s=0.001)
        assert got == [[b"x"]]
    finally:
        inbox.close()
        push.close(0)
        pull.close(0)
        ctx.term()


@pytest.mark.parametrize("text,mode", [("process", "process"), ("1", "thread"), ("on", "thread"), ("thread", "thread"),
                                       ("0", "off"), ("off", "off"), ("PROCESS", "process")])
def test_the_knob_spells_off_thread_and_process(text, mode):
    from sglang_mori.backend.inbox import arrival_mode
    from sglang_mori.config import ConfigError, MoriConfig

    assert MoriConfig.from_env({"SGLANG_MORI_DECODE_ARRIVAL_FLAG": text}).decode_arrival_flag == mode
    assert arrival_mode(text) == mode
    assert MoriConfig().decode_arrival_flag == "off"
    assert (arrival_mode(True), arrival_mode(False)) == ("thread", "off")
    with pytest.raises(ConfigError):
        MoriConfig.from_env({"SGLANG_MORI_DECODE_ARRIVAL_FLAG": "child"})
