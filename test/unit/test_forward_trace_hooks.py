"""scripts/gpu_sglang/forward_trace.py over a stand-in for torch.cuda's events: one forward through
the hooks yields one `fwd` line, written only once a later forward was launched and the first one's
end event fired, with a GPU mark per attention layer and our begin_batch joined to it."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "gpu_sglang"))
import forward_trace  # noqa: E402


class FakeClock:
    def __init__(self):
        self.gpu_ms = 0.0
        self.completed_ms = -1.0  # the GPU has finished the work recorded up to here


class FakeEvent:
    def __init__(self, clock, enable_timing=False):
        assert enable_timing
        self.clock = clock
        self.at = None
        self.streams = []

    def record(self, stream=None):
        self.at = self.clock.gpu_ms
        self.streams.append(stream)

    def query(self):
        return self.at <= self.clock.completed_ms

    def elapsed_time(self, other):
        assert self.query() and other.query()
        return other.at - self.at


def test_one_forward_gives_one_line_after_the_next_launch(monkeypatch):
    clock = FakeClock()
    torch = SimpleNamespace(cuda=SimpleNamespace(Event=lambda enable_timing=False: FakeEvent(clock, enable_timing)))
    monkeypatch.setattr(forward_trace, "_cuda", lambda: torch)
    lines = []
    monkeypatch.setattr(forward_trace, "_emit", lambda ev, **f: lines.append((ev, f)))
    monkeypatch.setattr(forward_trace, "_pending", [])
    scheduler = SimpleNamespace(forward_stream="fwd-stream")

    def forward(sched, batch):
        forward_trace.around_begin_batch(lambda: "published")
        for _ in range(3):
            clock.gpu_ms += 9.0
            forward_trace.around_attention(lambda: "attn-out")
            forward_trace.around_on_layer(lambda: None)
        clock.gpu_ms += 5.5
        return "result"

    big = SimpleNamespace(extend_num_tokens=8192)
    assert forward_trace.around_run_batch(forward, scheduler, big) == "result"
    assert lines == []  # not done yet: nothing is waited for
    clock.completed_ms = clock.gpu_ms  # the first forward finished; the second stays in flight
    assert forward_trace.around_run_batch(forward, scheduler, big) == "result"
    assert [ev for ev, _ in lines] == ["fwd"]
    f = lines[0][1]
    assert f["gpu_attn_ms"] == [9.0, 18.0, 27.0] and f["gpu_end_ms"] == 32.5
    assert f["tokens"] == 8192 and len(f["cpu_attn_ms"]) == 3
    assert f["begin_t0"] <= f["begin_t1"] and f["t_enter"] <= f["t_exit"]
    # the end event went to the forward stream
    assert forward_trace._pending[-1]["end"].streams == ["fwd-stream"]
    # a small batch is not traced at all
    calls = []
    forward_trace.around_run_batch(lambda s, b: calls.append(b), scheduler, SimpleNamespace(extend_num_tokens=8))
    assert len(calls) == 1 and len(forward_trace._pending) == 1
