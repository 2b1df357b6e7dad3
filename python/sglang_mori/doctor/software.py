"""Checks of the software stack: SGLang, the mori module, the engine choice, ROCm, AMD GPUs."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
from dataclasses import dataclass
from typing import Optional

from .host import HostView
from .result import CheckResult, Status

SGLANG_VERSION = "0.5.23"
MORI_MIN_VERSION = (1, 2, 4)  # first amd-mori with IOEngine.pop_peer_failure
AMD_PCI_VENDOR = "0x1002"

# Runs in a child interpreter: importing mori.io loads libamdhip64 and may abort the process on a
# broken ROCm install, which must not take the doctor down with it.
_MORI_PROBE = r"""
import importlib.metadata as md, importlib.util, json
out = {"found": importlib.util.find_spec("mori") is not None}
if out["found"]:
    try:
        out["dist"] = md.version("amd-mori")
    except md.PackageNotFoundError:
        out["dist"] = None
    import mori
    out["version"] = getattr(mori, "__version__", None)
    import mori.io
    out["pop_peer_failure"] = hasattr(mori.io.IOEngine, "pop_peer_failure")
print("MORI_PROBE " + json.dumps(out))
"""


@dataclass
class MoriProbe:
    found: bool
    importable: bool
    version: Optional[str] = None
    peer_failure_api: bool = False
    error: str = ""


def probe_mori(host: HostView, timeout_s: float = 120.0) -> MoriProbe:
    try:
        proc = subprocess.run([host.python, "-c", _MORI_PROBE], env=dict(host.env),
                              capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return MoriProbe(True, False, error=f"import mori.io hung for {timeout_s:.0f} s")
    except OSError as exc:
        return MoriProbe(False, False, error=f"cannot run {host.python}: {exc}")
    for line in proc.stdout.splitlines():
        if line.startswith("MORI_PROBE "):
            data = json.loads(line[len("MORI_PROBE "):])
            if not data["found"]:
                return MoriProbe(False, False)
            return MoriProbe(True, True, data.get("dist") or data.get("version"),
                             bool(data.get("pop_peer_failure")))
    lines = [x for x in (proc.stderr or "").strip().splitlines() if x.strip()]
    why = lines[-1] if lines else f"exit code {proc.returncode}"
    if proc.returncode < 0:
        why = f"killed by signal {-proc.returncode} ({why})"
    return MoriProbe(True, False, error=why)


def _version_tuple(text: str):
    parts = []
    for piece in text.split("+")[0].split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def check_sglang() -> CheckResult:
    try:
        version = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return CheckResult("sglang", Status.FAIL, "not installed",
                           f"pip install sglang=={SGLANG_VERSION} (or use a ROCm SGLang image)")
    if version != SGLANG_VERSION:
        return CheckResult("sglang", Status.FAIL,
                           f"{version} installed; sglang-mori supports {SGLANG_VERSION} exactly",
                           f"pip install sglang=={SGLANG_VERSION}, or uninstall sglang-mori")
    return CheckResult("sglang", Status.OK, version)


def check_mori(probe: MoriProbe) -> CheckResult:
    if not probe.found:
        return CheckResult("mori", Status.ABSENT, "python module `mori` not installed",
                           "pip install amd-mori (ROCm host), or SGLANG_MORI_ENGINE=soft on CPU")
    if not probe.importable:
        return CheckResult("mori", Status.FAIL, f"`import mori.io` fails: {probe.error}",
                           "install the ROCm runtime amd-mori was built for; check libamdhip64 below")
    version = probe.version or "unknown version"
    if probe.version and _version_tuple(probe.version) < MORI_MIN_VERSION:
        return CheckResult("mori", Status.WARN, f"amd-mori {version}: older than 1.2.4",
                           "pip install -U amd-mori (1.2.4 adds pop_peer_failure: faster peer-death detection)")
    if not probe.peer_failure_api:
        return CheckResult("mori", Status.WARN,
                           f"amd-mori {version} without IOEngine.pop_peer_failure; dead peers are "
                           "found by timeouts only", "pip install -U amd-mori")
    return CheckResult("mori", Status.OK, f"amd-mori {version}, pop_peer_failure available")


def count_amd_gpus(host: HostView) -> int:
    drm = host.sys_root / "class" / "drm"
    if not drm.is_dir():
        return 0
    cards = [p for p in drm.iterdir() if p.name.startswith("card") and p.name[4:].isdigit()]
    return sum(1 for c in cards if host.read(c / "device" / "vendor") == AMD_PCI_VENDOR)


def check_engine(host: HostView, probe: MoriProbe, amd_gpus: int) -> CheckResult:
    engine = host.env.get("SGLANG_MORI_ENGINE", "mori")
    if engine == "soft":
        if amd_gpus:
            return CheckResult("engine", Status.WARN,
                               f"SGLANG_MORI_ENGINE=soft on a host with {amd_gpus} AMD GPUs: KV goes "
                               "over TCP from CPU memory", "unset SGLANG_MORI_ENGINE to use MORI-IO")
        return CheckResult("engine", Status.OK, "SGLANG_MORI_ENGINE=soft: softio (CPU memory, TCP)")
    if engine != "mori":
        return CheckResult("engine", Status.FAIL, f"SGLANG_MORI_ENGINE={engine!r} is not mori|soft",
                           "set SGLANG_MORI_ENGINE=mori (default) or soft")
    if probe.importable:
        return CheckResult("engine", Status.OK, "SGLANG_MORI_ENGINE=mori: MORI-IO importable")
    return CheckResult("engine", Status.FAIL,
                       "SGLANG_MORI_ENGINE=mori (default) but mori.io cannot be imported: the "
                       "backend will refuse to start",
                       "install amd-mori on a ROCm host; on a CPU-only host set SGLANG_MORI_ENGINE=soft")


def check_rocm_library(host: HostView, stem: str) -> CheckResult:
    found = host.find_library(stem)
    if found:
        return CheckResult(stem, Status.OK, str(found))
    return CheckResult(stem, Status.ABSENT, "not found in " + ", ".join(
        str(d) for d in host.search_dirs()[:4]) + ", ...",
        "install ROCm (or add its lib dir to LD_LIBRARY_PATH / set ROCM_PATH)")


def check_amd_gpus(host: HostView, amd_gpus: int) -> CheckResult:
    loaded = host.module_loaded("amdgpu")
    if amd_gpus:
        detail = f"{amd_gpus} AMD GPUs" + ("" if loaded else " but amdgpu module not in /sys/module")
        return CheckResult("amd gpus", Status.OK if loaded else Status.WARN, detail,
                           "" if loaded else "modprobe amdgpu (ROCm kernel driver)")
    if loaded:
        return CheckResult("amd gpus", Status.WARN, "amdgpu loaded but no AMD GPU under /sys/class/drm",
                           "check `rocm-smi`; inside a container pass --device=/dev/kfd --device=/dev/dri")
    return CheckResult("amd gpus", Status.ABSENT, "no AMD GPU (PCI vendor 0x1002) in /sys/class/drm",
                       "run on an MI300X/MI355X node; inside a container pass /dev/kfd and /dev/dri")
