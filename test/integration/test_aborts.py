"""Aborts in the middle of a run, on both sides, while other rooms keep transferring.

Prefill aborts rooms it has already sent (the scheduler's AbortReq for an in-flight request),
decode aborts rooms still pre-allocating. Every aborted room ends Failed with a reason on both
sides; every other room succeeds byte-exact. For the rooms prefill aborted mid-transfer, decode
holds the pages until the prefill acknowledges that none of its writes can still land
(SGLang's deferred KV release) -- it must get that ACK, not fall back to the release timeout --
and nothing may change in those pages after decode released them.
"""

from __future__ import annotations

import json

from integration_support import config

from sglang_mori.testing.pd_harness import KVLayout, RoomShape, run_transfer
from sglang_mori.testing.pd_harness_results import FAILED, SUCCESS

ROOMS = 32
PREFILL_ABORT = (1, 5, 9, 13, 17)
DECODE_ABORT = (2, 6, 10)


def test_aborts_fail_only_their_rooms_and_release_pages_after_drain():
    cfg = config(
        rooms=ROOMS,
        prefill_abort=PREFILL_ABORT,
        decode_abort=DECODE_ABORT,
        prefill_abort_trigger="first_success",
        layout=KVLayout(num_layers=2, total_kv_heads=4, head_dim=32, page_size=16, state_item_bytes=(64,)),
        shape=RoomShape(min_tokens=32, max_tokens=96, chunks=2),
        # ~1.5 MB of KV at 2 MB/s: aborted rooms still have writes in flight when they are aborted.
        prefill_env={"SGLANG_MORI_SOFTIO_FAULTS": json.dumps([{"kind": "set_bandwidth", "bytes_per_s": 2_000_000}])},
        env={"SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT": "20"},
    )
    result = run_transfer(cfg)
    summary = result.summary()
    assert result.error is None, summary
    aborted = set(PREFILL_ABORT) | set(DECODE_ABORT)
    for rep in result.ranks:
        for o in rep.rooms:
            expected = FAILED if o.index in aborted else SUCCESS
            assert o.status == expected, f"{rep.side} room#{o.index}: {o.status_name} {o.failure}\n{summary}"
            if expected == FAILED:
                assert "abort" in (o.failure or "").lower(), f"{rep.side} room#{o.index}: {o.failure}"
    (dec,) = result.side("decode")
    for i in PREFILL_ABORT:
        assert dec.rooms[i].release == "acked", (i, dec.rooms[i].release, summary)
    assert dec.verified and dec.mismatch_count == 0, summary
    assert dec.rechecked and not dec.late_writes, summary
    assert all(result.alive_at_end.values()), result.alive_at_end
