"""Inbox.drain_nowait's pass rule (issue 28): one look at the socket serves a scheduler pass.

A poll naming its room skips the look while the last look is under PASS_LOOK_S old and the room
was not polled since; a room polled again is the next pass and looks, so a message is read at the
latest by the poll after the first one that could have read it. Fake socket and clock: the looks
are counted exactly and the times are the test's."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import zmq

from sglang_mori.backend import inbox as inbox_mod
from sglang_mori.backend.inbox import PASS_LOOK_S, POLLER_MIN_GAP_S, Inbox

US = 1e-6


class FakeSocket:
    """What drain_nowait touches: EVENTS (POLLIN while a message waits), RCVMORE, recv; `looks`
    counts EVENTS reads (a look that finds a message reads it once more to see the socket empty)."""

    def __init__(self):
        self.queue = []
        self.looks = 0

    def get(self, opt):
        if opt == zmq.EVENTS:
            self.looks += 1
            return zmq.POLLIN if self.queue else 0
        if opt == zmq.RCVMORE:
            return 0
        raise AssertionError(opt)

    def recv(self, flags=0):
        return self.queue.pop(0)


@pytest.fixture
def rig(monkeypatch):
    """An inbox on a fake socket under a fake perf_counter; `handled` collects (frames, polled)."""
    now = [1000.0]
    monkeypatch.setattr(inbox_mod, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    sock = FakeSocket()
    handled = []
    box = Inbox(sock, lambda frames, polled: handled.append((frames, polled)), "test socket")

    def at(t_us):
        now[0] = 1000.0 + t_us * US

    return SimpleNamespace(box=box, sock=sock, handled=handled, at=at)


def test_one_look_serves_every_room_of_a_pass(rig):
    # Rooms polled 30 us apart (more than POLLER_MIN_GAP_S: without the pass rule each would look).
    assert 30 * US > POLLER_MIN_GAP_S
    for i, room in enumerate((1, 2, 3, 4)):
        rig.at(i * 30)
        rig.box.drain_nowait(room)
    assert rig.sock.looks == 1
    assert rig.box.poller_looks == 1


def test_a_message_after_the_look_is_read_by_that_rooms_next_poll(rig):
    rig.at(0)
    rig.box.drain_nowait(1)  # the look: nothing yet
    rig.sock.queue.append(b"success for room 2")
    rig.at(30)
    assert rig.box.drain_nowait(2) == 0  # the pass's look served it: skipped
    assert rig.handled == []
    # The next pass, 60 us later (still within PASS_LOOK_S of the look): room 1 was polled since
    # the look, so this is a new pass and it looks.
    rig.at(60)
    assert rig.box.drain_nowait(1) == 1
    assert rig.handled == [([b"success for room 2"], True)]
    assert rig.box.poller_looks == 2


def test_the_same_room_polled_again_looks_even_within_the_window(rig):
    rig.at(0)
    rig.box.drain_nowait(7)
    rig.sock.queue.append(b"m")
    rig.at(40)
    assert rig.box.drain_nowait(7) == 1
    assert rig.handled == [([b"m"], True)]


def test_a_look_older_than_the_window_serves_no_room(rig):
    rig.at(0)
    rig.box.drain_nowait(1)
    rig.sock.queue.append(b"m")
    rig.at(PASS_LOOK_S / US + 1)
    assert rig.box.drain_nowait(2) == 1  # room 2 not polled since, but the look is too old
    assert rig.box.poller_looks == 2


def test_a_poll_without_a_room_keeps_the_minimum_gap_only(rig):
    rig.at(0)
    rig.box.drain_nowait()
    rig.sock.queue.append(b"m")
    rig.at(10)
    assert rig.box.drain_nowait() == 0  # within POLLER_MIN_GAP_S: no look, as before
    rig.at(30)
    assert rig.box.drain_nowait() == 1
    assert rig.box.poller_looks == 2


def test_a_look_kept_out_by_the_reading_threads_lock_lets_the_next_room_look(rig):
    rig.at(0)
    rig.box.drain_nowait(1)  # a real look: the stamp is set
    rig.sock.queue.append(b"m")
    rig.at(PASS_LOOK_S / US + 1)  # the next pass...
    held = threading.Event()
    done = threading.Event()

    def hold():
        with rig.box.lock:
            held.set()
            done.wait(5)

    t = threading.Thread(target=hold)
    t.start()
    try:
        assert held.wait(5)
        assert rig.box.drain_nowait(1) == 0  # ...whose look the thread's lock keeps out
    finally:
        done.set()
        t.join(5)
    rig.at(PASS_LOOK_S / US + 31)
    assert rig.box.drain_nowait(2) == 1  # not skipped: the kept-out look read nothing
    assert rig.handled == [([b"m"], True)]
