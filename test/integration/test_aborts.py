"""Aborts in the middle of a run, on both sides, while other rooms keep transferring.

Prefill aborts rooms it has already sent once its first room succeeded (the scheduler's AbortReq
for an in-flight request), decode aborts rooms still pre-allocating. Every aborted room ends
Failed with a reason on the aborting side; on the other side too, unless all of its KV had
already landed. Every other room succeeds byte-exact. For rooms cut mid-transfer, decode holds
the pages until the prefill acknowledges that none of its writes can still land (SGLang's
deferred KV release) -- it must get that ACK, not fall back to the release timeout -- and nothing
may change in those pages after decode released them.
"""

from __future__ import annotations

import json

from integration_support import config

from harness.pd.run import KVLayout, RoomShape, run_transfer
from harness.pd.results import FAILED, SUCCESS

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
    (pre,), (dec,) = result.side("prefill"), result.side("decode")

    def check(o, expected, side):
        assert o.status == expected, f"{side} room#{o.index}: {o.status_name} {o.failure}\n{summary}"
        if expected == FAILED:
            assert "abort" in (o.failure or "").lower(), f"{side} room#{o.index}: {o.failure}"

    # A room prefill aborts after it already succeeded cannot fail any more: the harness aborts
    # only rooms still in flight (outcome.aborted), and the first success comes well before most
    # of them can finish at the capped bandwidth.
    cut = [i for i in PREFILL_ABORT if pre.rooms[i].aborted]
    assert cut, f"no prefill abort landed before its room finished\n{summary}"
    for o in pre.rooms:
        check(o, FAILED if o.index in cut or o.index in DECODE_ABORT else SUCCESS, "prefill")
    for o in dec.rooms:
        if o.index in DECODE_ABORT:
            check(o, FAILED, "decode")
        elif o.index in cut and o.status == FAILED:
            check(o, FAILED, "decode")
            # Decode held the pages until prefill confirmed its writes had drained.
            assert o.release == "acked", (o.index, o.release, summary)
        else:  # untouched rooms, and cut rooms whose KV had all landed before the abort
            check(o, SUCCESS, "decode")
    assert any(dec.rooms[i].status == FAILED for i in cut), summary
    assert dec.verified and dec.mismatch_count == 0, summary
    assert dec.rechecked and not dec.late_writes, summary
    assert all(result.alive_at_end.values()), result.alive_at_end
