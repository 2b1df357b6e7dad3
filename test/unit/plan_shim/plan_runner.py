"""Run one plans.sh plan on this CPU with fake servers: `python3` on PATH is a wrapper that records
each command line in `calls` and runs plan_shim/s20_shim.py in the real rig script's place."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
SHIM = Path(__file__).resolve().parent / "s20_shim.py"


def run_plan(tmp_path: Path, tproc: str, settings: str, plan: str):
    """`settings`: shell assignments before the plan's call (W is set here). Returns the finished
    process, the plan's work and output folders, and the command lines it ran."""
    tmp_path.mkdir(exist_ok=True)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(f'#!/bin/bash\necho "$@" >> {tmp_path}/calls\nexec {sys.executable} {SHIM} "$@"\n')
    (bin_dir / "python3").chmod(0o755)
    w, out = tmp_path / "w", tmp_path / "out"
    w.mkdir()
    out.mkdir()
    script = f"source {ROOT}/scripts/gpu_sglang/plans.sh; W={w}; {settings} {plan}"
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", ROOT=str(ROOT), OUT=str(out),
               S20_FAKE_TPROC=tproc, PYTHONPATH=str(ROOT / "python"))
    done = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    calls = tmp_path / "calls"
    return done, w, out, calls.read_text().splitlines() if calls.exists() else []
