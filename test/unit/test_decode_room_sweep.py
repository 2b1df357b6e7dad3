"""The decode registry's deadline sweep (rooms.expired) looks at the transferring rooms only: under
load most rooms await prefill (their receivers' metadata is out), and the status thread sweeps
every SGLANG_MORI_WAIT_POLL_MS under the registry lock (issue 28: the decode step loop)."""

from __future__ import annotations

from sglang_mori.backend.decode.rooms import DecodeRoomRegistry


def _registry():
    reg = DecodeRoomRegistry()
    for room in range(1000):
        reg.open(room)  # awaiting prefill
    return reg


def test_the_sweep_reports_a_late_transferring_room_once_and_nothing_else():
    reg = _registry()
    a = reg.attempt_of(1)
    assert reg.transfer_started(1, a, now=10.0)
    assert reg.transfer_started(2, reg.attempt_of(2), now=10.0)
    assert reg.transfer_started(3, reg.attempt_of(3), now=10.0)
    assert reg.finish(2, ok=True)  # concluded: out of the sweep
    reg.forget(3)  # cleared: out of the sweep
    assert reg.expired(now=15.0, deadline_s=10.0) == []  # not late yet
    late = reg.expired(now=21.0, deadline_s=10.0)
    assert [(r.room, r.attempt) for r in late] == [(1, a)]
    assert reg.expired(now=22.0, deadline_s=10.0) == []  # reported once per deadline
    assert [r.room for r in reg.expired(now=32.0, deadline_s=10.0)] == [1]


def test_a_new_receiver_of_the_room_takes_it_out_of_the_sweep():
    reg = _registry()
    assert reg.transfer_started(5, reg.attempt_of(5), now=0.0)
    reg.open(5)  # a retraction's new receiver: awaiting prefill again
    assert reg.expired(now=100.0, deadline_s=10.0) == []
    # and its own transfer is swept again
    assert reg.transfer_started(5, reg.attempt_of(5), now=100.0)
    assert [r.room for r in reg.expired(now=111.0, deadline_s=10.0)] == [5]


def test_the_sweep_walks_only_the_transferring_rooms():
    reg = _registry()
    assert reg.transfer_started(7, reg.attempt_of(7), now=0.0)
    # (what the sweep iterates: the 999 rooms awaiting prefill are not in it; before this
    # index, expired() walked all 1000 rooms on every sweep)
    assert list(reg._transferring) == [7]
    assert reg.finish(7, ok=False)
    assert list(reg._transferring) == []
    assert len(reg) == 1000
