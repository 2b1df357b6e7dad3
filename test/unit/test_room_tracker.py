"""RoomTransfer.verdict / unfinished, RoomTracker, and TransferHandle result / quiescence."""


import pytest

from sglang_mori.engine.transfer_engine import (
    ERR_BAD_STATE,
    ERR_NOT_FOUND,
    ERR_RDMA_OP,
    IN_PROGRESS,
    INIT,
    SUCCESS,
    TransferHandle,
)

# backend/__init__.py exports lazily, so this imports no SGLang.
from sglang_mori.backend import room_tracker

RoomTracker, RoomTransfer = room_tracker.RoomTracker, room_tracker.RoomTransfer


class Status:
    """The three methods of mori.io's TransferStatus that the backend reads."""

    def __init__(self, code, message=""):
        self.code = code
        self.message = message

    def Code(self):
        return self.code

    def Message(self):
        return self.message

    def Failed(self):
        return self.code > 10


def handle(*codes, peer="decode-A", issued=None, started_at=100.0, nbytes=64, **kw):
    live = [c if isinstance(c, Status) else Status(c) for c in codes]
    return TransferHandle(peer_key=peer, nbytes=nbytes, live=live,
                          issued=list(live) if issued is None else issued,
                          started_at=started_at, **kw)


def room(*handles_and_deadlines):
    rt = RoomTransfer(room=5, targets=[("127.0.0.1", 17000, "decode-A", 0)])
    for h, deadline in handles_and_deadlines:
        rt.add(h, deadline)
    return rt


# --- TransferHandle.result / failure_message ----------------------------------------------------

@pytest.mark.parametrize("codes,expected", [
    ((), SUCCESS),
    ((SUCCESS,), SUCCESS),
    ((SUCCESS, SUCCESS, SUCCESS), SUCCESS),
    ((SUCCESS, IN_PROGRESS), IN_PROGRESS),
    ((IN_PROGRESS, ERR_RDMA_OP), ERR_RDMA_OP),
    ((ERR_RDMA_OP, IN_PROGRESS), ERR_RDMA_OP),
    ((SUCCESS, ERR_NOT_FOUND, ERR_RDMA_OP), ERR_NOT_FOUND),
    ((SUCCESS, INIT), ERR_BAD_STATE),
    ((IN_PROGRESS, INIT), ERR_BAD_STATE),
])
def test_handle_result(codes, expected):
    assert handle(*codes).result() == expected


def test_result_follows_status_updates():
    s = Status(IN_PROGRESS)
    h = handle(Status(SUCCESS), s)
    assert h.result() == IN_PROGRESS
    s.code = SUCCESS
    assert h.result() == SUCCESS
    # Once every status was seen SUCCESS the verdict is final. MORI can overwrite a SUCCESS only
    # through a failed notification SEND (enable_notification), after the data writes completed,
    # so the bytes are there; re-reading thousands of finished statuses per pass would cost the
    # engine's threads the GIL.
    s.code = ERR_RDMA_OP
    assert h.result() == SUCCESS


def test_failure_behind_a_running_status_is_seen():
    first, later = Status(IN_PROGRESS), Status(IN_PROGRESS)
    h = handle(first, later)
    assert h.result() == IN_PROGRESS
    later.code = ERR_RDMA_OP
    h._next_failure_scan = 0.0  # the periodic scan of statuses behind the running one is due
    assert h.result() == ERR_RDMA_OP


def test_failure_message():
    assert handle(SUCCESS, IN_PROGRESS).failure_message() == ""
    h = handle(Status(SUCCESS), Status(ERR_RDMA_OP, "wc status 12 on qp 4"), Status(ERR_NOT_FOUND, "x"))
    assert h.failure_message() == "code 13: wc status 12 on qp 4"
    assert handle(Status(INIT, "never posted")).failure_message() == "code 1: never posted"


# --- RoomTransfer.verdict ---------------------------------------------------------------------

def test_verdict_success():
    rt = room((handle(SUCCESS, SUCCESS), 200.0), (handle(SUCCESS), 201.0))
    assert rt.verdict(now=150.0) == (SUCCESS, "")


def test_verdict_empty_room_is_success():
    assert room().verdict(now=0.0) == (SUCCESS, "")


def test_verdict_in_progress():
    rt = room((handle(SUCCESS), 200.0), (handle(SUCCESS, IN_PROGRESS), 200.0))
    assert rt.verdict(now=150.0) == (IN_PROGRESS, "")
    assert rt.verdict(now=200.0) == (IN_PROGRESS, "")  # at the deadline, not past it


def test_verdict_success_after_deadline_is_still_success():
    rt = room((handle(SUCCESS), 110.0))
    assert rt.verdict(now=500.0) == (SUCCESS, "")


def test_verdict_failure():
    rt = room((handle(SUCCESS), 200.0),
              (handle(Status(SUCCESS), Status(ERR_RDMA_OP, "remote access error"), peer="decode-B"), 200.0))
    assert rt.verdict(now=150.0) == (
        ERR_RDMA_OP, "KV transfer to decode engine decode-B failed: code 13: remote access error")


def test_verdict_failure_wins_over_in_progress():
    rt = room((handle(IN_PROGRESS), 200.0),
              (handle(Status(ERR_NOT_FOUND, "no session"), Status(IN_PROGRESS)), 200.0))
    code, reason = rt.verdict(now=150.0)
    assert code == ERR_NOT_FOUND
    assert reason == "KV transfer to decode engine decode-A failed: code 12: no session"


def test_verdict_init_is_failure():
    rt = room((handle(Status(SUCCESS), Status(INIT, "not posted")), 200.0))
    assert rt.verdict(now=150.0) == (
        ERR_BAD_STATE, "KV transfer to decode engine decode-A failed: code 1: not posted")


def test_verdict_deadline_expiry():
    rt = room((handle(SUCCESS), 200.0),
              (handle(SUCCESS, IN_PROGRESS, peer="decode-slow", started_at=100.0), 130.0))
    code, reason = rt.verdict(now=130.25)
    assert code == -1
    assert reason == ("KV transfer to decode engine decode-slow timed out: not complete after "
                      "30250 ms (SGLANG_MORI_TRANSFER_TIMEOUT_MS)")


def test_verdict_deadlines_are_per_handle():
    early_done = handle(SUCCESS, started_at=100.0)
    late_running = handle(IN_PROGRESS, peer="decode-late", started_at=140.0)
    rt = room((early_done, 130.0), (late_running, 170.0))
    assert rt.verdict(now=160.0) == (IN_PROGRESS, "")
    code, reason = rt.verdict(now=170.5)
    assert code == -1 and "decode-late" in reason and "30500 ms" in reason


def test_verdict_follows_status_updates():
    s = Status(IN_PROGRESS)
    rt = room((handle(s), 200.0))
    assert rt.verdict(now=150.0) == (IN_PROGRESS, "")
    s.code = SUCCESS
    assert rt.verdict(now=150.0) == (SUCCESS, "")


def test_add_accounts_bytes_and_ops():
    rt = room((handle(SUCCESS, nbytes=4096), 1.0), (handle(SUCCESS, nbytes=100), 2.0))
    assert (rt.bytes_submitted, rt.engine_ops, rt.deadlines) == (4196, 2, [1.0, 2.0])
    rt.conclude(now=42.0)
    assert (rt.concluded, rt.concluded_at) == (True, 42.0)


# --- quiescence --------------------------------------------------------------------------------

@pytest.mark.parametrize("codes,quiet", [
    ((), True),
    ((SUCCESS, SUCCESS), True),
    ((SUCCESS, IN_PROGRESS), False),
    ((IN_PROGRESS,), False),
    ((INIT,), True),
    ((ERR_RDMA_OP, INIT, SUCCESS), True),
    ((ERR_RDMA_OP, IN_PROGRESS), False),
])
def test_quiescent(codes, quiet):
    assert handle(*codes).quiescent() is quiet


def test_quiescent_looks_at_every_issued_status_not_only_live():
    old_attempt = Status(IN_PROGRESS)  # an earlier post-batch still writing
    h = handle(SUCCESS, issued=[old_attempt, Status(SUCCESS)])
    assert h.result() == SUCCESS
    assert not h.quiescent()
    old_attempt.code = ERR_RDMA_OP
    assert h.quiescent()


@pytest.mark.parametrize("codes", [(), (SUCCESS,), (INIT, ERR_RDMA_OP)])
def test_unaccounted_is_never_quiescent(codes):
    assert handle(*codes, unaccounted=True).quiescent() is False


def test_unfinished():
    running = handle(SUCCESS, IN_PROGRESS)
    unaccounted = handle(SUCCESS, unaccounted=True)
    done = handle(SUCCESS)
    never_posted = handle(INIT)
    rt = room((running, 1.0), (done, 1.0), (unaccounted, 1.0), (never_posted, 1.0))
    assert rt.unfinished() == [running, unaccounted]
    running.live[1].code = SUCCESS
    assert rt.unfinished() == [unaccounted]


# --- RoomTracker -------------------------------------------------------------------------------

class Wakeup:
    def __init__(self):
        self.waits = []
        self.notified = 0

    def wait(self, timeout):
        self.waits.append(timeout)

    def notify_all(self):
        self.notified += 1


def test_tracker_get_or_create_remove_snapshot():
    tracker = RoomTracker()
    targets = [("127.0.0.1", 17000, "decode-A", 3)]
    rt, created = tracker.get_or_create(7, targets)
    assert created and rt.room == 7 and rt.targets == targets
    again, created = tracker.get_or_create(7, [])
    assert again is rt and not created and again.targets == targets
    other, _ = tracker.get_or_create(8, [])
    assert len(tracker) == 2
    assert tracker.get(7) is rt and tracker.get(9) is None
    assert tracker.snapshot() == [rt, other]
    tracker.remove(7)
    tracker.remove(7)  # idempotent
    assert tracker.get(7) is None and len(tracker) == 1


def test_tracker_waits_only_without_news():
    tracker = RoomTracker()
    tracker.wakeup = Wakeup()
    seen = tracker.generation
    tracker.wait_for_change(seen, 0.25)
    assert tracker.wakeup.waits == [0.25]
    tracker.get_or_create(1, [])  # rooms present but nothing new: still sleeps (no spin)
    tracker.wait_for_change(seen, 0.25)
    assert tracker.wakeup.waits == [0.25, 0.25]
    tracker.notify()
    assert tracker.wakeup.notified == 1
    tracker.wait_for_change(seen, 0.25)  # a notify since `seen`: returns at once
    assert tracker.wakeup.waits == [0.25, 0.25]