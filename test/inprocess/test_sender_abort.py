"""MoriKVSender.abort() as SGLang 0.5.23's scheduler calls it: for a request aborted in the waiting
queue or a running batch, abort() and never clear(). The room's life must end there (no room
left open for good), and a later clear() of the same sender must not end a newer life of the
room id. Real service and engines (the PrefillRig); SGLang's kv_mgr is a thin adapter over the
rig's fake SGLang tables."""

from types import SimpleNamespace


from sglang_mori import protocol
from sglang_mori.backend import room_status as S
from sglang_mori.backend.sender import MoriKVSender



class KvMgrOverRig:
    """The CommonKVManager members CommonKVSender.abort()/clear() touch, over the rig's tables."""

    deferred_bootstrap = None
    _staging_ctx = None

    def __init__(self, rig):
        self.service = rig.service
        self._sglang = rig.sglang
        self.request_status, self.req_to_decode_prefix_len, self.transfer_infos = {}, {}, {}

    def record_failure(self, room, reason):
        self._sglang.fail(room, reason)

    def update_status(self, room, status):
        self.request_status[room] = status

    def _maybe_ack_drained_abort(self, room):
        pass


def sender_for(rig, room: int) -> MoriKVSender:
    """The scheduler's sender of an already claimed room (SGLang's constructor needs a whole
    manager; the claim is done by the rig, as MoriKVSender.__init__ would)."""
    sender = object.__new__(MoriKVSender)
    sender.kv_mgr, sender.bootstrap_room, sender.conclude_state = KvMgrOverRig(rig), room, None
    sender.trace_ctx = SimpleNamespace(abort=lambda **_: None, trace_req_finish=lambda: None)
    return sender


def test_abort_without_clear_ends_the_room_life(rig):
    rig.new_attempt(30)
    rig.metadata(30, pages=[4, 5])
    assert rig.claim(30) is None
    sender = sender_for(rig, 30)
    sender.abort()
    assert rig.sglang.status(30) == S.FAILED
    (failed,) = rig.messenger.of_type(protocol.RoomStatus, 30)
    assert failed.status == S.FAILED  # decode is told now, not at its deadline
    rig.wait_idle()  # nothing left open: no room, no write, nothing queued
    assert rig.service.p.rooms.get(30) is None


def test_a_later_clear_of_the_aborted_sender_leaves_the_next_life_alone(rig):
    rig.new_attempt(31)
    rig.metadata(31, pages=[6])
    rig.claim(31)
    old = sender_for(rig, 31)
    old.abort()
    rig.wait_idle()
    # A new request reuses the room id before SGLang gets round to clearing the old sender.
    rig.sglang.clear(31)
    rig.new_attempt(31)
    rig.metadata(31, pages=[7])
    assert rig.claim(31) is None
    life = rig.service.p.rooms.get(31)
    old.clear()
    assert rig.service.p.rooms.get(31) is life
    rig.send(31, pages=[2], last=True)
    rig.wait_status(31, S.SUCCESS)
    assert rig.decode.page(0, 7) == rig.prefill.page(0, 2)


def test_abort_of_a_sender_that_does_not_own_the_room_changes_nothing(rig):
    rig.new_attempt(32)
    rig.metadata(32, pages=[8])
    rig.claim(32)
    sender = sender_for(rig, 32)
    sender.kv_mgr.deferred_bootstrap = object()  # SGLang's deferred bootstrap: another sender owns it
    sender._owns_bootstrap_room = False
    sender.abort()
    assert rig.service.p.rooms.get(32) is not None and rig.sglang.status(32) != S.FAILED
