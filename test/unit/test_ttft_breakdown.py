"""scripts/gpu_sglang/ttft_breakdown.py: the join of client, server and room_trace timestamps that
docs/benchmarks.md's TTFT table rests on. Synthetic traces with known gaps must give those gaps."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "gpu_sglang"))
import ttft_breakdown  # noqa: E402

T0 = 1_800_000_000.0


def write_run(tmp: Path, rooms, forward_ms: float, last_chunk_after_ms: float, deciders=None, readers=None) -> Path:
    """One PD config 'pd_x' with the given rooms; every gap is fixed (ms after the client's send).
    `deciders`: per room, the thread part its p_success names (None: a trace from before the field);
    a room decided by 'scheduler' also gets p_last_inline. `readers`: per room, who read the
    destinations and the Success (p_ready's and d_status's `reader`)."""
    per_request, events = [], []
    for n, room in enumerate(rooms):
        decider = deciders[n] if deciders else None
        t = T0 + n * 10.0
        ms = lambda x: t + x / 1000  # noqa: E731
        per_request.append({"room": room, "sent_at": t, "first_at": ms(100.0), "ttft_s": 0.1, "e2e_s": 0.2})
        fwd_start, fwd_end = 5.0, 5.0 + forward_ms
        events += [
            {"ev": "p_ready", "room": room, "t": ms(3.0), **({"reader": readers[n][0]} if readers else {})},
            {"ev": "p_last_chunk", "room": room, "t": ms(fwd_end + last_chunk_after_ms)},
            {"ev": "p_submit", "room": None, "t": ms(fwd_end - 20.0), "t_start": ms(fwd_end - 20.0), "t_end": ms(fwd_end - 19.0), "bytes": 1},
            {"ev": "p_submit", "room": None, "t": ms(fwd_end + 2.0), "t_start": ms(fwd_end + 2.0), "t_end": ms(fwd_end + 2.5), "bytes": 1},
            {"ev": "p_copy_done", "room": None, "t": ms(fwd_end + 3.0)},
            {"ev": "p_success", "room": room, "t": ms(fwd_end + 4.0),
             **({"decider": decider, "thread": decider} if decider else {})},
            {"ev": "d_meta_sent", "room": room, "t": ms(2.0)},
            {"ev": "d_status", "room": room, "t": ms(fwd_end + 5.0), **({"reader": readers[n][1]} if readers else {})},
            {"ev": "d_poll_success", "room": room, "t": ms(fwd_end + 6.0)},
            {"ev": "req_stats", "room": room, "mode": "prefill", "stats": {
                "scheduler_recv_time": ms(1.0), "wait_queue_entry_time": ms(4.0),
                "forward_entry_time": ms(fwd_start), "prefill_finished_time": ms(fwd_end)}},
            {"ev": "req_stats", "room": room, "mode": "decode", "stats": {
                "scheduler_recv_time": ms(1.5), "forward_entry_time": ms(fwd_end + 7.0)}},
        ]
        if decider == "scheduler":
            events.append({"ev": "p_last_inline", "room": room, "t": ms(fwd_end + last_chunk_after_ms)})
    report = {"configs": {"pd_x": {"8192tok_c1": {"per_request": per_request}}}}
    (tmp / "lat.json").write_text(json.dumps(report))
    trace_dir = tmp / "logs" / "trace-pd_x"
    trace_dir.mkdir(parents=True)
    (trace_dir / "trace-1.jsonl").write_text("\n".join(json.dumps(e) for e in events) + "\n")
    return tmp / "lat.json"


def test_segments_are_the_gaps_between_the_joined_timestamps(tmp_path):
    lat = write_run(tmp_path, rooms=[11, 22, 33], forward_ms=80.0, last_chunk_after_ms=1.0)
    out = ttft_breakdown.breakdown(lat, tmp_path / "logs", "8192tok_c1")["pd_x"]
    seg = out["segments_ms_p50"]
    assert out["requests"] == 3
    assert seg["client -> prefill scheduler"] == 1.0
    assert seg["prefill scheduler -> destinations arrived"] == 2.0
    assert seg["prefill forward (start -> result processed)"] == 80.0
    assert seg["result processed -> last chunk handed to us"] == 1.0
    # The room's copies are the submits between its forward start and its Success: the last one
    # (posted 2.0 ms after the forward, its call ending at 2.5) and the copy event after it.
    assert seg["last chunk -> last copy posted"] == 1.5
    assert seg["copy posted -> copy event fired"] == 0.5
    assert seg["copy done -> Success decided"] == 1.0
    assert seg["decode poll -> prebuilt forward start"] == 1.0
    assert seg["TTFT"] == 100.0
    assert out["submits_per_request_p50"] == 2
    assert out["first_copy_before_forward_end_ms_p50"] == 20.0


def test_a_room_missing_from_the_traces_leaves_its_segments_out(tmp_path):
    lat = write_run(tmp_path, rooms=[11], forward_ms=80.0, last_chunk_after_ms=1.0)
    report = json.loads(lat.read_text())
    report["configs"]["pd_x"]["8192tok_c1"]["per_request"][0]["room"] = 99  # no trace has room 99
    lat.write_text(json.dumps(report))
    seg = ttft_breakdown.breakdown(lat, tmp_path / "logs", "8192tok_c1")["pd_x"]["segments_ms_p50"]
    assert seg["TTFT"] == 100.0  # the client's own times
    assert seg["prefill forward (start -> result processed)"] is None


def test_the_deciders_of_success_are_counted_per_config(tmp_path):
    lat = write_run(tmp_path, rooms=[11, 22, 33], forward_ms=80.0, last_chunk_after_ms=1.0,
                    deciders=["scheduler", "shard", "scheduler"])
    out = ttft_breakdown.breakdown(lat, tmp_path / "logs", "8192tok_c1")["pd_x"]
    assert out["success_deciders"] == {"scheduler": 2, "shard": 1}
    assert out["last_chunk_inline"] == 2


def test_who_read_the_destinations_and_the_success_is_counted_per_config(tmp_path):
    lat = write_run(tmp_path, rooms=[11, 22, 33], forward_ms=80.0, last_chunk_after_ms=1.0,
                    readers=[("scheduler", "scheduler"), ("control", "scheduler"), ("scheduler", "status_thread")])
    out = ttft_breakdown.breakdown(lat, tmp_path / "logs", "8192tok_c1")["pd_x"]
    assert out["destinations_readers"] == {"control": 1, "scheduler": 2}
    assert out["success_readers"] == {"scheduler": 2, "status_thread": 1}


def test_traces_without_the_decider_field_count_as_unrecorded(tmp_path):
    lat = write_run(tmp_path, rooms=[11, 22], forward_ms=80.0, last_chunk_after_ms=1.0)
    out = ttft_breakdown.breakdown(lat, tmp_path / "logs", "8192tok_c1")["pd_x"]
    assert out["success_deciders"] == {"unrecorded": 2}
    assert out["last_chunk_inline"] == 0


def test_room_trace_names_the_thread_that_decided_and_only_a_decision(tmp_path, monkeypatch):
    import threading

    import room_trace

    monkeypatch.setenv(room_trace.ENV, str(tmp_path))
    monkeypatch.setattr(room_trace, "_file", None)
    room = type("Room", (), {"room": 7})()
    room_trace._after_succeed(False, None, room)  # not ready, or another thread concluded it
    room_trace._after_succeed(True, None, room)
    worker = threading.Thread(target=room_trace._after_succeed, args=(True, None, room), name="mori-layerwise")
    worker.start()
    worker.join()
    room_trace._file.close()
    monkeypatch.setattr(room_trace, "_file", None)
    (trace,) = tmp_path.glob("trace-*.jsonl")
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    assert [(e["ev"], e["room"], e["decider"]) for e in events] == [
        ("p_success", 7, "scheduler"), ("p_success", 7, "layerwise_worker")]
    assert [room_trace.decider_of(n) for n in ("mori-shard-3", "mori-completion", "MainThread")] == [
        "shard", "completion", "scheduler"]


def test_the_sglang_mori_each_config_imported_is_listed(tmp_path):
    """room_trace's `process` event names the package a server imported: a baseline config
    (pd_latency.py *_cand) shows it ran the candidate's code, not this tree's."""
    lat = write_run(tmp_path, rooms=[11], forward_ms=80.0, last_chunk_after_ms=1.0)
    with (tmp_path / "logs" / "trace-pd_x" / "trace-1.jsonl").open("a") as f:
        for pid in (1, 2):
            f.write(json.dumps({"ev": "process", "room": None, "t": T0, "pid": pid,
                                "sglang_mori": "/x/cand/python/sglang_mori"}) + "\n")
    out = ttft_breakdown.breakdown(lat, tmp_path / "logs", "8192tok_c1")["pd_x"]
    assert out["sglang_mori"] == ["/x/cand/python/sglang_mori"]
    assert out["segments_ms_p50"]["TTFT"] == 100.0  # the process events join no request


def test_room_trace_records_the_imported_sglang_mori_at_registration(tmp_path, monkeypatch):
    import types

    import room_trace
    import sglang_mori

    registered = []
    fake = types.ModuleType("sglang.srt.plugins.hook_registry")
    fake.HookType = types.SimpleNamespace(BEFORE="BEFORE", AFTER="AFTER", AROUND="AROUND")
    fake.HookRegistry = types.SimpleNamespace(register=lambda target, hook, kind: registered.append(target))
    monkeypatch.setitem(sys.modules, "sglang.srt.plugins.hook_registry", fake)
    monkeypatch.setenv(room_trace.ENV, str(tmp_path))
    monkeypatch.setattr(room_trace, "_file", None)
    room_trace.register()
    room_trace._file.close()
    monkeypatch.setattr(room_trace, "_file", None)
    (trace,) = tmp_path.glob("trace-*.jsonl")
    (event,) = [json.loads(line) for line in trace.read_text().splitlines()]
    assert event["ev"] == "process" and event["sglang_mori"] == str(Path(sglang_mori.__file__).parent)
    assert len(registered) == len(room_trace.HOOKS)
