#!/usr/bin/env python3
"""One compact line per point of `scripts/gpu_bench.py --parts link` JSONs (plans.sh s17_link):
the run's label (the file name), shape, tokens, plain copy GB/s, ours per request and in bursts as
a ratio of the plain copy, the kernel's ratio, and a lone request's phases in ms (to submit /
submit / copy wait / to Success). `python3 link_summary.py FILE.json...`"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def line(label: str, point: dict) -> str:
    ours = point["ours"]
    plain = point["plain_copy"]["gbps"]
    kernel = point.get("kernel", {}).get("gbps")
    phases = ours.get("phases_ms") or {}
    split = "/".join(f"{phases[k]:.2f}" for k in ("to_submit", "submit", "copy_wait", "to_success") if k in phases)
    burst = ours.get("burst_phases_ms") or {}
    idle = f", burst stream idle {burst['stream_idle']:.2f} ms" if "stream_idle" in burst else ""
    return (f"{label:<12} {point['shape'].split('-')[-1]:<3} {point['tokens']:>6}: plain {plain:5.0f} GB/s, ours "
            f"{ours['vs_plain_copy']:.2f}x ({ours['s'] * 1e3:.2f} ms), burst {ours['per_s_vs_plain_copy']:.2f}x"
            + (f", kernel {kernel / plain:.2f}x" if kernel else "")
            + (f" (shared {point['kernel_shared']['vs_plain_copy']:.2f}x)" if "kernel_shared" in point else "")
            + (f", phases {split} ms" if split else "") + idle)


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
