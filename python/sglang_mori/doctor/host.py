"""Where the doctor looks: every path and the environment are injectable for tests."""

from __future__ import annotations

import glob
import gzip
import importlib.util
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Mapping, Optional

# Directories the ROCm runtime and the verbs providers are normally installed in.
DEFAULT_LIB_DIRS = (
    "/opt/rocm/lib", "/opt/rocm/lib64", "/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib",
    "/usr/local/lib", "/usr/local/lib/x86_64-linux-gnu",
)


def _torch_lib_dir() -> Optional[str]:
    """torch's lib/ directory, found without importing torch (slow, and may be broken)."""
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin:
        return None
    return os.path.join(os.path.dirname(spec.origin), "lib")


@dataclass
class HostView:
    sys_root: Path = Path("/sys")
    proc_root: Path = Path("/proc")
    boot_root: Path = Path("/boot")
    lib_dirs: Optional[List[Path]] = None  # None: LD_LIBRARY_PATH, ROCM_PATH, DEFAULT_LIB_DIRS
    env: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    python: str = sys.executable  # used to import mori in a child process
    timeout_s: float = 3.0  # per network probe

    def search_dirs(self) -> List[Path]:
        if self.lib_dirs is not None:
            return list(self.lib_dirs)
        dirs = [p for p in self.env.get("LD_LIBRARY_PATH", "").split(":") if p]
        if self.env.get("ROCM_PATH"):
            dirs.append(os.path.join(self.env["ROCM_PATH"], "lib"))
        dirs += sorted(glob.glob("/opt/rocm-*/lib"))
        dirs += DEFAULT_LIB_DIRS
        torch_lib = _torch_lib_dir()  # ROCm builds of torch bundle the HIP runtime there
        if torch_lib:
            dirs.append(torch_lib)
        return [Path(d) for d in dict.fromkeys(dirs)]

    def find_library(self, stem: str) -> Optional[Path]:
        """First `<stem>.so*` (or `<stem>-*.so*`, as verbs providers are named) in the search dirs,
        including their libibverbs/ subfolder where distributions keep the providers."""
        for d in self.search_dirs():
            for sub in (d, d / "libibverbs"):
                hits = sorted(glob.glob(str(sub / f"{stem}.so*")) +
                              glob.glob(str(sub / f"{stem}-*.so*")))
                if hits:
                    return Path(hits[0])
        return None

    def module_loaded(self, name: str) -> bool:
        return (self.sys_root / "module" / name).is_dir()

    def read(self, path: Path) -> Optional[str]:
        try:
            return path.read_text().strip()
        except OSError:
            return None

    def kernel_config(self) -> Optional[str]:
        """The running kernel's build config, from /proc/config.gz or /boot/config-<release>."""
        gz = self.proc_root / "config.gz"
        try:
            with gzip.open(gz, "rt") as fh:
                return fh.read()
        except OSError:
            pass
        release = self.read(self.proc_root / "sys" / "kernel" / "osrelease")
        if release:
            return self.read(self.boot_root / f"config-{release}")
        return None
