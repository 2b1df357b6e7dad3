"""Prefill side of a harness run: one KVSender per room, driven in the order SGLang's prefill
scheduler uses (disaggregation/prefill.py):

1. construct the sender (bootstrap queue);
2. poll until WaitingForInput, then `pop_decode_prefix_len()` and `init(num_pages, aux_index)`
   (finalize_bootstrap);
3. per prefill chunk: honour `get_max_transfer_tokens()` by splitting into segments, ask
   `should_send_kv_chunk(n_pages, last)`, then `send(page_indices, state_indices on the very last
   segment only, num_kv_tokens=...)` (send_kv_chunk);
4. poll until Success or Failed; on Success `get_transfer_metric()` and `clear()`, on Failed
   `failure_exception()` (which clears) and keep its text (process_disagg_prefill_inflight_queue).

With DP attention each prefill DP rank runs only the rooms routed to it (plan.RoomPlan.prefill_dp);
with cfg.prefill_dp_routing == "explicit" the sender is told the request names its DP rank. With
PP every stage runs every room of its DP rank (SGLang's stages share the request's pages), each
acting on its own polls.

Rooms listed in cfg.prefill_abort get `abort()` right after their last send, as the scheduler
does for an AbortReq that finds the request in its inflight queue.

What the harness leaves out: the TP all-reduce of poll results (each rank here acts on its own
polls; statuses can only converge later, never earlier) and the forward passes between chunks.
"""

from __future__ import annotations

from typing import Callable, List

import numpy as np

from harness.pd.loop import RoomState, drive
from harness.pd.plan import Plan
from harness.pd.pool import RankPool
from harness.pd.results import FAILED, SUCCESS, WAITING_FOR_INPUT, RoomOutcome


def run_prefill_rooms(
    pool: RankPool,
    plan: Plan,
    mgr,
    sender_cls,
    bootstrap_addr: str,
    clock: Callable[[], float],
    deadline: float,
    on_pass=None,
    may_open=None,
    rooms=None,
) -> List[RoomOutcome]:
    """Run `rooms` (default: every room of the plan): with DP attention, this rank's DP rank's."""
    cfg = pool.cfg
    # The router named the prefill DP rank (req.disagg_prefill_dp_rank): the sender skips
    # SGLang's follow_bootstrap_room check and the DP-rank registration.
    explicit_dp = cfg.prefill_dp > 1 and cfg.prefill_dp_routing == "explicit"
    ps = cfg.layout.page_size
    aborts = set(cfg.prefill_abort)
    successes = [0]

    def open_room(room) -> RoomState:
        st = RoomState(room, clock())
        st.sender = sender_cls(
            mgr=mgr,
            bootstrap_addr=bootstrap_addr,
            bootstrap_room=room.room,
            req_has_disagg_prefill_dp_rank=explicit_dp,
        )
        st.phase = "bootstrap"
        st.next_chunk = 0
        return st

    def fail(st: RoomState) -> None:
        try:
            st.sender.failure_exception()
            msg = "failure_exception() returned without raising"
        except Exception as exc:  # the scheduler catches everything here too
            msg = f"{type(exc).__name__}: {exc}"
        st.finish(FAILED, clock(), msg)

    def send_chunk(st: RoomState) -> None:
        room = st.plan
        first, end = room.chunks[st.next_chunk]
        last_chunk = st.next_chunk == len(room.chunks) - 1
        pages = room.prefill_pages[first:end]
        max_tokens = st.sender.get_max_transfer_tokens()
        step = max(1, len(pages) if not max_tokens else max_tokens // ps)
        segments = [pages[i : i + step] for i in range(0, len(pages), step)] or [pages]
        tokens_before = first * ps
        for k, seg in enumerate(segments):
            seg_last = last_chunk and k == len(segments) - 1
            seg_tokens = max(0, min(tokens_before + len(seg) * ps, room.tokens) - tokens_before)
            tokens_before += len(seg) * ps
            if not st.sender.should_send_kv_chunk(len(seg), seg_last):
                continue
            state = pool.state_indices(room.prefill_state) if seg_last else None
            st.sender.send(np.asarray(seg, dtype=np.int32), state, num_kv_tokens=seg_tokens)
        st.next_chunk += 1
        if last_chunk:
            st.outcome.t_sent = clock()
            st.phase = "inflight"
            if room.index in aborts and cfg.prefill_abort_trigger == "sent":
                abort(st)

    def abort(st: RoomState) -> None:
        st.sender.abort()  # the scheduler's abort of a request in its inflight queue
        st.aborted = st.outcome.aborted = True

    def step_room(st: RoomState) -> bool:
        if (
            st.phase == "inflight"
            and st.plan.index in aborts
            and not getattr(st, "aborted", False)
            and successes[0] > 0
        ):
            abort(st)
            return True
        if st.phase == "bootstrap":
            poll = st.sender.poll()
            st.outcome.last_poll = int(poll)
            if poll == WAITING_FOR_INPUT:
                st.outcome.t_ready = clock()
                room = st.plan
                # Tokens decode already holds (its prefix cache), as decode sent them.
                prefix_len = st.sender.pop_decode_prefix_len()
                if prefix_len != room.prefix_pages * ps:
                    st.outcome.failure = (
                        f"harness: pop_decode_prefix_len() returned {prefix_len}, decode sent "
                        f"{room.prefix_pages * ps}"
                    )
                st.sender.init(-(-(room.tokens - prefix_len) // ps), room.prefill_aux)
                st.phase = "sending"
                return True
            if poll == FAILED:
                fail(st)
                return True
            return False
        if st.phase == "sending":
            send_chunk(st)
            return True
        poll = st.sender.poll()
        st.outcome.last_poll = int(poll)
        if poll == SUCCESS:
            metric = st.sender.get_transfer_metric()
            st.outcome.transfer_bytes = getattr(metric, "transfer_total_bytes", None)
            st.sender.clear()
            st.finish(SUCCESS, clock())
            successes[0] += 1
            return True
        if poll == FAILED:
            fail(st)
            return True
        return False

    def expire_room(st: RoomState) -> None:
        st.sender.abort()  # what the scheduler does to a request it gives up on

    rooms = plan.rooms if rooms is None else rooms
    return drive(rooms, open_room, step_room, expire_room, cfg.max_inflight, deadline, on_pass, may_open)

