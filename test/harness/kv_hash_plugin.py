"""Loads scripts/gpu_sglang/kv_hash.py (the KV byte check of the GPU runs) into CPU servers: SGLang
finds plugins through entry points, so a dist-info naming it goes into a folder on PYTHONPATH."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Dict

from harness import launch

GPU_SGLANG = Path(__file__).resolve().parents[2] / "scripts" / "gpu_sglang"
sys.path.insert(0, str(GPU_SGLANG))
import kv_hash as KV_HASH  # noqa: E402,N812


def kv_hash_plugin_env(plugin_dir: Path, record_dir: Path, *, prefill_tp: int) -> Dict[str, str]:
    """Server environment: the CPU hooks and kv_hash as plugins, recording under record_dir."""
    info = plugin_dir / "sglang_mori_kv_hash-0.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang-mori-kv-hash\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text("[sglang.srt.plugins]\nkv_hash = kv_hash:register\n")
    return {"PYTHONPATH": launch.plugin_pythonpath(launch.CPU_HOOKS, plugin_dir, GPU_SGLANG),
            KV_HASH.ENV: str(record_dir), KV_HASH.PREFILL_TP_ENV: str(prefill_tp)}
