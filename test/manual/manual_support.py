"""Shared by the AMD-hardware tests, above all their gate: skipped (with the reason) unless
SGLANG_MORI_MANUAL_E2E=1; once asked for, a node that lacks what a test needs FAILS with what is
missing, so a hardware run can never pass by skipping."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

SKIP_REASON = ("needs SGLANG_MORI_MANUAL_E2E=1, an AMD GPU (MI300X/MI355X) and the mori module "
               "(amd-mori); see test/manual/README.md")


def _mori_importable() -> str:
    """'' when `import mori.io` works in a fresh interpreter, else the last error line."""
    r = subprocess.run([sys.executable, "-c", "import mori.io"], capture_output=True, text=True, timeout=300)
    if r.returncode == 0:
        return ""
    lines = [x for x in r.stderr.strip().splitlines() if x.strip()]
    return lines[-1] if lines else f"exit {r.returncode}"


def _amd_gpus() -> int:
    from sglang_mori.doctor.host import HostView
    from sglang_mori.doctor.software import count_amd_gpus

    return count_amd_gpus(HostView())


def _rdma_devices() -> list:
    root = Path("/sys/class/infiniband")
    return sorted(p.name for p in root.iterdir()) if root.is_dir() else []


def require_node(gpus: int = 1, rdma: bool = False, env: tuple = ()) -> None:
    """Skip without SGLANG_MORI_MANUAL_E2E=1; fail with a list of what is missing otherwise."""
    if os.environ.get("SGLANG_MORI_MANUAL_E2E") != "1":
        pytest.skip(SKIP_REASON)
    missing = []
    err = _mori_importable()
    if err:
        missing.append(f"`import mori.io` ({err})")
    have = _amd_gpus()
    if have < gpus:
        missing.append(f"{gpus} AMD GPUs (found {have})")
    if rdma and not _rdma_devices():
        missing.append("an RDMA device in /sys/class/infiniband")
    for var in env:
        if not os.environ.get(var):
            missing.append(f"environment variable {var}")
    if missing:
        pytest.fail("SGLANG_MORI_MANUAL_E2E=1 but this node lacks: " + "; ".join(missing), pytrace=False)


def gpu_count() -> int:
    return _amd_gpus()


def rdma_devices() -> list:
    return _rdma_devices()
