"""scripts/gpu_sglang/forward_timeline.py and forward_trace.py: the per-layer split of a prefill
forward that decides where layer-wise's forward excess goes (issue 27). Synthetic traces with known
gaps must give those gaps; the trace hooks must pass a forward through untouched off the GPU."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "gpu_sglang"))
import forward_timeline  # noqa: E402
import forward_trace  # noqa: E402

T0 = 1_800_000_000.0


def _forward(n: int, begin_ms=None, post_lag_ms=0.2):
    """Forward n: stamped at t, run_batch entered 0.4 ms later, 8 layers of 9 ms after a 3 ms
    first segment, GPU end 5.5 ms after the last attention, result processed 0.3 ms after."""
    t = T0 + n
    enter = t + 0.4e-3
    attn = [3.0 + 9.0 * k for k in range(8)]
    gpu_end = attn[-1] + 5.5
    done = enter + (gpu_end + 0.3) / 1e3
    events = [
        {"ev": "req_stats", "mode": "prefill", "t": done, "room": n,
         "stats": {"forward_entry_time": t, "prefill_finished_time": done}},
        {"ev": "fwd", "t": done + 1, "room": None, "t_enter": enter, "t_exit": enter + 2e-3, "tokens": 8192,
         "gpu_attn_ms": attn, "cpu_attn_ms": [0.1 * (k + 1) for k in range(8)], "gpu_end_ms": gpu_end,
         "on_layer_ms": 0.05},
    ]
    if begin_ms is not None:
        events[1].update(begin_t0=enter - 0.3e-3, begin_t1=enter - 0.3e-3 + begin_ms / 1e3)
        for k in (1, 4, 5, 6, 7):  # halving groups of 8 layers: posts after layers 2, 5, 6, 7, 8
            p = enter + (attn[k] + post_lag_ms) / 1e3
            events.append({"ev": "p_submit", "t": p, "room": None, "t_start": p, "t_end": p + 1e-4, "bytes": 1})
    return events


def test_steps_of_a_forward_are_its_known_gaps():
    events = [e for n in range(3) for e in _forward(n, begin_ms=0.25)]
    s = forward_timeline.summary(forward_timeline.forwards(events))
    assert abs(s["forward start -> run_batch"] - 0.4) < 1e-3
    assert abs(s["begin_batch"] - 0.25) < 1e-3
    assert abs(s["run_batch entry -> launch done"] - 2.0) < 1e-3
    assert abs(s["attn 2 (GPU)"] - 12.0) < 1e-6
    assert abs(s["layer 5 -> 6 (GPU)"] - 9.0) < 1e-6
    assert abs(s["GPU end -> result processed"] - 0.3) < 1e-3
    assert abs(s["forward (start -> result processed)"] - (0.4 + 3.0 + 63.0 + 5.5 + 0.3)) < 1e-3
    assert abs(s["layer end -> copy posted (first)"] - 0.2) < 1e-3


def test_standalone_has_no_layerwise_rows_and_small_batches_are_left_out():
    events = _forward(0)
    small = _forward(1)
    small[1]["tokens"] = 100
    rows = forward_timeline.forwards(events + small)
    assert len(rows) == 1
    assert "begin_batch" not in rows[0] and "layer end -> copy posted (first)" not in rows[0]


def test_main_reads_each_config_folder(tmp_path, capsys):
    for config, begin in (("standalone", None), ("pd_auto", 0.3)):
        folder = tmp_path / f"trace-{config}"
        folder.mkdir()
        (folder / "trace-1.jsonl").write_text("".join(json.dumps(e) + "\n" for e in _forward(0, begin)))
    assert forward_timeline.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "== pd_auto (1 forwards)" in out and "== standalone (1 forwards)" in out
    assert "begin_batch" in out


def test_trace_hooks_pass_through_without_a_gpu():
    calls = []

    def original(scheduler, batch, *a, **k):
        calls.append((scheduler, batch, a, k))
        return "result"

    batch = type("B", (), {"extend_num_tokens": 8192})()
    assert forward_trace.around_run_batch(original, "sched", batch, 1, x=2) == "result"
    assert calls == [("sched", batch, (1,), {"x": 2})]
    assert forward_trace.around_attention(lambda *a: "out", 1, 2) == "out"
    assert forward_trace._pending == []
