"""A decode server dies and a new decode process comes back in its place while prefill stays up.

One prefill, two decode servers (rooms alternate between them), one session per way of coming back:

1. baseline;
2. decode server 1 is killed (SIGKILL) while its writes are on the wire (its lanes held): prefill
   fails its rooms fast, with a reason naming the dead engine; decode server 0's rooms of the same
   round succeed byte-exact;
3. a new decode process (a new engine key) takes decode server 1's place, prefill is not
   restarted, and every room of the next round succeeds byte-exact on both decode servers.
   Nothing aimed at the dead incarnation lands in the new one (the new process's pages of the
   earlier rounds must stay zero, checked by the harness).

The new process comes back either
- at the SAME endpoint: same host, same ZMQ rank port, same engine port. SGLang never does this on
  purpose (it binds the rank port with bind_to_random_port and our engine asks MORI-IO for port 0;
  the harness pins them, see pd/pin.py), but a port can be drawn again. Prefill must see
  the endpoint's new key replace the old one: the dead incarnation leaves its peer table and its
  engine, and stale messages for the old rooms that reach the new process change nothing; or
- on fresh random ports, as SGLang restarts a server: prefill serves the new engine next to the
  dead one, which stays known there, marked failed, with nothing in flight.

At the end no manager holds anything, no write landed after a decode server released a page, and
prefill, decode server 0 and the new decode process still answer.
"""

from __future__ import annotations

import pytest
from reliability_support import SLACK_S, Session, check_end, outcomes, run_session, two_decode_config

from harness.pd.results import FAILED, SUCCESS

ROUNDS = (4, 8, 8)
BASE, DECODE_DIES, RESTARTED = range(3)
VICTIM = "decode0.i1"
PEER_FAILED = ("peer unreachable", "peer failure", "failed recently", "replaced by a restarted engine")


@pytest.mark.parametrize("same_ports", [True, False],
                         ids=["same-endpoint", "fresh-ports"])
def test_decode_restart_is_served_without_restarting_prefill(same_ports):
    # Detection must come from the peer-failure report, not the transfer deadline.
    cfg = two_decode_config(ROUNDS, SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT="6")
    box: dict = {}

    def steps(s: Session) -> None:
        p = s.ctl["prefill0"]
        s.wait_done(BASE, 60)
        victims = [i for i in s.indices(DECODE_DIES) if i % 2 == 1]
        box["old"] = {
            "key": s.ctl[VICTIM].engine_key(),
            "engine": s.ctl[VICTIM].engine_endpoint(),
            "zmq": s.info.decode_endpoints[1],
        }
        box["survivor_key"] = s.ctl["decode0"].engine_key()

        # 2. decode server 1 dies with its writes on the wire
        s.kill_decode_mid_transfer(VICTIM, DECODE_DIES, victims)
        s.wait_done(DECODE_DIES, 30)
        p.fault("clear")

        # 3. a new process in its place, with a new engine key; prefill keeps running
        name = box["new_name"] = s.restart_decode(VICTIM, RESTARTED, same_ports=same_ports)
        box["new"] = {
            "key": s.ctl[name].engine_key(),
            "engine": s.ctl[name].engine_endpoint(),
            "zmq": s.info.decode_endpoints[-1],
        }
        s.open(RESTARTED)
        s.wait_done(RESTARTED, 60)
        box["peers"] = p.peers()
        box["engine_peers"] = p.engine_peers()
        box["rejections"] = s.ctl[name].protocol_rejections()
        s.finish()

    result, s = run_session(cfg, steps)
    summary = result.summary()
    check_end(result, s, cfg, lost=(VICTIM,))
    old, new, name = box["old"], box["new"], box["new_name"]
    pre = outcomes(result, "prefill")
    dec = {rep.worker: {o.index: o for o in rep.rooms} for rep in result.side("decode")}
    assert set(dec) == {"decode0", name}, summary
    assert sorted(dec[name]) == [i for i in s.indices(RESTARTED) if i % 2 == 1], summary

    # 1.-2. decode server 0 never notices; the dead server's rooms fail fast, with a reason
    for k in range(len(ROUNDS)):
        for i in s.indices(k):
            if i % 2 == 0:
                assert pre[i].status == SUCCESS and dec["decode0"][i].status == SUCCESS, (i, pre[i].failure)
    for i in s.indices(DECODE_DIES):
        if i % 2 == 1:
            o = pre[i]
            assert o.status == FAILED and old["key"] in o.failure, (i, o.status_name, o.failure)
            assert any(w in o.failure for w in PEER_FAILED), o.failure
            assert o.t_done - s.marks["decode_killed"] <= SLACK_S, (i, o.t_done, s.marks)

    # 3. the new incarnation is served, byte-exact (check_end), without restarting prefill
    assert new["key"] not in (old["key"], box["survivor_key"]), (old, new)
    for i in s.indices(RESTARTED):
        if i % 2 == 1:
            assert pre[i].status == SUCCESS and dec[name][i].status == SUCCESS, (i, pre[i].failure)
    peers = {q["key"]: q for q in box["peers"]}
    assert peers[new["key"]]["unusable"] is None and tuple(peers[new["key"]]["endpoint"]) == tuple(new["zmq"])
    assert all(q["inflight"] == 0 for q in box["peers"]), box["peers"]
    assert new["key"] in box["engine_peers"], box["engine_peers"]
    if same_ports:
        assert new["zmq"] == old["zmq"] and new["engine"] == old["engine"], (old, new)
    # (fresh random ports may, rarely, draw the old ZMQ port again: then it is the same endpoint)
    if tuple(new["zmq"]) == tuple(old["zmq"]):
        # the endpoint's new key replaced the old one, in the peer table and in the engine
        assert sorted(peers) == sorted([box["survivor_key"], new["key"]]), box["peers"]
        assert old["key"] not in box["engine_peers"], box["engine_peers"]
        assert not box["rejections"], box["rejections"]  # stale messages for old rooms: ignored
    else:
        # nobody replaced the old endpoint: its dead engine stays known, failed, holding nothing
        assert sorted(peers) == sorted([box["survivor_key"], new["key"], old["key"]]), box["peers"]
        assert peers[old["key"]]["failed_reason"], peers[old["key"]]
