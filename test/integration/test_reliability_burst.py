"""A burst of 1,000 rooms opened at once against one decode peer, with every write delayed, so the
backend's bound on in-flight transfers per peer (SGLANG_MORI_MAX_INFLIGHT_PER_PEER) has to hold
the rest back: every room still succeeds byte-exact, the in-flight count never exceeds the bound
(sampled on prefill while the burst runs) and does reach it, nothing is left in any table
afterwards, and a follow-up round succeeds.
"""

from __future__ import annotations

from reliability_support import Session, check_end, outcomes, reliability_config

from harness.pd.run import KVLayout, RoomShape, run_transfer
from harness.pd.results import SUCCESS

BURST, FOLLOW_UP = 1000, 16
BOUND = 8
LATENCY_MS = 15


def test_burst_of_1000_rooms_is_bounded_per_peer_and_completes():
    cfg = reliability_config(
        rooms=BURST + FOLLOW_UP,
        rounds=(BURST, FOLLOW_UP),
        layout=KVLayout(num_layers=2, total_kv_heads=2, head_dim=16, page_size=16, aux=()),
        shape=RoomShape(min_tokens=1, max_tokens=48, chunks=2),
        transfer_timeout_s=150.0,
        env={
            "SGLANG_MORI_MAX_INFLIGHT_PER_PEER": str(BOUND),
            # Waiting for a slot is part of a chunk's deadline; a 2-core host needs room for 1,000.
            "SGLANG_MORI_TRANSFER_TIMEOUT_MS": "30000",
        },
        prefill_env={"SGLANG_MORI_SOFTIO_FAULTS": f'[{{"kind": "set_latency", "ms": {LATENCY_MS}}}]'},
    )
    box: dict = {}

    def during(info) -> None:
        box["session"] = Session(info, cfg)
        box["session"].run(steps)

    def steps(s: Session) -> None:
        s.wait_done(0, 120)
        box["peers"] = s.ctl["prefill0"].peers()
        s.ctl["prefill0"].fault("clear")
        s.open(1)
        s.wait_done(1, 60)
        s.finish()

    result = run_transfer(cfg, during=during)
    session = box.get("session")
    assert session is not None and "peers" in box, result.summary()
    check_end(result, session, cfg)
    pre, dec = outcomes(result, "prefill"), outcomes(result, "decode")
    assert all(o.status == SUCCESS for o in pre.values()), result.summary()
    assert all(o.status == SUCCESS for o in dec.values()), result.summary()
    (peer,) = box["peers"]
    assert BOUND // 2 <= peer["max_inflight"] <= BOUND, peer
