"""The completion thread concludes a room on the wake-up that its last running write finished on,
not on the pass after (issue 28: a lone request's time from the copy's end to its Success), and
only where the room is ready: every write of every chunk succeeded, the last chunk tracked; a
failed write still fails the room; never two Successes."""

from types import SimpleNamespace

import numpy as np

from sglang_mori import protocol
from sglang_mori.backend import room_status as S
from sglang_mori.backend.peers import InflightBudget
from sglang_mori.backend.prefill.completion import Completion
from sglang_mori.backend.prefill.effects import RoomEffects
from sglang_mori.backend.prefill.failures import PrefillFailures
from sglang_mori.backend.prefill.rooms import Phase, PrefillRoom, PrefillRoomRegistry, RoomTarget, Sender, TrackedWrite
from sglang_mori.backend.prefill.success import SuccessDecider
from sglang_mori.config import MoriConfig
from sglang_mori.engine import FailureKind, WriteState
from sglang_mori.metrics import NullTransferMetrics

PEER = "decode-engine"
ROOM = 7
AUX = [b"aux-of-slot-2"]


class WokenHandle:
    """A write that runs until the completion thread waits on it, and is `outcome` after."""

    def __init__(self, outcome=WriteState.SUCCEEDED):
        self.outcome = outcome
        self.woken = False
        self.released = self.fenced = False
        self.peer_key, self.nbytes, self.started_at = PEER, 4096, 0.0

    def wait_running(self, timeout_ms: int) -> bool:
        self.woken = True  # the engine completed it while the thread slept
        return True

    def state(self):
        return self.outcome if self.woken else WriteState.RUNNING

    def quiescent(self) -> bool:
        return self.woken

    def drained(self) -> bool:
        return self.woken and self.outcome is WriteState.SUCCEEDED

    def failure_kind(self):
        return FailureKind.TRANSPORT

    def failure_message(self) -> str:
        return "code 14: remote access error"


class RunningHandle(WokenHandle):
    """A write that still runs when the thread wakes (another write of the room woke it)."""

    def wait_running(self, timeout_ms: int) -> bool:
        return True


class RecordingSGLang:
    def __init__(self):
        self.statuses = {ROOM: S.TRANSFERRING}
        self.calls = []

    def status(self, room):
        return self.statuses.get(room)

    def set_status(self, room, status):
        self.statuses[room] = status
        self.calls.append(("set_status", room, status))

    def failure_reason(self, room):
        return None

    def __getattr__(self, name):
        return lambda *args: self.calls.append((name, *args))


class RecordingMessenger:
    def __init__(self):
        self.sent = []

    def send(self, address, message, block=True):
        self.sent.append((address, message))
        return True


def service(*handles, last_submitted=True):
    reads = []

    def read_aux(index):
        reads.append(index)
        return list(AUX) if index == 2 else None

    p = SimpleNamespace(config=MoriConfig(), peers=SimpleNamespace(budget=InflightBudget(4), mark_failed=lambda *a: False),
                        metrics=NullTransferMetrics(), sglang=RecordingSGLang(), rooms=PrefillRoomRegistry(),
                        messenger=RecordingMessenger(), read_aux=read_aux, owns_aux=True, timeout_s=30.0,
                        clock=lambda: 1.0, engine=SimpleNamespace(can_fence=False, pop_peer_failures=lambda: []))
    target = RoomTarget(engine_key=PEER, attempt=3, endpoint="10.0.0.2", dst_port=5000,
                        kv_indices=np.arange(4), aux_index=2, state_indices=None, required_dst_info_num=1,
                        decode_prefix_len=None, is_dummy=False)
    room = PrefillRoom(room=ROOM, created_at=0.0, phase=Phase.SUBMITTING, sender=Sender.HELD,
                       targets={PEER: target}, last_submitted=last_submitted, aux_index=2 if last_submitted else None,
                       writes=[TrackedWrite(h, 30.0) for h in handles])
    p.rooms.rooms[ROOM] = room
    for _ in handles:
        assert p.peers.budget.acquire(PEER, deadline=10.0)
    effects = RoomEffects(p)
    completion = Completion(p, effects, PrefillFailures(p, effects), on_peer_failed=lambda *a: None,
                            success=SuccessDecider(p, effects))
    return p, room, completion, reads


def statuses_sent(p):
    return [(address, m.status, m.aux) for address, m in p.messenger.sent if isinstance(m, protocol.RoomStatus)]


def test_the_room_succeeds_on_the_wake_up_its_last_write_finished_on():
    p, room, completion, reads = service(WokenHandle())
    completion.run_once()  # one pass: it finds the write running, waits, and the write finishes
    assert room.succeeded
    assert ("set_status", ROOM, S.SUCCESS) in p.sglang.calls
    assert statuses_sent(p) == [(("10.0.0.2", 5000), S.SUCCESS, AUX)]
    assert reads == [2]
    completion.run_once()  # the next pass settles it: the budget back, decode's ACKs released
    assert room.phase is Phase.DRAINED and p.peers.budget.count(PEER) == 0
    assert statuses_sent(p) == [(("10.0.0.2", 5000), S.SUCCESS, AUX)]  # never a second Success


def test_no_success_while_another_write_of_the_room_still_runs():
    p, room, completion, _ = service(WokenHandle(), RunningHandle())
    completion.run_once()
    assert not room.concluded and statuses_sent(p) == []
    assert p.sglang.statuses[ROOM] == S.TRANSFERRING


def test_no_success_before_the_last_chunk_is_tracked():
    p, room, completion, reads = service(WokenHandle(), last_submitted=False)
    completion.run_once()
    assert not room.concluded and statuses_sent(p) == [] and reads == []


def test_a_failed_write_fails_the_room_on_the_same_wake_up():
    p, room, completion, _ = service(WokenHandle(WriteState.FAILED))
    completion.run_once()
    assert room.failed and "remote access error" in room.reason
    assert [status for _, status, _ in statuses_sent(p)] == [S.FAILED]
    assert ("set_status", ROOM, S.SUCCESS) not in p.sglang.calls


def test_a_room_sglang_failed_meanwhile_never_succeeds():
    p, room, completion, _ = service(WokenHandle())
    p.sglang.statuses[ROOM] = S.FAILED  # the scheduler aborted the request during the copy
    completion.run_once()
    assert not room.succeeded
    assert all(status != S.SUCCESS for _, status, _ in statuses_sent(p))


def test_the_one_hold_success_decides_under_the_lock_and_only_once():
    p, room, completion, reads = service(WokenHandle())
    room.writes[0].handle.woken = True
    room.submitting = 1  # a layer-wise batch token still held: not ready
    assert not completion.success.try_succeed(room, seen_done=True)
    assert not room.concluded
    room.submitting = 0
    assert completion.success.try_succeed(room, seen_done=True)
    assert not completion.success.try_succeed(room, seen_done=True)
    assert statuses_sent(p) == [(("10.0.0.2", 5000), S.SUCCESS, AUX)]
