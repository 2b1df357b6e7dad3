"""Decode cannot reach a room's bootstrap server from the start, while the other rooms are served.

Some receivers on decode are created with a bootstrap address where nothing listens (as if the
prefill's bootstrap server never started, or the address is wrong). Decode is driven the way
SGLang's decode scheduler drives it (DecodePreallocQueue._ensure_prefill_info): one
`try_ensure_parallel_info` per address at most every second, and after 15 failed attempts every
request waiting on that address is aborted. One session, one decode server:

1. baseline;
2. four rooms point at the unreachable address, four at the live one, in the same round: the live
   rooms succeed byte-exact while the others still wait (decode is not blocked by them); the
   unreachable rooms fail on decode within the scheduler's bound, with a reason naming the
   bootstrap server and the attempts (not just "Aborted by AbortReq."), having never sent
   metadata or received a byte; prefill, which got the same requests, fails them by its bootstrap
   timeout, with a reason;
3. a follow-up round succeeds byte-exact: the decode server keeps serving.

At the end no manager holds anything (the per-address failure count included), no write landed
after decode released a page, and every worker still answers.
"""

from __future__ import annotations

import re

from reliability_support import SLACK_S, Session, check_end, outcomes, reliability_config, run_session

from harness.pd.run import KVLayout, RoomShape
from harness.pd.results import FAILED, SUCCESS

ROUNDS = (4, 8, 6)
BASE, UNREACHABLE, FOLLOW_UP = range(3)
DEAD = tuple(i for i in range(4, 12) if i % 2 == 0)  # half of round 1
# SGLang's DecodePreallocQueue: _max_ensure_retries = 15, _ensure_retry_interval = 1.0 s.
ENSURE_ATTEMPTS, ENSURE_RETRY_S = 15, 1.0
ENSURE_BOUND_S = ENSURE_ATTEMPTS * ENSURE_RETRY_S
BOOTSTRAP_TIMEOUT_S = 6


def test_unreachable_bootstrap_fails_its_rooms_in_bounded_time_and_decode_keeps_serving():
    cfg = reliability_config(
        rooms=sum(ROUNDS),
        rounds=ROUNDS,
        layout=KVLayout(num_layers=2, total_kv_heads=4, head_dim=32, page_size=16),
        shape=RoomShape(min_tokens=32, max_tokens=128, chunks=2),
        unreachable_bootstrap=DEAD,
        ensure_max_attempts=ENSURE_ATTEMPTS,
        ensure_retry_s=ENSURE_RETRY_S,
        env={"SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": str(BOOTSTRAP_TIMEOUT_S)},
    )
    def steps(s: Session) -> None:
        s.wait_done(BASE, 60)
        s.open(UNREACHABLE)
        live = {s.plan.rooms[i].room for i in s.indices(UNREACHABLE) if i not in DEAD}
        dead = {s.plan.rooms[i].room for i in DEAD}
        # The live rooms finish on decode while the unreachable ones are still waiting there
        # (every room of the round opens in the same pass, so once the unreachable ones are in the
        # table the live ones were opened too).
        s.wait_decode(
            lambda st: dead <= set(st["status"]) and not live & set(st["status"]),
            ENSURE_BOUND_S / 2,
            "the live rooms done while the unreachable ones still wait",
        )
        s.wait_done(UNREACHABLE, ENSURE_BOUND_S + SLACK_S + 10)
        s.open(FOLLOW_UP)
        s.wait_done(FOLLOW_UP, 60)
        s.finish()

    result, s = run_session(cfg, steps)
    check_end(result, s, cfg)
    pre, dec = outcomes(result, "prefill"), outcomes(result, "decode")

    for i in range(cfg.rooms):
        if i in DEAD:
            continue
        assert pre[i].status == SUCCESS and dec[i].status == SUCCESS, (i, pre[i].failure, dec[i].failure)
    live_done = max(dec[i].t_done for i in s.indices(UNREACHABLE) if i not in DEAD)
    for i in DEAD:
        d, p = dec[i], pre[i]
        assert d.status == FAILED, (i, d.status_name, d.failure)
        assert re.search(r"bootstrap server 127\.0\.0\.1:\d+ unreachable: \d+ attempts", d.failure), d.failure
        assert d.t_done - d.t_open <= ENSURE_BOUND_S + SLACK_S, (i, d.t_open, d.t_done)
        assert d.t_done > live_done, (i, d.t_done, live_done)  # the live rooms did not wait for it
        assert d.t_sent is None and d.release is None, (i, d.t_sent, d.release)  # never got pages
        assert p.status == FAILED and p.failure, (i, p.status_name, p.failure)
        assert p.t_done - p.t_open <= BOOTSTRAP_TIMEOUT_S + SLACK_S, (i, p.t_open, p.t_done)
