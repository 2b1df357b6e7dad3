"""The completion thread returns every write's in-flight budget once the room finishes, also for a
write that turns terminal between its release pass and the room's drain check (the soak's
`inflight: 1` leftover: the slot of such a write was never given back)."""

from types import SimpleNamespace

from sglang_mori.backend.peers import InflightBudget
from sglang_mori.backend.prefill.completion import Completion
from sglang_mori.backend.prefill.effects import RoomEffects
from sglang_mori.backend.prefill.rooms import Outcome, Phase, PrefillRoom, PrefillRoomRegistry, Sender, TrackedWrite
from sglang_mori.config import MoriConfig
from sglang_mori.engine import WriteState
from sglang_mori.metrics import NullTransferMetrics

PEER = "decode-engine"


class LateHandle:
    """A succeeded write whose completion becomes visible only after the first look."""

    def __init__(self):
        self.released = False
        self.peer_key = PEER
        self.nbytes = 4096
        self.started_at = 0.0
        self.looks = 0

    def quiescent(self) -> bool:
        self.looks += 1
        return self.looks > 1

    def state(self):
        return WriteState.SUCCEEDED if self.looks > 1 else WriteState.RUNNING

    def drained(self) -> bool:
        return self.looks > 1


class FakeSGLang:
    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return lambda *args: self.calls.append((name, args))


def parts():
    return SimpleNamespace(config=MoriConfig(), peers=SimpleNamespace(budget=InflightBudget(4)),
                           metrics=NullTransferMetrics(), sglang=FakeSGLang(), rooms=PrefillRoomRegistry(),
                           timeout_s=30.0, clock=lambda: 1.0, engine=SimpleNamespace(can_fence=False))


def test_a_write_that_finishes_during_the_pass_still_returns_its_budget():
    p = parts()
    assert p.peers.budget.acquire(PEER, deadline=10.0)
    handle = LateHandle()
    room = PrefillRoom(room=7, created_at=0.0, phase=Phase.CONCLUDED, sender=Sender.HELD, outcome=Outcome.SUCCEEDED,
                       writes=[TrackedWrite(handle, 30.0)])
    completion = Completion(p, RoomEffects(p), failures=None, on_peer_failed=None)
    completion.advance(room, now=1.0)
    assert room.phase is Phase.DRAINED
    assert handle.released
    assert p.peers.budget.count(PEER) == 0
