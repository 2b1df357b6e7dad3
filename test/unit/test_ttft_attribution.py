"""scripts/gpu_sglang/ttft_attribution.py: a PD request's consecutive steps against standalone's,
each difference charged to its owner. Synthetic runs with known gaps must give those charges."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "gpu_sglang"))
import ttft_attribution  # noqa: E402

T0 = 1_800_000_000.0


def write(tmp: Path) -> Path:
    """Standalone: client 7, scheduler -> forward 0.4, forward 75, tail 2.2 (ms). PD `auto`:
    client -> prefill scheduler 9 (+2), decode's scheduler 0.5 later, prealloc 1, destinations
    message 0.6, forward start 0.6 later (+0.2 over standalone's 0.4), forward 77 (+2), SGLang 1.4,
    Success 0.3, message 0.45, poll 0.15, decode forward start 0.45 later, tail 2.2."""
    sa_req, pd_req, events_sa, events_pd = [], [], [], []
    for n in range(3):
        t = T0 + n * 10.0
        ms = lambda x, t=t: t + x / 1000  # noqa: E731
        sa_req.append({"room": None, "sent_at": t, "first_at": ms(7 + 0.4 + 75 + 2.2)})
        events_sa.append({"ev": "req_stats", "room": 0, "mode": "null", "stats": {
            "scheduler_recv_time": ms(7), "forward_entry_time": ms(7.4), "prefill_finished_time": ms(82.4)}})
        room = 100 + n
        marks, at = {}, 0.0
        for name, gap in [("P.scheduler_recv_time", 9), ("D.scheduler_recv_time", 0.5), ("d_meta_sent", 1),
                          ("p_ready", 0.6), ("P.forward_entry_time", 0.6), ("P.prefill_finished_time", 77),
                          ("p_last_chunk", 1.4), ("p_success", 0.3), ("d_status", 0.45),
                          ("d_poll_success", 0.15), ("D.forward_entry_time", 0.45), ("C.first_at", 2.2)]:
            at += gap
            marks[name] = ms(at)
        pd_req.append({"room": room, "sent_at": t, "first_at": marks["C.first_at"]})
        events_pd += [{"ev": ev, "room": room, "t": marks[ev]} for ev in
                      ("d_meta_sent", "p_ready", "p_last_chunk", "p_success", "d_status", "d_poll_success")]
        events_pd += [{"ev": "req_stats", "room": room, "mode": side, "stats": {
            k.split(".", 1)[1]: v for k, v in marks.items() if k.startswith(prefix)}}
            for side, prefix in (("prefill", "P."), ("decode", "D."))]
    report = {"configs": {
        "standalone": {"8192tok_c1": {"per_request": sa_req}},
        "pd_auto": {"8192tok_c1": {"per_request": pd_req}, "8192tok_c1_repeat1": {"per_request": pd_req}}}}
    (tmp / "lat.json").write_text(json.dumps(report))
    for config, events in (("standalone", events_sa), ("pd_auto", events_pd)):
        d = tmp / "logs" / f"trace-{config}"
        d.mkdir(parents=True)
        (d / "trace-1.jsonl").write_text("\n".join(json.dumps(e) for e in events) + "\n")
    return tmp / "lat.json"


def test_each_step_difference_goes_to_its_owner(tmp_path):
    out = ttft_attribution.attribute(write(tmp_path), tmp_path / "logs", "8192tok_c1")
    assert out["standalone"]["ttft_ms"] == 84.6
    for key in ("pd_auto/8192tok_c1", "pd_auto/8192tok_c1_repeat1"):
        r = out[key]
        assert r["ttft_ms"] == 93.65 and r["requests"] == 3
        assert r["excess_ms"] == pytest.approx({"front": 2.5, "sglang": 1 + 0.2 + 1.4 + 0.45,
                                                "ours": 0.6 + 0.3 + 0.45 + 0.15, "forward": 2.0})
        assert r["unexplained_ms"] == 0.0  # the steps are consecutive: they add up to the excess
        assert r["steps_ms"]["prefill -> decode scheduler (skew)"] == 0.5
