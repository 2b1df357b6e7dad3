"""Senders racing SGLang's step loop over one inbox: the stress that decode's arrival modes share.

Several PUSH sockets send numbered messages in random bursts while a poller (the scheduler's
stand-in) looks at the inbox at random intervals; the tests then ask that every message was
handled once and each sender's in order. Bounded: the poller stops after 4 x wait_s, the wait for
the messages after 3 x wait_s.
"""

from __future__ import annotations

import random
import struct
import threading
import time
from typing import Callable, List

from waiting import wait_until


def race(sockets: List, drain: Callable[[], object], got: List, pause: Callable[[random.Random], None],
         per_sender: int, wait_s: float, describe: Callable[[], str] = lambda: "") -> None:
    """Run the race; returns once every message was handled (else AssertionError, with `describe()`)
    and checks that each sender's messages were handled once each, in order. `pause(rng)`: the
    poller's wait between looks (a step's length)."""
    done = threading.Event()

    def poller():
        rng = random.Random(1)
        end = time.monotonic() + 4 * wait_s
        while not done.is_set() and time.monotonic() < end:
            drain()
            pause(rng)

    def sender(i):
        rng = random.Random(100 + i)
        for seq in range(per_sender):
            sockets[i].send(struct.pack("<II", i, seq))
            if rng.random() < 0.1:
                time.sleep(rng.choice((0.0001, 0.001, 0.003)))

    total = len(sockets) * per_sender
    threads = [threading.Thread(target=poller, name="scheduler-stand-in")]
    threads += [threading.Thread(target=sender, args=(i,), name=f"sender-{i}") for i in range(len(sockets))]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: len(got) >= total, "every message handled", 3 * wait_s, interval_s=0.005)
    except AssertionError as err:
        raise AssertionError(f"{len(got)} of {total} handled; poller alive {threads[0].is_alive()}; "
                             f"{describe()}") from err
    finally:
        done.set()
        for t in threads:
            t.join(wait_s)
    seen = {}
    for frames, _ in got:
        i, seq = struct.unpack("<II", frames[0])
        seen.setdefault(i, []).append(seq)
    assert seen == {i: list(range(per_sender)) for i in range(len(sockets))}
