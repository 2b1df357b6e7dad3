#!/usr/bin/env python3
"""One compact line per point of `scripts/gpu_bench.py --parts link` JSONs (plans.sh s17_link):
the run's label (the file name), shape, tokens, plain copy GB/s, ours per request and in bursts as
a ratio of the plain copy, the kernel's ratio, a lone request's phases in ms (ours to the engine
call | the engine's Python to its submit | submit | copy wait | the engine's completion | ours to
Success; a run from before session 19: to submit / submit / copy wait / to Success), and the
projection with the engine's own Python at zero (a C++ engine; labelled, beside the measured
ratio). `python3 link_summary.py FILE.json...`"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# A lone request's phases in path order: session 19's split, then the one before it.
SPLIT = ("ours_to_engine", "engine_to_submit", "submit", "copy_wait", "engine_completion", "ours_to_success")
SPLIT_S17 = ("to_submit", "submit", "copy_wait", "to_success")
SPLIT_CPU = ("ours_to_engine", "engine_call", "call_to_success")


def phase_split(phases: dict) -> str:
    """"a|b|c" of the first key set `phases` has all of (ms), "" when none."""
    for keys in (SPLIT, SPLIT_CPU, SPLIT_S17):
        if all(k in phases for k in keys):
            return "|".join(f"{phases[k]:.2f}" for k in keys)
    return ""


def line(label: str, point: dict) -> str:
    ours = point["ours"]
    plain = point["plain_copy"]["gbps"]
    kernel = point.get("kernel", {}).get("gbps")
    phases = ours.get("phases_ms") or {}
    split = phase_split(phases)
    zero = ours.get("engine_python_zero")
    projected = (f", projected with the engine's Python at zero {zero['vs_plain_copy']:.2f}x "
                 f"(-{zero['engine_python_ms']:.2f} ms; not measured)") if zero else ""
    burst = ours.get("burst_phases_ms") or {}
    idle = f", burst stream idle {burst['stream_idle']:.2f} ms" if "stream_idle" in burst else ""
    return (f"{label:<12} {point['shape'].split('-')[-1]:<3} {point['tokens']:>6}: plain {plain:5.0f} GB/s, ours "
            f"{ours['vs_plain_copy']:.2f}x ({ours['s'] * 1e3:.2f} ms), burst {ours['per_s_vs_plain_copy']:.2f}x"
            + (f", kernel {kernel / plain:.2f}x" if kernel else "")
            + (f" (shared {point['kernel_shared']['vs_plain_copy']:.2f}x)" if "kernel_shared" in point else "")
            + (f", phases {split} ms" if split else "") + projected + idle + bytes_note(ours.get("bytes_check")))


def bytes_note(check: dict | None) -> str:
    """The point's byte check (link_bench.bytes_check), where it ran."""
    if not check:
        return ""
    if "error" in check:
        return f", bytes check ERROR {check['error'][:120]}"
    return f", bytes {check['pages'] - check['mismatched']}/{check['pages']} pages equal"


def main(paths) -> int:
    for path in paths:
        label = Path(path).stem
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            print(f"{label}: unreadable ({exc})")
            continue
        if not data.get("results"):
            print(f"{label}: no point measured")
        for point in data.get("results", []):
            print(line(label, point))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
