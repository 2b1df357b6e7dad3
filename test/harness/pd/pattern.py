"""Deterministic byte content for every KV, aux and state item the harness moves.

Bytes are a hash of (seed, buffer kind, layer, prefill slot, global head, byte offset): prefill
writes them into its pool, decode recomputes them for the slots it expects, so neither side needs
the other's memory. Keying by the *prefill* slot and the *global* head means a page read from the
wrong place, a head from the wrong TP rank or a layer swapped with another all show up as a
mismatch. Every prefill slot is filled, including pages no room uses, for the same reason.
"""

from __future__ import annotations

import numpy as np

KIND_K, KIND_V, KIND_MLA, KIND_AUX, KIND_STATE = 1, 2, 3, 4, 5
# An MTP/EAGLE draft model's KV buffers (indexed by draft layer).
KIND_DRAFT_K, KIND_DRAFT_V, KIND_DRAFT_MLA = 6, 7, 8
# Qwen3-Next-shaped linear-attention state (harness/pd/mamba.py), keyed by global position.
KIND_CONV, KIND_TEMPORAL, KIND_SHORT_CONV = 9, 10, 11

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer on a uint64 array (wrapping arithmetic is what we want)."""
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


def buffer_key(seed: int, kind: int, index: int, rank: int = 0) -> int:
    """Key of one registered buffer: (kind, layer or buffer index, source). The source tells
    apart copies that would otherwise hold the same bytes: the owning TP rank for state, the
    prefill DP rank (and PP stage for aux), so bytes from the wrong rank show up as a mismatch."""
    return ((seed & 0xFFFFFFFF) << 32) ^ (kind << 24) ^ (index << 8) ^ rank


def pattern(key: int, slots: np.ndarray, heads: np.ndarray, nbytes: int) -> np.ndarray:
    """uint8 array [len(slots), len(heads), nbytes] of the content at those slots and heads."""
    words = (nbytes + 7) // 8
    s = np.asarray(slots, dtype=np.uint64)[:, None, None]
    h = np.asarray(heads, dtype=np.uint64)[None, :, None]
    w = np.arange(words, dtype=np.uint64)[None, None, :]
    with np.errstate(over="ignore"):
        base = _mix(np.array([key], dtype=np.uint64))[0]
        x = base + s * _GOLDEN + _mix(h + np.uint64(1)) + w * _M1
        x = _mix(x)
    out = x.view(np.uint8).reshape(len(slots), len(heads), words * 8)
    return out[:, :, :nbytes]


def row_pattern(key: int, row: int, nbytes: int) -> np.ndarray:
    """uint8 [nbytes] content of one aux/state row."""
    return pattern(key, np.array([row]), np.array([0]), nbytes)[0, 0]
