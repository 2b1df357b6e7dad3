"""Decode side of a harness run: one KVReceiver per room, driven in the order SGLang's decode
scheduler uses (disaggregation/decode.py, DecodePreallocQueue and DecodeTransferQueue):

1. construct the receiver (`_create_receiver_and_enqueue`);
2. `mgr.try_ensure_parallel_info(bootstrap_addr)` until it answers True, one attempt per address
   at most every cfg.ensure_retry_s like `_ensure_prefill_info`, then resolve the room's prefill
   DP rank as `_resolve_prefill_dp_rank` does (the router's `disagg_prefill_dp_rank` with
   cfg.prefill_dp_routing "explicit"; 0 for a DP-1 prefill; bootstrap_room % dp_size when the
   prefill follows the room id; else ask the bootstrap server, `query_prefill_dp_ranks`, for the
   waiting rooms of that address at most every cfg.ensure_retry_s) and `init(prefill_dp_rank)`. With cfg.ensure_max_attempts, after that many failed attempts on an address
   every room still waiting on it is aborted (`kv_receiver.abort()`), as SGLang's scheduler does
   after its 15 attempts; the room then polls Failed and is dropped with its failure text;
3. poll until WaitingForInput, then `send_metadata(page_indices, aux_index, state_indices,
   decode_prefix_len=0)` (`_send_kv_metadata`, no prefix cache);
4. poll until Success (then `clear()`) or Failed. Failed before send_metadata: just
   `failure_exception()`. Failed after it, as `pop_transferred` does:
   `failure_exception()`, then with deferred KV release on (SGLang's default)
   `ensure_abort_notified(force_arm=True)` and hold the room's pages until
   `mgr.is_abort_release_safe(room, len(bootstrap_infos))` or the release timeout, then
   `clear_deferred_abort_state(room)` and `clear()` (`resolve_deferred_releases`/`_do_release`).
   The pages are snapshotted at release so a write landing after it can be caught later.

Rooms listed in cfg.unreachable_bootstrap get `unreachable_addr` (nothing listens there) as their
bootstrap address instead of the live one.

Rooms listed in cfg.decode_abort are aborted while still in the pre-allocation queue (after
`init`, before `send_metadata`), like an AbortReq there. As on prefill, the TP all-reduce of poll
results is left out.
"""

from __future__ import annotations

import os
import time
from typing import Callable, Dict, List, Optional

from harness.pd.loop import RoomState, drive
from harness.pd.plan import Plan
from harness.pd.pool import RankPool
from harness.pd.results import FAILED, SUCCESS, WAITING_FOR_INPUT, RoomOutcome
from harness.pd.verify import snapshot_room

# bootstrap_room -> the attempt id of its latest receiver (ours only): a replay carries it.
ATTEMPTS: dict = {}



def _release_timeout_s() -> float:
    # SGLang's SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT (default 30 s).
    return float(os.environ.get("SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT", "30"))


def run_decode_rooms(
    pool: RankPool,
    plan: Plan,
    mgr,
    receiver_cls,
    bootstrap_addr: str,
    clock: Callable[[], float],
    deadline: float,
    on_pass=None,
    snapshots: Dict[int, object] = None,
    may_open=None,
    rooms=None,
    unreachable_addr: Optional[str] = None,
) -> List[RoomOutcome]:
    """Run `rooms` (default: every room of the plan); `snapshots` (if given) receives the pages
    of every released failed room."""
    cfg = pool.cfg
    # Per bootstrap address, as in _ensure_prefill_info: [time of the last attempt, failed attempts],
    # and the rooms still waiting on it.
    ensure: Dict[str, list] = {}
    waiting: Dict[str, List[RoomState]] = {}
    unreachable = set(cfg.unreachable_bootstrap)
    abort = set(pool.cfg.decode_abort)
    abort_inflight = set(pool.cfg.decode_abort_inflight)
    bad_pages = set(pool.cfg.bad_decode_pages)
    release_timeout = _release_timeout_s()
    # Per bootstrap address: rooms waiting for their prefill DP rank, and the last query time.
    dp_waiting: Dict[str, List[RoomState]] = {}
    dp_queried: Dict[str, float] = {}

    def prefill_dp_rank(st: RoomState) -> Optional[int]:
        """SGLang's DecodePreallocQueue._resolve_prefill_dp_rank, from what bootstrap told us."""
        info = st.mgr.prefill_info_table[st.addr]
        if cfg.prefill_dp_routing == "explicit" and cfg.prefill_dp > 1:
            return st.plan.prefill_dp  # req.disagg_prefill_dp_rank, set by the router
        if info.dp_size == 1:
            return 0
        if info.follow_bootstrap_room:
            return st.plan.room % info.dp_size
        return None

    def init_receiver(st: RoomState, dp_rank: int) -> None:
        st.receiver.init(dp_rank)
        st.phase = "handshake"
        if st.plan.index in abort:
            st.receiver.abort()

    def dp_query_step(st: RoomState) -> bool:
        """One batched /query_dp_ranks for the rooms of this room's address (decode.py
        _resolve_pending_prefill_dp_ranks), at most every cfg.ensure_retry_s."""
        addr, now = st.addr, time.monotonic()
        if now - dp_queried.get(addr, float("-inf")) < cfg.ensure_retry_s:
            return False
        dp_queried[addr] = now
        pending = dp_waiting.get(addr, [])
        answer = receiver_cls.query_prefill_dp_ranks(addr, [w.plan.room for w in pending])
        resolved = [w for w in pending if str(w.plan.room) in answer]
        for w in resolved:
            pending.remove(w)
            init_receiver(w, int(answer[str(w.plan.room)]))
        return bool(resolved)

    def open_room(room) -> RoomState:
        st = RoomState(room, clock())
        # A receiver stays bound to the manager it was made with (mgr may be a ManagerRef that a
        # restart_engine re-points; see pd/control.py).
        st.mgr = getattr(mgr, "current", mgr)
        st.addr = unreachable_addr if room.index in unreachable else bootstrap_addr
        if st.addr is None:
            raise ValueError("rooms with an unreachable bootstrap address need unreachable_addr")
        st.receiver = receiver_cls(mgr=st.mgr, bootstrap_addr=st.addr, bootstrap_room=room.room)
        if getattr(st.receiver, "attempt", None) is not None:
            ATTEMPTS[room.room] = st.receiver.attempt  # for tests that replay decode's messages
        st.phase = "ensure"
        waiting.setdefault(st.addr, []).append(st)
        return st

    def ensure_step(st: RoomState) -> bool:
        """One scheduler pass of the pre-allocation queue for this room's address."""
        addr = st.addr
        now = time.monotonic()
        last, attempts = ensure.get(addr, (None, 0))
        if last is not None and now - last < cfg.ensure_retry_s:
            return False
        if st.mgr.try_ensure_parallel_info(addr):
            ensure.pop(addr, None)  # cached now: the other rooms of this address pass at once
            waiting[addr].remove(st)
            dp_rank = prefill_dp_rank(st)
            if dp_rank is None:
                st.phase = "dp_query"
                dp_waiting.setdefault(addr, []).append(st)
                return dp_query_step(st)
            init_receiver(st, dp_rank)
            return True
        attempts += 1
        if cfg.ensure_max_attempts and attempts >= cfg.ensure_max_attempts:
            # SGLang: "Could not fetch prefill parallel info from <addr> after N attempts" -- abort
            # every request still waiting on the address; each then polls Failed.
            ensure.pop(addr, None)
            for other in waiting.pop(addr, []):
                other.receiver.abort()
                other.phase = "handshake"
            return True
        ensure[addr] = [now, attempts]
        return False

    def fail(st: RoomState) -> None:
        try:
            st.receiver.failure_exception()
            msg = "failure_exception() returned without raising"
        except Exception as exc:
            msg = f"{type(exc).__name__}: {exc}"
        out = st.outcome
        out.status, out.failure, out.t_done = FAILED, msg, clock()
        if st.phase != "transfer":
            # Still pre-allocating (no pages handed out, no metadata sent): the scheduler just
            # drops the request (_update_handshake_waiters); nothing to hold.
            st.done = True
            return
        rcv = st.receiver
        st.required_acks = 0
        if getattr(st.mgr, "enable_deferred_decode_kv_release", False):
            if not rcv.abort_notified:
                rcv.ensure_abort_notified(force_arm=True)
            if rcv.abort_notified:
                st.required_acks = len(getattr(rcv, "bootstrap_infos", None) or [])
        st.release_deadline = time.monotonic() + release_timeout
        st.phase = "release"

    def release(st: RoomState) -> bool:
        room = st.plan.room
        if st.mgr.is_abort_release_safe(room, st.required_acks):
            st.outcome.release = "acked" if st.required_acks else "unarmed"
        elif time.monotonic() >= st.release_deadline:
            st.outcome.release = "timeout"
        else:
            return False
        if hasattr(st.mgr, "clear_deferred_abort_state"):
            st.mgr.clear_deferred_abort_state(room)
        st.receiver.clear()
        st.outcome.t_released = clock()
        if snapshots is not None:
            snapshots[st.plan.index] = snapshot_room(pool, st.plan)
        st.done = True
        return True

    def step_room(st: RoomState) -> bool:
        if st.phase == "ensure":
            return ensure_step(st)
        if st.phase == "dp_query":
            return dp_query_step(st)
        if st.phase == "release":
            return release(st)
        poll = st.receiver.poll()
        st.outcome.last_poll = int(poll)
        if st.phase == "handshake":
            if poll == WAITING_FOR_INPUT:
                st.outcome.t_ready = clock()
                room = st.plan
                pages = room.decode_pages[room.decode_prefix_pages :]  # after decode's cached prefix
                if room.index in bad_pages:  # a page past the end of the pool
                    pages = pages.copy()
                    pages[-1] = plan.decode_pool_pages + 7
                st.receiver.send_metadata(
                    pages,
                    room.decode_aux,
                    pool.state_indices(room.decode_state),
                    decode_prefix_len=room.prefix_pages * pool.cfg.layout.page_size,
                )
                st.outcome.t_sent = clock()
                st.phase = "transfer"
                return True
            if poll == SUCCESS:
                st.finish(FAILED, clock(), "harness: poll() returned Success before send_metadata()")
                return True
        if st.phase == "transfer" and st.plan.index in abort_inflight and poll not in (SUCCESS, FAILED):
            if not getattr(st, "aborted_inflight", False) and _transfer_started(st):
                st.receiver.abort()  # an AbortReq for a request whose KV is arriving
                st.aborted_inflight = True  # (the room stays in "transfer": its pages are held)
                return True
        if poll == SUCCESS:
            st.receiver.clear()
            st.finish(SUCCESS, clock())
            return True
        if poll == FAILED:
            fail(st)
            return True
        return False

    def expire_room(st: RoomState) -> None:
        if st.phase == "release":
            st.outcome.release = "held at the run deadline"
        else:
            st.receiver.abort()

    rooms = plan.rooms if rooms is None else rooms
    return drive(rooms, open_room, step_room, expire_room, pool.cfg.max_inflight, deadline, on_pass, may_open)


def _transfer_started(st: RoomState) -> bool:
    """mori: prefill said it submitted a chunk of the room (TransferStarted); other backends
    give no such signal, so any time after send_metadata counts. A room's last chunk announces only
    if its writes still run after SGLANG_MORI_ANNOUNCE_GRACE_MS: a quick single-chunk room never
    gives this signal (it just succeeds), so the tests that abort mid-transfer hold the writes in
    flight (stalled lanes, a bandwidth cap) and the signal comes once the grace passed."""
    parts = getattr(getattr(st.mgr, "service", None), "p", None)
    if parts is None:
        return True
    room = parts.rooms.get(st.plan.room)
    return room is not None and room.started_at is not None
