"""GPU tests: softio's device path and the layer-wise rig on a CUDA GPU (ROCm's torch.cuda is the
same API). They run only with SGLANG_MORI_GPU_TESTS=1 on a host whose torch sees a GPU; everywhere
else (CI included) they are reported as skipped, with the reason."""

import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
for path in (HERE, HERE.parent / "inprocess"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))


def gpu_tests_enabled() -> str | None:
    """None when the GPU tests can run, else why not."""
    if os.environ.get("SGLANG_MORI_GPU_TESTS") != "1":
        return "GPU tests need SGLANG_MORI_GPU_TESTS=1"
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "torch sees no GPU"
    return None


def pytest_collection_modifyitems(config, items):
    reason = gpu_tests_enabled()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(skip)
