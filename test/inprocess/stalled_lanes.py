"""Helpers of the in-process byte-budget tests (issue 29): a prefill whose lanes toward decode are
stalled (a link that stopped moving bytes), so that "posted" and "finished" are apart, and a record
of every write batch the prefill engine was asked to post."""

import time

import sglang_mori.softio.faults as faults


class FakeClock:
    """The budget's clock (InflightBudget.use_clock), moved by the test. It starts at the real
    monotonic time: the budget also compares it with deadlines the submitter takes from the real
    clock (a fixed start of 1000 s put every deadline in the past on a host up less than that)."""

    def __init__(self):
        self.now = time.monotonic()

    def __call__(self):
        return self.now


def record_posts(rig, keyed: bool = False) -> list:
    """The bytes (keyed: (decode engine key, bytes)) of each write batch the prefill engine was asked
    to post, in order."""
    posted = []
    engine = rig.prefill.engine
    real_write = engine.write

    def write(peer_key, batch, **kw):
        posted.append((peer_key, batch.nbytes) if keyed else batch.nbytes)
        return real_write(peer_key, batch, **kw)

    engine.write = write
    return posted


def stall(rig):
    for lane in (0, 1):
        faults.stall_lane(rig.prefill.engine.engine, lane, rig.decode.engine.key)


def resume(rig):
    faults.resume_lane(rig.prefill.engine.engine, None, rig.decode.engine.key)


def open_room(rig, room, pages, decode=None):
    """A new attempt at `room` on `decode` (the rig's own by default), its metadata, and the claim."""
    (decode or rig).new_attempt(room)
    (decode or rig).metadata(room, pages=pages)
    rig.claim(room)
