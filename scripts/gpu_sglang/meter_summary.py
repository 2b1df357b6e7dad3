"""Per config and shape of a pd_latency.py --call-meter JSON: TTFT p50/p90, ITL p50, output tok/s, and
our Python per request on the prefill and the decode scheduler processes (SGLang's calls into us +
our threads = total, microseconds; python/sglang_mori/call_meter.py), against issue 28's goals
(prefill <= 150 us, decode <= 100 us). Usage: meter_summary.py LATENCY.json [...]"""

from __future__ import annotations

import json
import sys
from typing import Dict, Iterable, List

GOALS_US = {"prefill": 150, "decode": 100}


def side(figures: Dict, role: str) -> str:
    f = (figures or {}).get(role) or {}
    if not f.get("requests"):
        return "-"
    mark = "ok" if f["total_us"] <= GOALS_US[role] else "OVER"
    return f"{f['total_us']} = {f['scheduler_calls_us']} + {f['our_threads_us']} ({mark})"


def rows(report: Dict) -> Iterable[List[str]]:
    for name, res in report.get("configs", {}).items():
        for key, m in res.items():
            if isinstance(m, dict) and "ttft_ms_p50" in m:
                meter = m.get("call_meter")
                yield [name, key, str(m["ttft_ms_p50"]), str(m["ttft_ms_p90"]), str(m["itl_ms_p50"]),
                       str(m["output_tok_s"]), f"{m['ok']}/{m['requests']}", side(meter, "prefill"), side(meter, "decode")]


def failures(report: Dict) -> Iterable[str]:
    for name, res in report.get("configs", {}).items():
        if "failed" in res:
            yield f"{name} FAILED: {str(res['failed'])[:300]}"


def top_calls(report: Dict, limit: int = 3) -> Iterable[str]:
    """The largest calls and threads per request of each measurement (what the totals are made of)."""
    for name, res in report.get("configs", {}).items():
        for key, m in res.items():
            for role, f in ((m.get("call_meter") or {}) if isinstance(m, dict) else {}).items():
                if f.get("requests"):
                    calls = ", ".join(f"{k} {v}" for k, v in list(f["calls_us"].items())[:limit])
                    threads = ", ".join(f"{k} {v}" for k, v in sorted(f["threads_us"].items(), key=lambda kv: -kv[1])[:limit])
                    inner = ", ".join(f"{k} {v}" for k, v in list(f.get("inner_us", {}).items())[:limit])
                    yield (f"{name} {key} {role}: calls {calls}; ours inside them {inner or '-'}; threads {threads}; "
                           f"softio threads {f['engine_threads_us']}; {f['requests']} req, {f['processes']} process(es)")


def main(argv: List[str] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    header = ["config", "shape", "TTFT p50", "p90", "ITL p50", "tok/s", "ok", "prefill us/req", "decode us/req"]
    table = [header]
    details: List[str] = []
    fails: List[str] = []
    for path in argv:
        report = json.loads(open(path).read())
        table += list(rows(report))
        fails += list(failures(report))
        details += list(top_calls(report))
    # the table last: a device call's output keeps its tail (run_plan prints each .out's last 25 lines)
    for line in details + fails:
        print(line)
    widths = [max(len(r[i]) for r in table if i < len(r)) for i in range(len(header))]
    for r in table:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    print("us/req: total = SGLang's calls into us + our threads, per scheduler process (goals: prefill <= 150, decode <= 100)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
