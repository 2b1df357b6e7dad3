"""The physical byte layout of MHA KV pages, and which layouts head slicing can cut.

SGLang's `KVArgs` describes buffers by item length only. Pages of the same length can hold the
same bytes in another order, so the layout must be equal on both sides and known to the head
slicer:

- "nhd" (default): a page is [page_size, heads, head_dim]: a token's heads are contiguous, so a
  head slice is one range per token slot.
- "hnd" (SGLANG_USE_HND_KVCACHE; SGLang 0.5.23 refuses it with PD, recorded anyway) and
  "vectorized_5d" (ROCm AITER, SGLANG_AITER_KV_CACHE_LAYOUT): a page is head-major,
  [heads, page_size, head_dim] and K [heads, head_dim/X, page_size, X] / V
  [heads, page_size/X, head_dim, X]. Each head owns one contiguous block of
  page_size * head_dim elements, so a head slice is one range per page.

The pool picks its layout when it is built, from the environment of the scheduler process this
plugin runs in (MHATokenToKVPool: HND first, then the AITER variable on ROCm with AITER on);
`physical_kv_layout` repeats that rule. The SWA sub-pool's layout SGLang does report
(`KVArgs.swa_kv_cache_layout`). MLA pools have one layout, so they record none.
"""

from __future__ import annotations

import os
from typing import Callable, Mapping, Optional

NHD = "nhd"
HND = "hnd"
VECTORIZED_5D = "vectorized_5d"

TOKEN_MAJOR = frozenset({NHD})  # a token's heads are contiguous
HEAD_MAJOR = frozenset({HND, VECTORIZED_5D})  # a head's page_size slots are contiguous

_TRUE = ("true", "1", "yes", "y")


def _flag(environ: Mapping[str, str], name: str) -> bool:
    return environ.get(name, "").strip().lower() in _TRUE


def _torch_is_hip() -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover - SGLang always has torch
        return False
    return getattr(torch.version, "hip", None) is not None


def physical_kv_layout(
    environ: Optional[Mapping[str, str]] = None, is_hip: Optional[Callable[[], bool]] = None
) -> str:
    """The layout SGLang's MHA pool chooses in this process (same rule, same variables)."""
    env = os.environ if environ is None else environ
    if _flag(env, "SGLANG_USE_HND_KVCACHE"):
        return HND
    if _flag(env, "SGLANG_USE_AITER") and (is_hip or _torch_is_hip)():
        return env.get("SGLANG_AITER_KV_CACHE_LAYOUT", NHD).strip().lower() or NHD
    return NHD


def head_major(layout: Optional[str]) -> Optional[bool]:
    """True for head-major pages, False for token-major ones, None for a layout we cannot cut.

    None (not reported) is SGLang's default, NHD.
    """
    if layout is None or layout in TOKEN_MAJOR:
        return False
    if layout in HEAD_MAJOR:
        return True
    return None
