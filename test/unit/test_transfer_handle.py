"""TransferHandle: result, typed state, failure classification, quiescence and drain proofs."""


import pytest

from sglang_mori.engine.transfer_engine import (
    ERR_BAD_STATE,
    ERR_NOT_FOUND,
    ERR_RDMA_OP,
    IN_PROGRESS,
    INIT,
    SUCCESS,
    FailureKind,
    TransferHandle,
    WriteState,
)


from fake_mori_io import Status  # mori.io's TransferStatus, as the backend reads it


def handle(*codes, peer="decode-A", issued=None, started_at=100.0, nbytes=64, **kw):
    live = [c if isinstance(c, Status) else Status(c) for c in codes]
    return TransferHandle(peer_key=peer, nbytes=nbytes, live=live,
                          issued=list(live) if issued is None else issued,
                          started_at=started_at, **kw)




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



@pytest.mark.parametrize("codes,state", [
    ((SUCCESS,), WriteState.SUCCEEDED),
    ((SUCCESS, IN_PROGRESS), WriteState.RUNNING),
    ((ERR_RDMA_OP,), WriteState.FAILED),
    ((INIT,), WriteState.FAILED),
])
def test_typed_state(codes, state):
    assert handle(*codes).state() is state


def test_unaccounted_success_is_a_failure():
    assert handle(SUCCESS, unaccounted=True).state() is WriteState.FAILED
    assert handle(SUCCESS, unaccounted=True).failure_kind() is FailureKind.REFUSED


def test_failure_kind_of_a_running_handle_is_a_timeout():
    assert handle(IN_PROGRESS).failure_kind() is FailureKind.TIMED_OUT


def test_drained_needs_every_issued_status_to_prove_nothing_lands():
    assert handle(SUCCESS, SUCCESS).drained()
    assert handle(INIT).drained()  # never posted
    assert not handle(ERR_RDMA_OP).drained()  # failed after posting: its other QPs may still write
    assert not handle(SUCCESS, IN_PROGRESS).drained()


# --- TransferHandle.first_look: one read per status right after a submission --------------------

class CountingStatus(Status):
    reads = 0

    def Code(self):
        CountingStatus.reads += 1
        return self.code


def counted(*codes, message=""):
    CountingStatus.reads = 0
    return handle(*[CountingStatus(c, message) for c in codes])


def test_first_look_of_finished_writes_reads_each_status_once():
    h = counted(*[SUCCESS] * 61)
    assert h.first_look() == []
    assert CountingStatus.reads == 61
    # Then quiescence, the verdict and the typed state read none of them again.
    assert h.quiescent() and h.result() == SUCCESS and h.state() is WriteState.SUCCEEDED
    assert CountingStatus.reads == 61


def test_first_look_returns_only_sq_full_failures_to_resubmit():
    live = [Status(SUCCESS), Status(ERR_RDMA_OP, "post send failed: SQ full (batch)"), Status(IN_PROGRESS),
            Status(ERR_RDMA_OP, "remote access error")]
    h = handle(*live)
    assert h.first_look() == [1]
    # Nothing is remembered while a resubmission is due: the resubmitted status replaces index 1.
    assert h.result() == ERR_RDMA_OP


def test_first_look_remembers_only_the_succeeded_prefix():
    running = Status(IN_PROGRESS)
    h = handle(Status(SUCCESS), running, Status(SUCCESS))
    assert h.first_look() == []
    assert h.result() == IN_PROGRESS and not h.quiescent()
    running.code = SUCCESS
    assert h.result() == SUCCESS and h.quiescent()


def test_first_look_of_a_non_retryable_failure_leaves_the_verdict_to_result():
    h = handle(Status(SUCCESS), Status(ERR_NOT_FOUND, "no route"))
    assert h.first_look() == []
    assert h.result() == ERR_NOT_FOUND and h.state() is WriteState.FAILED


def test_first_look_of_nothing():
    h = handle()
    assert h.first_look() == [] and h.result() == SUCCESS


# --- TransferHandle.result over a batch that finished together (issue 28) -------------------------

class StrictCode:
    """A code as MORI's pybind11 enum gives it: int() works, == holds only between members."""

    def __init__(self, value):
        self.value = value

    def __int__(self):
        return self.value

    def __eq__(self, other):
        return isinstance(other, StrictCode) and other.value == self.value

    __hash__ = None


def strict(*codes):
    CountingStatus.reads = 0
    return handle(*[CountingStatus(StrictCode(c)) for c in codes])


@pytest.mark.parametrize("make", [counted, strict])
def test_a_batch_that_finished_together_is_read_once_more_at_most(make):
    h = make(*[IN_PROGRESS] * 61)
    h._next_failure_scan = float("inf")  # the periodic scan behind a running status is not due
    assert h.result() == IN_PROGRESS
    assert CountingStatus.reads == 1  # while the first runs, the others are not read
    for s in h.live:
        s.code = StatusCodeLike(s.code, SUCCESS)
    CountingStatus.reads = 0
    assert h.result() == SUCCESS and h.state() is WriteState.SUCCEEDED
    assert CountingStatus.reads <= 63  # each once, the last twice, the one after the pass once more


def StatusCodeLike(old, value):
    return StrictCode(value) if isinstance(old, StrictCode) else value


@pytest.mark.parametrize("make", [counted, strict])
@pytest.mark.parametrize("middle,expected", [(ERR_RDMA_OP, ERR_RDMA_OP), (INIT, ERR_BAD_STATE),
                                             (IN_PROGRESS, IN_PROGRESS)])
def test_a_status_between_finished_first_and_last_ones_decides(make, middle, expected):
    codes = [SUCCESS] * 61
    codes[37] = middle
    h = make(*codes)
    assert h.result() == expected
    if expected == IN_PROGRESS:  # it finishes later: then the batch succeeded
        h.live[37].code = StatusCodeLike(h.live[37].code, SUCCESS)
        assert h.result() == SUCCESS
    else:  # a failure wins, and stays the verdict
        assert h.state() is WriteState.FAILED


@pytest.mark.parametrize("make", [counted, strict])
def test_statuses_finishing_one_by_one_are_followed(make):
    h = make(*[IN_PROGRESS] * 5)
    for i in range(5):
        assert h.result() == IN_PROGRESS
        h.live[i].code = StatusCodeLike(h.live[i].code, SUCCESS)
    assert h.result() == SUCCESS


def test_first_look_of_running_writes_stands_for_results_first_failure_scan():
    h = counted(*[IN_PROGRESS] * 61)
    assert h.first_look() == []
    assert CountingStatus.reads == 61
    assert h.result() == IN_PROGRESS
    assert CountingStatus.reads == 62  # the running one only: first_look just scanned the rest
    h.live[40].code = ERR_RDMA_OP  # a failure behind the running status is still found ...
    h._next_failure_scan = 0.0  # ... by the next periodic scan
    assert h.result() == ERR_RDMA_OP


@pytest.mark.parametrize("behind", [ERR_NOT_FOUND, INIT])
def test_first_look_that_saw_a_failure_leaves_results_scan_due(behind):
    h = counted(IN_PROGRESS, IN_PROGRESS, behind)
    assert h.first_look() == []
    assert h.result() == (ERR_NOT_FOUND if behind == ERR_NOT_FOUND else ERR_BAD_STATE)
