"""Does `--disaggregation-transfer-backend mori` resolve to our classes in a fresh SGLang process?

Checked in a subprocess, exactly as a server would see it (plugins load per process), so the caller
does not import SGLang or apply the plugin's hooks to itself.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Tuple

from harness import launch

_CODE = (
    "from sglang.srt.plugins import load_plugins; load_plugins();"
    "from sglang.srt.disaggregation.utils import get_kv_class, TransferBackend, KVClassType;"
    "print(get_kv_class(TransferBackend.MORI, KVClassType.MANAGER).__module__)"
)


def plugin_serves_mori(timeout_s: float = 180.0) -> Tuple[bool, str]:
    """(True, module) when MORI's manager comes from sglang_mori; (False, what happened) otherwise."""
    proc = subprocess.run([sys.executable, "-c", _CODE], env=launch.base_env(None),
                          capture_output=True, text=True, timeout=timeout_s)
    lines = proc.stdout.strip().splitlines()
    module = lines[-1] if lines else ""
    if proc.returncode == 0 and module.startswith("sglang_mori"):
        return True, module
    return False, module or proc.stderr.strip()[-2000:]
