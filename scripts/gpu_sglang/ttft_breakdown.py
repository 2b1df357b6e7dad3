"""Where a PD request's time to first token goes: join the client's timestamps (pd_latency.py
--trace: per_request room, sent_at, first_at) with the servers' (room_trace.py), per request, and
print the median of each segment; per PD config also which of our threads decided each room's
Success (`success_deciders`) and how many last chunks layer-wise tracked on the scheduler's thread
(`last_chunk_inline`). Runs anywhere (no GPU): on the files a device call brought back.

Usage: ttft_breakdown.py LATENCY_JSON [LATENCY_JSON ...] --traces DIR [--shape 8192tok_c1] [--json OUT]
Each LATENCY_JSON's configs are read; a config's traces are DIR/trace-<config>/trace-*.jsonl.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter
from pathlib import Path
from typing import Dict, List, Optional

# (segment, from, to): names are client fields (C.), prefill/decode SGLang timestamps (P./D.), or
# room_trace events (p_*/d_*).
PD_SEGMENTS = [
    ("client -> prefill scheduler", "C.sent_at", "P.scheduler_recv_time"),
    ("client -> decode scheduler", "C.sent_at", "D.scheduler_recv_time"),
    ("decode scheduler -> destinations sent (prealloc, bootstrap)", "D.scheduler_recv_time", "d_meta_sent"),
    ("prefill scheduler -> destinations arrived", "P.scheduler_recv_time", "p_ready"),
    ("destinations arrived -> prefill waiting queue", "p_ready", "P.wait_queue_entry_time"),
    ("waiting queue -> forward start", "P.wait_queue_entry_time", "P.forward_entry_time"),
    ("prefill forward (start -> result processed)", "P.forward_entry_time", "P.prefill_finished_time"),
    ("result processed -> last chunk handed to us", "P.prefill_finished_time", "p_last_chunk"),
    ("last chunk -> last copy posted", "p_last_chunk", "p_submit_end"),
    ("copy posted -> copy event fired", "p_submit_end", "p_copy_done"),
    ("copy done -> Success decided", "p_copy_done", "p_success"),
    ("Success decided -> decode status thread has it", "p_success", "d_status"),
    ("decode status -> decode scheduler polls Success", "d_status", "d_poll_success"),
    ("decode poll -> prebuilt forward start", "d_poll_success", "D.forward_entry_time"),
    ("prebuilt forward start -> first token at client", "D.forward_entry_time", "C.first_at"),
    ("TTFT", "C.sent_at", "C.first_at"),
]
STANDALONE_SEGMENTS = [
    ("client -> scheduler", "C.sent_at", "S.scheduler_recv_time"),
    ("scheduler -> forward start", "S.scheduler_recv_time", "S.forward_entry_time"),
    ("forward (start -> result processed)", "S.forward_entry_time", "S.prefill_finished_time"),
    ("result processed -> first token at client", "S.prefill_finished_time", "C.first_at"),
    ("TTFT", "C.sent_at", "C.first_at"),
]


def load_traces(folder: Path) -> List[Dict]:
    events = []
    for f in sorted(folder.glob("trace-*.jsonl")):
        events += [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return events


def points_for(req: Dict, events: List[Dict], by_room: Dict, standalone_stats: Dict) -> Dict[str, float]:
    pts = {"C.sent_at": req["sent_at"], "C.first_at": req["first_at"]}
    room = req.get("room")
    if room is None:  # standalone: SGLang's stats of the request that started closest after sent_at
        cand = [s for s in standalone_stats if s["stats"].get("scheduler_recv_time", 0) >= req["sent_at"]]
        if cand:
            first = min(cand, key=lambda s: s["stats"]["scheduler_recv_time"])
            pts.update({f"S.{k}": v for k, v in first["stats"].items()})
        return pts
    for e in by_room.get(room, []):
        if e["ev"] == "req_stats":
            side = "P" if e["mode"] == "prefill" else "D"
            pts.update({f"{side}.{k}": v for k, v in e["stats"].items()})
        else:
            if e["ev"] == "p_success" and "p_success" not in pts:
                # Which of our threads decided (room_trace.py); traces before it have no such field.
                pts["decider"] = e.get("decider", "unrecorded")
            if e["ev"] in ("p_ready", "d_status") and e["ev"] not in pts:
                # Who read the message: SGLang's poll or our thread (room_trace.py, inbox.py).
                pts[f"{e['ev']}_reader"] = e.get("reader", "unrecorded")
            pts.setdefault(e["ev"], e["t"])
    # The room's copies: the last batch posted before its Success, and the copy event after it.
    if "p_success" in pts and "P.forward_entry_time" in pts:
        lo, hi = pts["P.forward_entry_time"], pts["p_success"]
        subs = [e for e in events if e["ev"] == "p_submit" and lo <= e["t"] <= hi]
        if subs:
            last = max(subs, key=lambda e: e["t"])
            pts["p_submit_end"] = last["t_end"]
            pts["p_first_submit"] = min(e["t_start"] for e in subs)
            pts["submits"] = len(subs)
            done = [e["t"] for e in events if e["ev"] == "p_copy_done" and last["t_end"] <= e["t"] <= hi]
            if done:
                pts["p_copy_done"] = min(done)
    return pts


def segment_medians(points: List[Dict], segments) -> Dict[str, Optional[float]]:
    out = {}
    for name, a, b in segments:
        vals = [(p[b] - p[a]) * 1000 for p in points if a in p and b in p]
        out[name] = round(statistics.median(vals), 2) if vals else None
    return out


def config_events(traces: Path, config: str):
    """One configuration's trace events, the same grouped by room, and SGLang's per-request stats."""
    events = load_traces(traces / f"trace-{config}")
    by_room: Dict = {}
    for e in events:
        by_room.setdefault(e.get("room"), []).append(e)
    return events, by_room, [e for e in events if e["ev"] == "req_stats"]


def breakdown(latency_json: Path, traces: Path, shape: str) -> Dict:
    report = json.loads(latency_json.read_text())
    out = {}
    for config, res in report["configs"].items():
        if shape not in res:
            continue
        events, by_room, stats = config_events(traces, config)
        reqs = [r for r in res[shape]["per_request"] if r.get("first_at")]
        pts = [points_for(r, events, by_room, stats) for r in reqs]
        segs = STANDALONE_SEGMENTS if config == "standalone" else PD_SEGMENTS
        out[config] = {"requests": len(pts), "segments_ms_p50": segment_medians(pts, segs)}
        # Which sglang_mori the config's servers imported (room_trace's `process` events).
        out[config]["sglang_mori"] = sorted({e["sglang_mori"] for e in events if e["ev"] == "process"})
        if config != "standalone":
            lw = [(p["P.prefill_finished_time"] - p["p_first_submit"]) * 1000 for p in pts
                  if "p_first_submit" in p and "P.prefill_finished_time" in p]
            out[config]["first_copy_before_forward_end_ms_p50"] = round(statistics.median(lw), 2) if lw else None
            out[config]["submits_per_request_p50"] = statistics.median([p.get("submits", 0) for p in pts]) if pts else None
            out[config]["success_deciders"] = dict(sorted(Counter(p["decider"] for p in pts if "decider" in p).items()))
            out[config]["last_chunk_inline"] = sum(1 for p in pts if "p_last_inline" in p)
            for ev, key in (("p_ready", "destinations_readers"), ("d_status", "success_readers")):
                out[config][key] = dict(sorted(Counter(p[f"{ev}_reader"] for p in pts if f"{ev}_reader" in p).items()))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("latency_json", nargs="+")
    ap.add_argument("--traces", required=True, action="append", help="one per latency_json, in order")
    ap.add_argument("--shape", default="8192tok_c1")
    ap.add_argument("--json")
    args = ap.parse_args()
    result = {}
    for lj, tr in zip(args.latency_json, args.traces):
        for config, r in breakdown(Path(lj), Path(tr), args.shape).items():
            # The same config from another run keeps its own entry, named after its file.
            result[config if config not in result else f"{config} ({Path(lj).stem})"] = r
    for config, r in result.items():
        print(f"== {config} ({r['requests']} requests, {args.shape})")
        for name, v in r["segments_ms_p50"].items():
            print(f"  {name:62s} {v}")
        for k in ("sglang_mori", "first_copy_before_forward_end_ms_p50", "submits_per_request_p50", "success_deciders",
                  "last_chunk_inline", "destinations_readers", "success_readers"):
            if k in r:
                print(f"  {k:62s} {r[k]}")
    if args.json:
        Path(args.json).write_text(json.dumps({"shape": args.shape, "configs": result}, indent=1))


if __name__ == "__main__":
    main()
