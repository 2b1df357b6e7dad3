"""FABRIC (UALink scale-up) allocation entry points of mori.cpp; unavailable on a CPU engine."""

from __future__ import annotations


def fabric_alloc(size: int, device: int) -> int:
    raise RuntimeError("softio: fabric memory needs AMD GPUs on a UALink fabric")


def fabric_free(ptr: int) -> None:
    raise RuntimeError("softio: fabric memory needs AMD GPUs on a UALink fabric")
