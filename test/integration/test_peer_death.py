"""A peer dies in the middle of a transfer: the survivor fails the cut-off rooms, with a reason,
within its detection deadline (not SGLang's 300 s waiting timeout), keeps serving, and on decode
no byte lands outside the rooms' own pages, nor in a failed room's pages after decode released
them.

Writes are held in flight with softio fault injection (every lane of the prefill engine stalled,
or its bandwidth capped), and the kill happens once the prefill has called send() for every room
(progress streamed by the harness), so the cut falls mid-transfer.

"Prefill dies" kills the prefill scheduler process and the bootstrap server: in SGLang both live
in the prefill server (the bootstrap server in its launcher), and decode's heartbeat probes it.
A room whose metadata reached the prefill but whose transfer had not started yet is failed by that
heartbeat; one whose transfer had started, by our decode deadline (TransferStarted + timeout).
"""

from __future__ import annotations

import json
import os
import signal
import time

from integration_support import config

from harness.pd.run import KVLayout, RoomShape, run_transfer
from harness.pd.control import controls, wait_clean
from harness.pd.results import FAILED, SUCCESS, TIMED_OUT

ROOMS = 24
HEARTBEAT_S, HEARTBEAT_MISSES = 2.0, 2  # SGLang clamps the interval to >= 2 s
# Decode holds a failed room's pages until every prefill rank acks the abort, or this long.
RELEASE_TIMEOUT_S = 4.0
FAST_FAILURE_ENV = {
    "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": str(HEARTBEAT_S),
    "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": str(HEARTBEAT_MISSES),
    "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT": str(RELEASE_TIMEOUT_S),
}
LAYOUT = KVLayout(num_layers=2, total_kv_heads=4, head_dim=32, page_size=16)
SHAPE = RoomShape(min_tokens=16, max_tokens=96, chunks=2)
SLACK_S = 10.0  # scheduling noise on a loaded 2-core host


def _faults(*items) -> str:
    return json.dumps(list(items))


def _kill_when_all_sent(victims, killed: dict, survivor: str):
    def hook(info) -> None:
        ctl = controls(info, [survivor])
        assert info.wait_progress("prefill0", "sent", ROOMS, 60.0), info.progress
        killed["t"] = time.monotonic() - info.t0
        for victim in victims:
            os.kill(info.pids[victim], signal.SIGKILL)
        # The survivor ends every room and then holds nothing (statuses, targets, trackers).
        assert info.wait_progress(survivor, "done", ROOMS, 90.0), info.progress
        killed["leftovers"] = wait_clean(ctl, 30.0)[survivor]

    return hook


def test_prefill_killed_mid_transfer_fails_decode_rooms_by_deadline():
    decode_timeout_ms = 2000  # decode gives up this long (+5 s grace) after TransferStarted
    cfg = config(
        rooms=ROOMS,
        layout=LAYOUT,
        shape=SHAPE,
        prefill_env={
            "SGLANG_MORI_SOFTIO_FAULTS": _faults(*({"kind": "stall_lane", "lane": i} for i in range(8))),
            "SGLANG_MORI_TRANSFER_TIMEOUT_MS": "120000",  # prefill must not time out on its own first
        },
        decode_env={"SGLANG_MORI_TRANSFER_TIMEOUT_MS": str(decode_timeout_ms)},
        env=FAST_FAILURE_ENV,
        control=True,
    )
    killed: dict = {}
    result = run_transfer(cfg, during=_kill_when_all_sent(["prefill0", "bootstrap"], killed, "decode0"))
    summary = result.summary()
    assert result.lost_workers == ["prefill0"], summary
    (dec,) = result.side("decode")
    assert [o.status for o in dec.rooms] == [FAILED] * ROOMS, summary
    heartbeat = HEARTBEAT_S * (HEARTBEAT_MISSES + 1) + 5.0  # misses + one probe's (2+3) s timeout
    bound = killed["t"] + max(decode_timeout_ms / 1000 + 5.0, heartbeat) + SLACK_S
    for o in dec.rooms:
        assert o.failure, summary
        assert o.t_done <= bound, f"room#{o.index} failed at {o.t_done:.1f}s, bound {bound:.1f}s"
        # No prefill is left to ack the abort: pages are released by SGLang's release timeout.
        assert o.release == "timeout", (o.index, o.release)
    # Nothing succeeded, so the checker guards the pages no room owns (still zero) and the
    # released rooms' pages (unchanged since release).
    assert dec.verified and dec.mismatch_count == 0 and dec.rechecked and not dec.late_writes, summary
    assert result.alive_at_end.get("decode0") is True, result.alive_at_end
    assert killed["leftovers"] and not any(killed["leftovers"].values()), killed["leftovers"]


def test_decode_killed_mid_transfer_fails_prefill_rooms_by_deadline():
    prefill_timeout_ms = 3000
    cfg = config(
        rooms=ROOMS,
        layout=LAYOUT,
        shape=SHAPE,
        # ~200 KB/s: the run's ~1 MB of KV takes several seconds, so most rooms are cut off.
        prefill_env={
            "SGLANG_MORI_SOFTIO_FAULTS": _faults({"kind": "set_bandwidth", "bytes_per_s": 200_000}),
            "SGLANG_MORI_TRANSFER_TIMEOUT_MS": str(prefill_timeout_ms),
        },
        control=True,
    )
    killed: dict = {}
    result = run_transfer(cfg, during=_kill_when_all_sent(["decode0"], killed, "prefill0"))
    summary = result.summary()
    assert result.lost_workers == ["decode0"], summary
    (pre,) = result.side("prefill")
    statuses = [o.status for o in pre.rooms]
    assert TIMED_OUT not in statuses and set(statuses) <= {SUCCESS, FAILED}, summary
    assert statuses.count(FAILED) >= ROOMS // 2, summary
    bound = killed["t"] + prefill_timeout_ms / 1000 + SLACK_S
    for o in pre.rooms:
        if o.status == FAILED:
            assert o.failure and o.t_done <= bound, f"room#{o.index}: {o.failure} at {o.t_done}s > {bound:.1f}s"
    assert result.alive_at_end == {"bootstrap": True, "prefill0": True}, result.alive_at_end
    assert killed["leftovers"] and not any(killed["leftovers"].values()), killed["leftovers"]
