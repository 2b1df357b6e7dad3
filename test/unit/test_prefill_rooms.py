"""The prefill room state machine and its registry (backend/prefill/rooms.py), with fake time.

Covers every transition, the verdict over a room's writes (deadlines per write, failure wins),
drain proofs, replay detection by attempt id (never by "finished recently"), the next life of a
room id queued behind a running one (retract-rebootstrap), early aborts and pruning.
"""

import numpy as np
import pytest

from sglang_mori.backend.prefill import rooms as R
from sglang_mori.engine.transfer_engine import (
    ERR_NOT_FOUND,
    ERR_RDMA_OP,
    IN_PROGRESS,
    INIT,
    SUCCESS,
    TransferHandle,
    WriteState,
)


from fake_mori_io import Status  # mori.io's TransferStatus, as the backend reads it


def handle(*codes, peer="decode-A", started_at=100.0, **kw):
    live = [c if isinstance(c, Status) else Status(c) for c in codes]
    return TransferHandle(peer_key=peer, nbytes=64, live=live, issued=list(live), started_at=started_at, **kw)


def target(key="decode-A", attempt=11, required=1, dummy=False):
    return R.RoomTarget(engine_key=key, attempt=attempt, endpoint="127.0.0.1", dst_port=17000,
                        kv_indices=np.arange(4), aux_index=0, state_indices=None, required_dst_info_num=required,
                        decode_prefix_len=None, is_dummy=dummy)


def room_with(*handles_and_deadlines):
    r = R.PrefillRoom(room=5, created_at=0.0, sender=R.Sender.HELD)
    r.add_target(target())
    assert r.begin_submit()
    r.end_submit([R.TrackedWrite(h, d) for h, d in handles_and_deadlines], last_chunk=True, aux_index=0)
    return r


# --- verdict (moved from the RoomTransfer tests) ---------------------------------------------------

def test_verdict_success_and_empty():
    assert room_with((handle(SUCCESS, SUCCESS), 200.0), (handle(SUCCESS), 201.0)).verdict(150.0) == (
        WriteState.SUCCEEDED, "")
    assert room_with().verdict(0.0) == (WriteState.SUCCEEDED, "")


def test_verdict_in_progress_until_past_the_deadline():
    r = room_with((handle(SUCCESS), 200.0), (handle(SUCCESS, IN_PROGRESS), 200.0))
    assert r.verdict(150.0) == (WriteState.RUNNING, "")
    assert r.verdict(200.0) == (WriteState.RUNNING, "")  # at the deadline, not past it


def test_verdict_success_after_deadline_is_still_success():
    assert room_with((handle(SUCCESS), 110.0)).verdict(500.0) == (WriteState.SUCCEEDED, "")


def test_verdict_failure_wins_over_in_progress():
    r = room_with((handle(IN_PROGRESS), 200.0), (handle(Status(ERR_NOT_FOUND, "no session"), Status(IN_PROGRESS)), 200.0))
    assert r.verdict(150.0) == (WriteState.FAILED, "KV transfer to decode engine decode-A failed: code 12: no session")


def test_verdict_init_is_failure():
    r = room_with((handle(Status(SUCCESS), Status(INIT, "not posted")), 200.0))
    assert r.verdict(150.0) == (WriteState.FAILED, "KV transfer to decode engine decode-A failed: code 1: not posted")


def test_verdict_deadlines_are_per_write():
    early_done = handle(SUCCESS, started_at=100.0)
    late_running = handle(IN_PROGRESS, peer="decode-late", started_at=140.0)
    r = room_with((early_done, 130.0), (late_running, 170.0))
    assert r.verdict(160.0) == (WriteState.RUNNING, "")
    state, reason = r.verdict(170.5)
    assert state is WriteState.FAILED
    assert reason == ("KV transfer to decode engine decode-late timed out: not complete after 30500 ms "
                      "(SGLANG_MORI_TRANSFER_TIMEOUT_MS)")


def test_unfinished_and_outstanding():
    running, unaccounted, done, never_posted = (handle(SUCCESS, IN_PROGRESS), handle(SUCCESS, unaccounted=True),
                                                handle(SUCCESS), handle(INIT))
    r = room_with((running, 1.0), (done, 1.0), (unaccounted, 1.0), (never_posted, 1.0))
    assert r.unfinished() == [running, unaccounted] and r.outstanding() == 2
    running.live[1].code = SUCCESS
    assert r.unfinished() == [unaccounted]
    assert r.begin_submit()  # a submitter at work counts as outstanding
    assert r.outstanding() == 2


# --- transitions ---------------------------------------------------------------------------------

def test_phases_of_a_successful_room():
    r = R.PrefillRoom(room=1, created_at=0.0)
    assert r.phase is R.Phase.AWAITING_METADATA
    assert not r.add_target(target("d0", required=2))
    assert r.add_target(target("d1", required=2)) and r.phase is R.Phase.READY
    assert not r.begin_submit()  # nobody claimed it: no writes
    r.sender = R.Sender.HELD
    assert r.begin_submit() and r.phase is R.Phase.SUBMITTING
    w = handle(IN_PROGRESS)
    r.end_submit([R.TrackedWrite(w, 10.0)], last_chunk=True, aux_index=3)
    assert r.last_submitted and r.aux_index == 3
    assert r.try_finish(5.0, 100.0) is None  # not concluded
    assert r.conclude(True, None, now=5.0) and not r.conclude(False, "late", now=6.0)
    assert r.try_finish(5.0, 100.0) is None  # its write still runs
    w.live[0].code = SUCCESS
    assert r.try_finish(6.0, 100.0) is R.Phase.DRAINED and r.terminal


def test_adding_a_destination_after_ready_is_a_bug():
    r = R.PrefillRoom(room=1, created_at=0.0)
    r.add_target(target())
    with pytest.raises(R.RoomStateError, match="room 1: cannot add a destination in phase ready"):
        r.add_target(target("other"))


def test_a_failed_write_that_may_have_posted_poisons_the_room():
    w = handle(ERR_RDMA_OP)
    r = room_with((w, 10.0))
    r.conclude(False, "lane broke", now=1.0)
    assert r.try_finish(2.0, 100.0) is R.Phase.POISONED


def test_a_write_refused_before_posting_drains():
    r = room_with((handle(INIT), 10.0))
    r.conclude(False, "refused", now=1.0)
    assert r.try_finish(2.0, 100.0) is R.Phase.DRAINED


def test_writes_running_past_the_give_up_time_poison():
    r = room_with((handle(IN_PROGRESS), 10.0))
    r.conclude(False, "timeout", now=1.0)
    assert r.try_finish(50.0, 100.0) is None
    assert r.try_finish(101.5, 100.0) is R.Phase.POISONED


def test_a_submitter_at_work_holds_the_room_open():
    r = R.PrefillRoom(room=5, created_at=0.0, sender=R.Sender.HELD)
    r.add_target(target())
    assert r.begin_submit()
    r.conclude(False, "Aborted by decode", now=1.0)
    assert r.try_finish(2.0, 100.0) is None  # an abort cannot be ACKed under a submitter
    late = handle(IN_PROGRESS)
    r.end_submit([R.TrackedWrite(late, 10.0)], last_chunk=True, aux_index=9)
    assert not r.last_submitted  # concluded meanwhile: no success from a late last chunk
    assert r.try_finish(2.0, 100.0) is None
    late.live[0].code = SUCCESS
    assert r.try_finish(3.0, 100.0) is R.Phase.DRAINED


# --- registry ------------------------------------------------------------------------------------

def test_metadata_before_the_sender_then_claim():
    reg = R.PrefillRoomRegistry()
    out = reg.add_target(target(attempt=1), room=7, now=0.0)
    assert out.verdict is R.MetadataVerdict.ACCEPTED and out.ready and not out.room.claimed
    r = reg.claim(7, now=1.0)
    assert r is out.room and r.claimed and r.phase is R.Phase.READY


def test_duplicate_metadata_is_a_replay():
    reg = R.PrefillRoomRegistry()
    reg.add_target(target(attempt=1), room=7, now=0.0)
    out = reg.add_target(target(attempt=1), room=7, now=0.5)
    assert out.verdict is R.MetadataVerdict.REPLAY


def test_finished_attempts_are_replays_and_new_attempts_start_a_new_life():
    """Retract-rebootstrap: the same room id, a new attempt, within a second of the first life."""
    reg = R.PrefillRoomRegistry()
    reg.add_target(target(attempt=1), room=7, now=0.0)
    r = reg.claim(7, now=0.0)
    r.conclude(True, None, now=0.2)
    with reg.lock:
        reg.release_sender(7, now=0.3)
    assert reg.get(7) is None
    assert reg.add_target(target(attempt=1), room=7, now=0.4).verdict is R.MetadataVerdict.REPLAY
    out = reg.add_target(target(attempt=2), room=7, now=0.5)
    assert out.verdict is R.MetadataVerdict.ACCEPTED and out.ready and out.room is not r
    # ...and remembered attempts expire (bounded memory).
    assert not reg.finished_attempt(1, now=0.3 + R.FINISHED_ATTEMPTS_TTL_S + 1)


def test_a_new_attempt_while_the_life_runs_waits_for_the_next_life():
    reg = R.PrefillRoomRegistry()
    reg.add_target(target(attempt=1), room=7, now=0.0)
    r = reg.claim(7, now=0.0)
    assert r.begin_submit()
    out = reg.add_target(target(attempt=2), room=7, now=0.9)
    assert out.verdict is R.MetadataVerdict.REJECTED and "serving another attempt" in out.detail  # live: never re-target
    r.conclude(False, "Aborted by decode", now=0.95)  # decode aborted attempt 1 first
    out = reg.add_target(target(attempt=2), room=7, now=1.0)
    assert out.verdict is R.MetadataVerdict.QUEUED_NEXT_LIFE
    assert reg.add_target(target(attempt=2), room=7, now=1.1).verdict is R.MetadataVerdict.REPLAY
    running = handle(IN_PROGRESS)
    r.end_submit([R.TrackedWrite(running, 10.0)], last_chunk=True, aux_index=0)
    with reg.lock:
        ended = reg.release_sender(7, now=2.0)
    assert ended is r and r.concluded and not r.succeeded
    assert reg.draining_lives(7) == [r]  # its write still drains, aside
    assert reg.open_count() == 2  # the open-rooms gauge counts the draining life too
    fresh = reg.get(7)
    assert fresh is not r and fresh.phase is R.Phase.READY and fresh.targets["decode-A"].attempt == 2
    assert not reg.owns_sglang_state(fresh)  # nobody claimed it yet: SGLang holds nothing for it
    assert reg.claim(7, now=2.5) is fresh and reg.owns_sglang_state(fresh) and not reg.owns_sglang_state(r)
    assert reg.with_writes() == [r]
    running.live[0].code = SUCCESS
    # A failed life whose every write succeeded proves its drain: decode may reuse the pages.
    assert r.try_finish(3.0, 100.0) is R.Phase.DRAINED
    assert reg.forget_if_done(r) and reg.draining_lives(7) == []
    assert reg.open_count() == 1


def test_abort_before_the_request_arrives_fails_its_sender_later():
    reg = R.PrefillRoomRegistry()
    life, known = reg.abort_attempt(9, attempt=5, now=0.0)
    assert life is None and not known
    r = reg.open(9, now=0.0)
    r.conclude(False, "Aborted by decode before the request reached prefill", now=0.0)
    assert r.try_finish(0.1, 100.0) is R.Phase.DRAINED
    assert reg.forget_if_done(r) is False  # stays until a sender claims it or it is pruned
    claimed = reg.claim(9, now=1.0)
    assert claimed is r and r.reason.startswith("Aborted by decode")


def test_abort_of_a_finished_attempt_changes_nothing():
    reg = R.PrefillRoomRegistry()
    reg.add_target(target(attempt=1), room=7, now=0.0)
    reg.claim(7, now=0.0).conclude(True, None, now=0.1)
    with reg.lock:
        reg.release_sender(7, now=0.2)
    assert reg.abort_attempt(7, attempt=1, now=0.3) == (None, True)


def test_abort_of_a_queued_attempt_drops_it():
    reg = R.PrefillRoomRegistry()
    reg.add_target(target(attempt=1), room=7, now=0.0)
    r = reg.claim(7, now=0.0)
    r.conclude(False, "x", now=0.1)
    reg.add_target(target(attempt=2), room=7, now=0.2)
    assert reg.abort_attempt(7, attempt=2, now=0.3) == (None, True)
    assert r.next_life == {}


def test_prune_unclaimed_only_rooms_nobody_claimed():
    reg = R.PrefillRoomRegistry()
    reg.add_target(target(attempt=1), room=1, now=0.0)
    reg.add_target(target(attempt=2), room=2, now=0.0)
    reg.claim(2, now=0.0)
    assert [r.room for r in reg.prune_unclaimed(now=10.0, ttl_s=30.0)] == []
    assert [r.room for r in reg.prune_unclaimed(now=31.0, ttl_s=30.0)] == [1]
    assert reg.get(1) is None and reg.get(2) is not None


def test_waits_only_without_news():
    reg = R.PrefillRoomRegistry()
    seen = reg.generation
    reg.notify()
    reg.wait_for_change(seen, 30.0)  # a notify since `seen`: returns at once (else this test hangs 30 s)
    assert reg.generation == seen + 1
