"""The room's aux (metadata) items for the hand-off record, as views of SGLang's buffers.

With the transfer process the last chunk's aux rides on its hand-off record, read on SGLang's
scheduler thread inside send(). The manager's `_read_aux` copies each item out with
`ctypes.string_at` (one bytes object per buffer: ten for SGLang 0.5.23's MetadataBuffers); the
record's sendmsg gathers these row views instead, so the kernel's copy is the only one. A slot's
views (and the record's packed item lengths) are made on its first use and kept: the buffers live
as long as the scheduler. An index outside the buffers raises (the hand-off then fails the room by
name) where `string_at` would read past them.
"""

from __future__ import annotations

import ctypes
import struct
from typing import List, Optional, Sequence

import numpy as np


class AuxItems(list):
    """One slot's items; `head` is their count and lengths as the hand-off record packs them."""
    head: bytes = b""


class AuxRows:
    def __init__(self, ptrs: Sequence[int], data_lens: Sequence[int], item_lens: Sequence[int]):
        self.tables = []
        for ptr, length, item in zip(ptrs, data_lens, item_lens):
            rows = length // item
            raw = (ctypes.c_uint8 * (rows * item)).from_address(ptr)
            self.tables.append(np.ctypeslib.as_array(raw).reshape(rows, item))
        self.slots = min((len(t) for t in self.tables), default=0)
        self._head = struct.pack(f"<H{len(item_lens)}I", len(item_lens), *item_lens)
        self._cache: List[Optional[AuxItems]] = [None] * self.slots

    def __call__(self, index: Optional[int]) -> Optional[List[np.ndarray]]:
        """Row `index` of every buffer (1-D uint8 views, valid while SGLang's buffers live); the
        same list on every call for a slot: read it, never change it."""
        if index is None:
            return None
        if not 0 <= index < self.slots:
            raise IndexError(f"aux index {index} outside the metadata buffers' {self.slots} slots")
        items = self._cache[index]
        if items is None:
            items = self._cache[index] = AuxItems(t[index] for t in self.tables)
            items.head = self._head
        return items
