"""SGLANG_MORI_WAIT_POLL_MS does what docs/tuning.md says (issue 26: decode polled a fixed 100 ms):
decode's status thread checks its deadlines at least this often, prefill's completion thread waits
at most this long (capped at 20 ms) on a running write before it looks at every room again."""

import threading
from types import SimpleNamespace

import pytest

from sglang_mori.backend.decode import service as decode_service
from sglang_mori.backend.decode.rooms import DecodeRoomRegistry
from sglang_mori.backend.prefill.completion import Completion
from sglang_mori.config import MoriConfig
from sglang_mori.engine import WriteState
from sglang_mori.metrics import NullTransferMetrics


class OneTimeoutThenStop:
    """The status thread's inbox: records how long it is asked to wait for a message, then
    returns having handled none (nothing came within that time) and stops the thread."""

    def __init__(self, service=None):
        self.timeouts: list = []
        self.service = service

    def wait_and_drain(self, timeout_ms):
        self.timeouts.append(timeout_ms)
        self.service.stopped.set()
        return 0

    def thread_done(self):
        pass


@pytest.mark.parametrize("poll_ms", [7, 50, 250])
def test_decode_status_thread_polls_at_the_knob(monkeypatch, poll_ms):
    parts = SimpleNamespace(config=MoriConfig(wait_poll_ms=poll_ms), control_socket=None, clock=lambda: 1.0,
                            metrics=NullTransferMetrics(), rooms=DecodeRoomRegistry(), sglang=None,
                            aux=decode_service.AuxSlots([], [], []))
    service = decode_service.DecodeService(parts, reject=lambda *a: None)
    inbox = service.inbox = OneTimeoutThenStop(service)
    checked = []
    monkeypatch.setattr(service, "enforce_deadlines", checked.append)
    service._run_status_thread()
    assert inbox.timeouts == [poll_ms]
    assert checked == [1.0]  # the deadlines were checked after the idle wait


class RunningWrite:
    released = False

    def __init__(self):
        self.waited = []

    def state(self):
        return WriteState.RUNNING

    def wait_running(self, timeout_ms):
        self.waited.append(timeout_ms)
        return True


@pytest.mark.parametrize("poll_ms, waited", [(1, 1), (7, 7), (20, 20), (50, 20), (10000, 20)])
def test_prefill_completion_waits_on_a_running_write_at_most_the_knob_capped(poll_ms, waited):
    write = RunningWrite()
    room = SimpleNamespace(writes=[SimpleNamespace(handle=write)], announce_at=None, concluded=False)
    rooms = SimpleNamespace(generation=0, lock=threading.Lock(), with_writes=lambda: [room], open_count=lambda: 1)
    parts = SimpleNamespace(config=MoriConfig(wait_poll_ms=poll_ms), rooms=rooms, clock=lambda: 1.0,
                            metrics=NullTransferMetrics(), engine=SimpleNamespace(pop_peer_failures=list))
    completion = Completion(parts, effects=None, failures=None, on_peer_failed=None)
    completion.advance = lambda r, now: None  # the pass's decisions are not under test here
    completion.run_once()
    assert write.waited == [waited]


@pytest.mark.parametrize("due_in_s, waited", [(0.003, 3), (0.0004, 1), (0.5, 20)])
def test_prefill_completion_wakes_when_a_held_back_transfer_started_is_due(due_in_s, waited):
    """A last chunk's TransferStarted held back for SGLANG_MORI_ANNOUNCE_GRACE_MS (announce.py) goes
    out once due: the wait on a running write ends by then (at least 1 ms), not after the full poll."""
    write = RunningWrite()
    room = SimpleNamespace(writes=[SimpleNamespace(handle=write)], announce_at=1.0 + due_in_s, concluded=False)
    rooms = SimpleNamespace(generation=0, lock=threading.Lock(), with_writes=lambda: [room], open_count=lambda: 1)
    parts = SimpleNamespace(config=MoriConfig(wait_poll_ms=50), rooms=rooms, clock=lambda: 1.0,
                            metrics=NullTransferMetrics(), engine=SimpleNamespace(pop_peer_failures=list))
    completion = Completion(parts, effects=None, failures=None, on_peer_failed=None)
    completion.advance = lambda r, now: None  # the pass's decisions are not under test here
    completion.run_once()
    assert write.waited == [waited]
