"""The room's aux (metadata) items for the hand-off record, as views of SGLang's buffers.

With the transfer process the last chunk's aux rides on its hand-off record, read on SGLang's
scheduler thread inside send(). The manager's `_read_aux` copies each item out with
`ctypes.string_at` (one bytes object per buffer: ten for SGLang 0.5.23's MetadataBuffers); the
record's sendmsg gathers these row views instead, so the kernel's copy is the only one. The
buffers are mapped on the first read; a slot's views (and the record's packed item lengths) are
made on its first use and kept: the buffers live as long as the scheduler. An index outside the buffers raises (the hand-off then fails the room by
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
        self._buffers = list(zip(ptrs, data_lens, item_lens))
        self.tables: Optional[List[np.ndarray]] = None  # made on the first read (start-up never reads)
        self.slots = 0

    def _map(self) -> None:
        tables = []
        for ptr, length, item in self._buffers:
            rows = length // item
            raw = (ctypes.c_uint8 * (rows * item)).from_address(ptr)
            tables.append(np.ctypeslib.as_array(raw).reshape(rows, item))
        lens = [item for _, _, item in self._buffers]
        self._head = struct.pack(f"<H{len(lens)}I", len(lens), *lens)
        self.slots = min((len(t) for t in tables), default=0)
        self._cache: List[Optional[AuxItems]] = [None] * self.slots
        self.tables = tables

    def __call__(self, index: Optional[int]) -> Optional[List[np.ndarray]]:
        """Row `index` of every buffer (1-D uint8 views, valid while SGLang's buffers live); the
        same list on every call for a slot: read it, never change it."""
        if index is None:
            return None
        if self.tables is None:
            self._map()
        if not 0 <= index < self.slots:
            raise IndexError(f"aux index {index} outside the metadata buffers' {self.slots} slots")
        items = self._cache[index]
        if items is None:
            items = self._cache[index] = AuxItems(t[index] for t in self.tables)
            items.head = self._head
        return items
