"""Split each traced prefill forward into its steps, per configuration (forward_trace.py's `fwd`
lines joined with SGLang's per-request timestamps and softio's posts; issue 27, session 16).

    python3 scripts/gpu_sglang/forward_timeline.py LOGS [--configs standalone,pd_auto,...]

LOGS is pd_latency.py's logs folder (trace-<config>/*.jsonl). Per config, medians in ms over the
forwards of at least --min-tokens tokens:

  forward start -> run_batch       SGLang's scheduling after it stamped the forward's start
  begin_batch                      our layer-wise publication (CPU, before the first kernel)
  run_batch entry -> launch done   the scheduler thread's launch of the whole forward
  attn k (GPU)                     GPU time from run_batch's entry to layer k's attention end
  layer k-1 -> k (GPU)             one layer's GPU time
  GPU end                          to the forward stream's end (sampling, result copy)
  GPU end -> result processed      the scheduler's wake-up and result processing
  forward (start -> result processed)
  layer end -> copy posted         softio's post after the layer that completed a group (the
                                   layer-wise worker's event wait and posting; wall-clock against
                                   the GPU mark, so it includes the base event's own lag)
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
from typing import Dict, List


def load(folder: str) -> List[dict]:
    events = []
    for path in glob.glob(os.path.join(folder, "*.jsonl")):
        with open(path) as fh:
            events += [json.loads(line) for line in fh if line.strip()]
    return events


def forwards(events: List[dict], min_tokens: int = 1024) -> List[Dict[str, float]]:
    """One row of steps (ms) per traced forward that a prefill request's timestamps frame."""
    # (a decode server's prebuilt batch has extend tokens but no attention layer: not a forward here)
    fwds = sorted((e for e in events if e["ev"] == "fwd" and e.get("tokens", 0) >= min_tokens
                   and e.get("gpu_attn_ms")),
                  key=lambda e: e["t_enter"])
    reqs = [e["stats"] for e in events if e["ev"] == "req_stats" and e.get("mode") != "decode"
            and "forward_entry_time" in e.get("stats", {}) and "prefill_finished_time" in e["stats"]]
    posts = sorted(e["t_start"] for e in events if e["ev"] == "p_submit")
    rows = []
    for f in fwds:
        t0 = f["t_enter"]
        framing = [s for s in reqs if s["forward_entry_time"] <= t0 <= s["prefill_finished_time"]]
        if not framing:
            continue
        s = framing[-1]
        start, done = s["forward_entry_time"], s["prefill_finished_time"]
        row = {"forward start -> run_batch": (t0 - start) * 1e3,
               "run_batch entry -> launch done": (f["t_exit"] - t0) * 1e3,
               "GPU end": f["gpu_end_ms"],
               "GPU end -> result processed": (done - t0) * 1e3 - f["gpu_end_ms"],
               "forward (start -> result processed)": (done - start) * 1e3,
               "on_layer CPU (sum)": f.get("on_layer_ms", 0.0)}
        if "begin_t0" in f:
            row["begin_batch"] = (f["begin_t1"] - f["begin_t0"]) * 1e3
        attn = f["gpu_attn_ms"]
        for k, ms in enumerate(attn, 1):
            row[f"attn {k} (GPU)"] = ms
            row[f"attn {k} CPU lead"] = ms - f["cpu_attn_ms"][k - 1]
            if k > 1:
                row[f"layer {k - 1} -> {k} (GPU)"] = ms - attn[k - 2]
        walls = [t0 + ms / 1e3 for ms in attn]
        lags = []
        for p in posts:
            if t0 <= p <= done:
                before = [w for w in walls if w <= p]
                if before:
                    lags.append((p - before[-1]) * 1e3)
        if lags:
            row["layer end -> copy posted (first)"] = lags[0]
            row["layer end -> copy posted (median)"] = statistics.median(lags)
        rows.append(row)
    return rows


def summary(rows: List[Dict[str, float]]) -> Dict[str, float]:
    keys = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    return {k: round(statistics.median([r[k] for r in rows if k in r]), 3) for k in keys}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("logs")
    ap.add_argument("--configs", default="")
    ap.add_argument("--min-tokens", type=int, default=1024)
    args = ap.parse_args(argv)
    configs = [c for c in args.configs.split(",") if c] or sorted(
        os.path.basename(p)[len("trace-"):] for p in glob.glob(os.path.join(args.logs, "trace-*")))
    for config in configs:
        rows = forwards(load(os.path.join(args.logs, f"trace-{config}")), args.min_tokens)
        print(f"== {config} ({len(rows)} forwards)")
        for key, value in summary(rows).items():
            print(f"  {key:<44} {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
