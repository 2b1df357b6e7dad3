"""A decode server dies mid-transfer, then the bootstrap server does, while the survivors serve.

One prefill, two decode servers (rooms alternate between them), one session:

1. baseline;
2. decode server 1 is killed (SIGKILL) while its writes are on the wire (its lanes held): prefill
   fails its rooms fast, with a reason, from the engine's peer-failure report (not the transfer
   deadline, set long here); decode server 0's rooms of the same round succeed byte-exact;
3. the survivors keep serving: a follow-up round succeeds on decode server 0 (the dead server's
   rooms fail on prefill by its bootstrap deadline: no decode ever claims them);
4. the bootstrap server dies while decode server 0's writes are held on the wire: decode's
   heartbeat fails the rooms bound to it, with a reason; decode holds their pages until prefill,
   told by decode's abort, has seen every held write land and ACKed.

At the end the surviving managers hold nothing, no write landed after decode released a page
(softio write log on decode server 0), and the survivors still answer.
"""

from __future__ import annotations

import os
import signal

from reliability_support import SLACK_S, Session, outcomes, two_decode_config

from harness.pd.run import run_transfer
from harness.pd.control import late_writes_by_log, wait_until
from harness.pd.results import FAILED, SUCCESS

ROUNDS = (4, 8, 8, 8)
BASE, DECODE_DIES, FOLLOW_UP, BOOTSTRAP_DIES = range(4)
VICTIM = "decode0.i1"
BOOTSTRAP_TIMEOUT_S = 6
HEARTBEAT_BOUND_S = 2 * (2 + 1) + 5.0  # interval x (misses + 1) + one probe's timeout


def test_decode_and_bootstrap_death_fail_their_rooms_and_the_rest_keeps_serving():
    # Detection must come from the peer-failure report and the heartbeat, not a deadline.
    cfg = two_decode_config(
        ROUNDS,
        SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT=str(BOOTSTRAP_TIMEOUT_S),
        SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT="30",
        SGLANG_MORI_SOFTIO_FENCE="0",  # held writes land after the resume, however late (no fence, as MORI-IO)
    )
    box: dict = {}

    def during(info) -> None:
        box["session"] = Session(info, cfg)
        box["session"].run(steps)

    def steps(s: Session) -> None:
        p = s.ctl["prefill0"]
        s.wait_done(BASE, 60)
        mine = lambda k, j: [i for i in s.indices(k) if i % 2 == j]  # noqa: E731

        # 2. decode server 1 dies with its writes on the wire
        box["victim_key"] = s.kill_decode_mid_transfer(VICTIM, DECODE_DIES, mine(DECODE_DIES, 1))
        s.wait_done(DECODE_DIES, 30)

        # 3. the survivors keep serving
        p.fault("clear")
        s.open(FOLLOW_UP)
        s.wait_done(FOLLOW_UP, BOOTSTRAP_TIMEOUT_S + 30)

        # 4. the bootstrap server dies with decode server 0's writes on the wire
        for lane in range(4):
            p.fault("stall_lane", lane=lane)
        s.open(BOOTSTRAP_DIES)
        wait_until(s.transferring(mine(BOOTSTRAP_DIES, 0)), 20, "rooms transferring")
        s.mark("bootstrap_killed")
        os.kill(s.info.pids["bootstrap"], signal.SIGKILL)
        ids = {s.plan.rooms[i].room for i in mine(BOOTSTRAP_DIES, 0)}
        s.wait_decode(lambda st: ids <= set(st["held"]), HEARTBEAT_BOUND_S + SLACK_S, "heartbeat failure")
        s.mark("resumed")
        p.fault("resume_lane")
        s.wait_done(BOOTSTRAP_DIES, BOOTSTRAP_TIMEOUT_S + 30)
        s.finish()

    result = run_transfer(cfg, during=during)
    s = box.get("session")
    assert s is not None and s.leftovers, result.summary()
    summary = result.summary()
    assert result.lost_workers == [VICTIM], summary
    assert result.alive_at_end.get("prefill0") and result.alive_at_end.get("decode0"), result.alive_at_end
    pre, dec = outcomes(result, "prefill"), outcomes(result, "decode")  # dec: decode server 0
    (dec_rep,) = [r for r in result.side("decode") if r.instance == 0]

    # every room ends on prefill, and on the surviving decode server, with a reason if it failed
    for o in list(pre.values()) + list(dec.values()):
        assert o.status in (SUCCESS, FAILED) and (o.status == SUCCESS or o.failure), (o.index, o.status_name)
    for k in (BASE, DECODE_DIES, FOLLOW_UP):
        for i in s.indices(k):
            if i % 2 == 0:
                assert pre[i].status == SUCCESS and dec[i].status == SUCCESS, (i, pre[i].failure, dec[i].failure)
    assert dec_rep.verified and dec_rep.mismatch_count == 0 and not dec_rep.late_writes, summary

    # 2. the dead server's rooms fail fast on prefill, from the broken connection
    victim_key = [box["victim_key"]]
    for i in s.indices(DECODE_DIES):
        if i % 2 == 1:
            o = pre[i]
            assert o.status == FAILED and victim_key[0] in o.failure, (i, o.failure)
            assert any(w in o.failure for w in ("peer unreachable", "peer failure", "failed recently")), o.failure
            assert o.t_done - s.marks["decode_killed"] <= SLACK_S, (i, o.t_done, s.marks)
    # 3. ... and its rooms of the follow-up round by the bootstrap deadline
    for i in s.indices(FOLLOW_UP):
        if i % 2 == 1:
            assert pre[i].status == FAILED and pre[i].t_done - pre[i].t_open <= BOOTSTRAP_TIMEOUT_S + SLACK_S

    # 4. the heartbeat fails decode's rooms; the pages stay held until the held writes landed
    for i in s.indices(BOOTSTRAP_DIES):
        if i % 2 == 0:
            d = dec[i]
            assert d.status == FAILED and "Lost connection with prefill" in d.failure, (i, d.failure)
            assert d.t_done - s.marks["bootstrap_killed"] <= HEARTBEAT_BOUND_S + SLACK_S, (i, d.t_done, s.marks)
            assert d.release == "acked" and d.t_released >= s.marks["resumed"], (i, d.release, d.t_released)
            assert pre[i].status == FAILED and "abort" in pre[i].failure.lower(), pre[i].failure

    late = late_writes_by_log(s.write_logs["decode0"], s.plan, dec_rep.rooms, result.ready.t0, cfg.layout.page_size)
    assert not late, late[:5]
    for name, tables in s.leftovers.items():
        assert not any(tables.values()), f"{name} left behind {tables}"
