"""Decode side of a harness run: one KVReceiver per room, driven in the order SGLang's decode
scheduler uses (disaggregation/decode.py, DecodePreallocQueue and DecodeTransferQueue):

1. construct the receiver (`_create_receiver_and_enqueue`);
2. `mgr.try_ensure_parallel_info(bootstrap_addr)` until it answers True, retried at most every
   RETRY_S like `_ensure_prefill_info`, then `init(prefill_dp_rank=0)` (a DP-1 prefill);
3. poll until WaitingForInput, then `send_metadata(page_indices, aux_index, state_indices,
   decode_prefix_len=0)` (`_send_kv_metadata`, no prefix cache);
4. poll until Success (then `clear()`) or Failed (then `failure_exception()`, which clears).

As on prefill, the TP all-reduce of poll results is left out.
"""

from __future__ import annotations

import time
from typing import Callable, List

from sglang_mori.testing.pd_harness_loop import RoomState, drive
from sglang_mori.testing.pd_harness_plan import Plan
from sglang_mori.testing.pd_harness_pool import RankPool
from sglang_mori.testing.pd_harness_results import FAILED, SUCCESS, WAITING_FOR_INPUT, RoomOutcome

RETRY_S = 0.05


def run_decode_rooms(
    pool: RankPool,
    plan: Plan,
    mgr,
    receiver_cls,
    bootstrap_addr: str,
    clock: Callable[[], float],
    deadline: float,
    on_pass=None,
) -> List[RoomOutcome]:
    last_ensure = [0.0]

    def open_room(room) -> RoomState:
        st = RoomState(room, clock())
        st.receiver = receiver_cls(mgr=mgr, bootstrap_addr=bootstrap_addr, bootstrap_room=room.room)
        st.phase = "ensure"
        return st

    def fail(st: RoomState) -> None:
        try:
            st.receiver.failure_exception()
            msg = "failure_exception() returned without raising"
        except Exception as exc:
            msg = f"{type(exc).__name__}: {exc}"
        st.finish(FAILED, clock(), msg)

    def step_room(st: RoomState) -> bool:
        if st.phase == "ensure":
            now = time.monotonic()
            if now - last_ensure[0] < RETRY_S:
                return False
            last_ensure[0] = now
            if not mgr.try_ensure_parallel_info(bootstrap_addr):
                return False
            last_ensure[0] = 0.0  # cached now: the other rooms pass at once
            st.receiver.init(0)
            st.phase = "handshake"
            return True
        poll = st.receiver.poll()
        st.outcome.last_poll = int(poll)
        if st.phase == "handshake":
            if poll == WAITING_FOR_INPUT:
                st.outcome.t_ready = clock()
                room = st.plan
                st.receiver.send_metadata(
                    room.decode_pages,
                    room.decode_aux,
                    pool.state_indices(room.decode_state),
                    decode_prefix_len=0,
                )
                st.outcome.t_sent = clock()
                st.phase = "transfer"
                return True
            if poll == SUCCESS:
                st.finish(FAILED, clock(), "harness: poll() returned Success before send_metadata()")
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
        st.receiver.abort()

    return drive(plan.rooms, open_room, step_room, expire_room, pool.cfg.max_inflight, deadline, on_pass)
