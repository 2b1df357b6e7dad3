"""Pick the MORI-IO module named by SGLANG_MORI_ENGINE. Never falls back silently."""

from __future__ import annotations

import importlib


class EngineUnavailable(RuntimeError):
    pass


ENGINE_MODULES = {"mori": "mori.io", "soft": "sglang_mori.softio"}


def load_io_module(engine: str):
    """Import the module for `engine` ("mori" or "soft"); explain how to choose the other on failure."""
    if engine not in ENGINE_MODULES:
        raise EngineUnavailable(
            f"SGLANG_MORI_ENGINE={engine!r}: expected one of {sorted(ENGINE_MODULES)}"
        )
    name = ENGINE_MODULES[engine]
    try:
        return importlib.import_module(name)
    except Exception as exc:  # ImportError, or OSError from a missing ROCm library
        hint = (
            " MORI-IO needs the amd-mori package (pip install amd-mori) and the ROCm runtime "
            "(libamdhip64.so); `sglang-mori doctor` checks both. To run on CPU memory over TCP "
            "instead (tests, demos), set SGLANG_MORI_ENGINE=soft."
            if engine == "mori"
            else ""
        )
        raise EngineUnavailable(
            f"SGLANG_MORI_ENGINE={engine}: cannot import {name}: {type(exc).__name__}: {exc}.{hint}"
        ) from exc
