"""Whose is PD's TTFT excess over standalone: the PD front, SGLang's own PD work, or ours.

ttft_breakdown.py prints each segment's median per config; this script splits a PD request's path
into consecutive steps that add up to its TTFT exactly, sets standalone's path beside it, and
charges each step's difference (PD minus standalone) to one owner:

  front   the PD front (pd_latency.py's PDClient, our stand-in for sglang_router): the client ->
          prefill scheduler path beyond standalone's, and decode's request reaching its scheduler
          later than prefill's (both requests leave the same client; any skew is the front's or
          the second HTTP server's)
  sglang  SGLang's own PD work: decode's prealloc and bootstrap before it hands us the
          destinations, the bootstrap queue -> forward start beyond standalone's scheduler ->
          forward start, result processed -> last chunk handed to us, decode's poll -> forward
          start, decode's forward -> first token beyond standalone's result -> first token
  ours    the destinations message (decode's send -> prefill publishes them), last chunk ->
          Success decided, Success -> decode has it -> decode's poll sees it
  forward the prefill forward beyond standalone's (our hooks and copies beside it, or the PD
          prefill's own loop: pd_off's forward, without hooks, tells which)

Each measurement (a config's shape key: 8192tok_c1, 8192tok_c1_repeat1, ...) gives the median of
each step over its requests; PD steps are compared with the mean of the same JSON's standalone
medians (the same call). Steps are medians, so their sum differs from the TTFT median's excess by
a little (printed as `unexplained`).

Usage: ttft_attribution.py LATENCY_JSON --traces LOGS [LATENCY_JSON --traces LOGS ...]
       [--label NAME ...] [--shape 8192tok_c1] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Dict, List, Optional

from ttft_breakdown import config_events, points_for

# (step, from, to, owner); consecutive, so a request's steps add up to its TTFT.
PD_STEPS = [
    ("client -> prefill scheduler", "C.sent_at", "P.scheduler_recv_time", "front"),
    ("prefill -> decode scheduler (skew)", "P.scheduler_recv_time", "D.scheduler_recv_time", "front"),
    ("decode prealloc + bootstrap", "D.scheduler_recv_time", "d_meta_sent", "sglang"),
    ("destinations message", "d_meta_sent", "p_ready", "ours"),
    ("destinations -> forward start", "p_ready", "P.forward_entry_time", "sglang"),
    ("prefill forward", "P.forward_entry_time", "P.prefill_finished_time", "forward"),
    ("result -> last chunk handed to us", "P.prefill_finished_time", "p_last_chunk", "sglang"),
    ("last chunk -> Success decided", "p_last_chunk", "p_success", "ours"),
    ("Success -> decode has it", "p_success", "d_status", "ours"),
    ("decode has it -> decode's poll", "d_status", "d_poll_success", "ours"),
    ("decode's poll -> decode forward start", "d_poll_success", "D.forward_entry_time", "sglang"),
    ("decode forward -> first token", "D.forward_entry_time", "C.first_at", "sglang"),
]
# Standalone's steps and the PD steps each is set against (their sum is subtracted).
STANDALONE_STEPS = [
    ("client -> prefill scheduler", "C.sent_at", "S.scheduler_recv_time"),
    ("destinations -> forward start", "S.scheduler_recv_time", "S.forward_entry_time"),
    ("prefill forward", "S.forward_entry_time", "S.prefill_finished_time"),
    ("decode forward -> first token", "S.prefill_finished_time", "C.first_at"),
]
OWNERS = ("front", "sglang", "ours", "forward")


def median_ms(points: List[Dict], a: str, b: str) -> Optional[float]:
    vals = [(p[b] - p[a]) * 1000 for p in points if a in p and b in p]
    return statistics.median(vals) if vals else None


def measurements(latency_json: Path, traces: Path, shape: str) -> Dict[str, Dict[str, List[Dict]]]:
    """config -> shape key (shape and its repeats) -> per-request points."""
    report = json.loads(latency_json.read_text())
    out: Dict[str, Dict[str, List[Dict]]] = {}
    for config, res in report["configs"].items():
        keys = [k for k in res if k == shape or k.startswith(f"{shape}_repeat")]
        if not keys:
            continue
        events, by_room, stats = config_events(traces, config)
        out[config] = {k: [points_for(r, events, by_room, stats) for r in res[k]["per_request"]
                           if r.get("first_at")] for k in keys}
    return out


def attribute(latency_json: Path, traces: Path, shape: str) -> Dict:
    """Per PD config and measurement: each step's median, standalone's, the excess per owner."""
    runs = measurements(latency_json, traces, shape)
    sa = runs.get("standalone")
    if not sa:
        return {}
    sa_steps = {name: statistics.mean(v for v in (median_ms(pts, a, b) for pts in sa.values()) if v is not None)
                for name, a, b in STANDALONE_STEPS}
    sa_ttft = statistics.mean(median_ms(pts, "C.sent_at", "C.first_at") for pts in sa.values())
    out = {"standalone": {"steps_ms": {k: round(v, 2) for k, v in sa_steps.items()}, "ttft_ms": round(sa_ttft, 2)}}
    for config, keys in runs.items():
        if config == "standalone":
            continue
        for key, pts in keys.items():
            steps = {name: median_ms(pts, a, b) for name, a, b, _ in PD_STEPS}
            if any(v is None for v in steps.values()):
                continue  # a trace without decode's or prefill's events cannot be split
            excess = {o: 0.0 for o in OWNERS}
            for name, _, _, owner in PD_STEPS:
                excess[owner] += steps[name] - sa_steps.get(name, 0.0)
            ttft = median_ms(pts, "C.sent_at", "C.first_at")
            out[f"{config}/{key}"] = {
                "requests": len(pts), "ttft_ms": round(ttft, 2), "over_standalone_pct": round(100 * (ttft / sa_ttft - 1), 1),
                "steps_ms": {k: round(v, 2) for k, v in steps.items()},
                "excess_ms": {k: round(v, 2) for k, v in excess.items()},
                "unexplained_ms": round(ttft - sa_ttft - sum(excess.values()), 2)}
    return out


def spread(values: List[float]) -> str:
    vals = sorted(values)
    return f"{statistics.median(vals):6.2f} [{vals[0]:.2f}, {vals[-1]:.2f}]"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("latency_json", nargs="+")
    ap.add_argument("--traces", required=True, action="append", help="one per latency_json, in order")
    ap.add_argument("--label", action="append", help="one per latency_json: the run's name in the output")
    ap.add_argument("--shape", default="8192tok_c1")
    ap.add_argument("--config", default="pd_auto", help="the PD config summarised over all runs")
    ap.add_argument("--json")
    args = ap.parse_intermixed_args()  # LATENCY_JSON --traces LOGS pairs, in any interleaving
    labels = args.label or [Path(p).parent.as_posix() for p in args.latency_json]
    result = {}
    for lj, tr, label in zip(args.latency_json, args.traces, labels):
        result[label] = attribute(Path(lj), Path(tr), args.shape)
    rows = [(label, k, v) for label, r in result.items() for k, v in r.items()
            if k.split("/")[0] == args.config]
    for label, key, r in rows:
        sa = result[label]["standalone"]["ttft_ms"]
        print(f"{label:14s} {key:34s} TTFT {r['ttft_ms']:6.2f} vs {sa:6.2f} ({r['over_standalone_pct']:+.1f} %)  "
              + "  ".join(f"{o} {r['excess_ms'][o]:+.2f}" for o in OWNERS) + f"  rest {r['unexplained_ms']:+.2f}")
    if rows:
        print(f"\n{args.config}: median [min, max] over {len(rows)} measurements, ms")
        for name, _, _, owner in PD_STEPS:
            sa_vals = [result[label]["standalone"]["steps_ms"].get(name, 0.0) for label, _, _ in rows]
            print(f"  {owner:8s} {name:40s} {spread([r['steps_ms'][name] for _, _, r in rows])}"
                  f"   standalone {spread(sa_vals)}")
        for o in OWNERS:
            print(f"  excess {o:8s} {spread([r['excess_ms'][o] for _, _, r in rows])}")
        print(f"  excess total    {spread([sum(r['excess_ms'].values()) for _, _, r in rows])}")
    if args.json:
        Path(args.json).write_text(json.dumps({"shape": args.shape, "runs": result}, indent=1))


if __name__ == "__main__":
    main()
