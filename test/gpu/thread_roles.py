"""Per-thread-role CPU of this process: the harness's `thread_cpu` module, loaded by path (the
harness package itself imports SGLang, which the GPU host does not have)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_PATH = Path(__file__).resolve().parents[1] / "harness" / "pd" / "thread_cpu.py"
_spec = importlib.util.spec_from_file_location("gpu_thread_cpu", _PATH)
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)

ThreadCpu = _module.ThreadCpu
role = _module.role
