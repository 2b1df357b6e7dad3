"""Which registered KV buffers hold one model layer's KV, found by data pointer.

SGLang registers the pool's per-layer tensors in `KVArgs.kv_data_ptrs`: MHA lists K of every layer,
then V of every layer; MLA one latent buffer per layer; draft-model buffers come last. A layer's
tensors are read from the pool the forward used (`k_buffer`/`v_buffer` for MHA, `kv_buffer` for
MLA, indexed by `layer_id - start_layer`) and must be, by data pointer, among the registered main
(non-draft) buffers; anything else (a quantized view, an unknown pool, a draft layer) is unmapped,
and the batch streams no further layers (its `send()` moves the rest).
"""

from __future__ import annotations

import threading
from typing import Dict, Optional, Sequence, Tuple

from sglang_mori.backend import sglang_fields as fields


class LayerBufferMap:
    def __init__(self, kv_data_ptrs: Sequence[int], num_draft_entries: int, is_mla: bool):
        main = len(kv_data_ptrs) - int(num_draft_entries or 0)
        self.num_buffers = len(kv_data_ptrs)
        self.is_mla = bool(is_mla)
        # Model layers of the main pool: MLA registers one buffer a layer, MHA a K and a V buffer.
        self.layers = max(1, main if self.is_mla else main // 2)
        self._by_ptr: Dict[int, int] = {}
        for i, ptr in enumerate(kv_data_ptrs[:main]):
            if ptr:
                self._by_ptr.setdefault(int(ptr), i)
        self._lock = threading.Lock()
        self._cache: Dict[Tuple[int, int], Optional[Tuple[int, ...]]] = {}

    def buffers_for(self, pool, layer_id: int) -> Optional[Tuple[int, ...]]:
        """Registered KV buffer indices of `layer_id` in `pool`, or None when they cannot be mapped."""
        key = (id(pool), int(layer_id))
        with self._lock:
            if key in self._cache:
                return self._cache[key]
        found = self._resolve(pool, int(layer_id))
        with self._lock:
            self._cache[key] = found
        return found

    def _resolve(self, pool, layer_id: int) -> Optional[Tuple[int, ...]]:
        tensors = fields.layer_tensors(pool, layer_id, self.is_mla)
        if tensors is None:
            return None
        out = []
        for tensor in tensors:
            index = self._by_ptr.get(_data_ptr(tensor))
            if index is None:
                return None
            out.append(index)
        return tuple(out)


def _data_ptr(tensor) -> int:
    ptr = getattr(tensor, "data_ptr", None)
    if callable(ptr):
        return int(ptr())
    ctypes = getattr(tensor, "ctypes", None)  # numpy arrays (tests)
    return int(ctypes.data) if ctypes is not None else -1
