"""The planner's output: byte ranges per (local buffer, remote buffer) pair.

Offsets and sizes are bytes relative to the start of each registered buffer (the MORI-IO
`MemoryDesc`), exactly what `IOEngine.batch_write` takes, one pair per registered buffer.
Arrays are int64 and read-only: layers that share an item length share the same arrays, so a
plan for 61 layers costs one set of arrays, not 61.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Tuple

import numpy as np


def frozen_int64(array: np.ndarray) -> np.ndarray:
    """`array` as a read-only, C-contiguous int64 array (a read-only view of it when it already
    is one, so the caller's own array stays writeable)."""
    out = np.ascontiguousarray(array, dtype=np.int64)
    if out.flags.writeable:
        out = out.view()  # a read-only view, so the caller's own array stays writeable
        out.setflags(write=False)
    return out


@dataclass(frozen=True)
class BufferTransfer:
    """Ranges to copy from one local registered buffer to one remote registered buffer.

    `local_index` / `remote_index` index the list the plan kind refers to: the KV buffer list
    (`kv_data_ptrs` order), the aux buffer list, or one state component's tensor list.
    """

    local_index: int
    remote_index: int
    local_offsets: np.ndarray
    remote_offsets: np.ndarray
    sizes: np.ndarray

    def __post_init__(self) -> None:
        arrays = [frozen_int64(a) for a in (self.local_offsets, self.remote_offsets, self.sizes)]
        if not (arrays[0].shape == arrays[1].shape == arrays[2].shape) or arrays[0].ndim != 1:
            raise ValueError(
                "BufferTransfer arrays must be 1-D and of equal length, got shapes "
                f"{[a.shape for a in arrays]}"
            )
        object.__setattr__(self, "local_offsets", arrays[0])
        object.__setattr__(self, "remote_offsets", arrays[1])
        object.__setattr__(self, "sizes", arrays[2])

    @classmethod
    def of_frozen(cls, local_index: int, remote_index: int, ranges) -> "BufferTransfer":
        """A transfer over (local offsets, remote offsets, sizes) the planner already made
        read-only, 1-D int64 and equal in length (planner._read_only): no check again, since a
        chunk of a 61-layer model makes 61 of these over the same three arrays."""
        out = object.__new__(cls)
        # One dict update instead of five frozen-dataclass setattr calls (61 per chunk).
        out.__dict__.update(local_index=local_index, remote_index=remote_index, local_offsets=ranges[0],
                            remote_offsets=ranges[1], sizes=ranges[2])
        return out

    @property
    def num_ranges(self) -> int:
        return int(self.sizes.size)

    @property
    def total_bytes(self) -> int:
        return int(self.sizes.sum())


@dataclass(frozen=True)
class BatchArgs:
    """The per-pair lists of one `batch_write` call, minus descriptors and uids.

    Pairs whose arrays are shared in the plan share the same list objects here too; the engine
    only reads them.
    """

    local_indices: List[int]
    remote_indices: List[int]
    local_offsets: List[List[int]]
    remote_offsets: List[List[int]]
    sizes: List[List[int]]


@dataclass(frozen=True)
class TransferPlan:
    """All ranges of one chunk for one kind of buffer (`kind`: "kv", "aux" or "state:<type>").

    `component` is the state component index for state plans (0 otherwise). `dropped` counts
    indices the planner left out on purpose (paged state lists of unequal length are cut to the
    common prefix, as SGLang does); the backend may log it.
    """

    kind: str
    transfers: Tuple[BufferTransfer, ...] = ()
    component: int = 0
    dropped: int = 0
    total_bytes: int = field(init=False)
    num_ranges: int = field(init=False)

    def __post_init__(self) -> None:
        transfers = tuple(t for t in self.transfers if t.num_ranges)
        object.__setattr__(self, "transfers", transfers)
        # Pairs share arrays (every layer of one item length): sum each distinct one once.
        totals: dict = {}
        for t in transfers:
            if id(t.sizes) not in totals:
                totals[id(t.sizes)] = t.total_bytes
        object.__setattr__(self, "total_bytes", sum(totals[id(t.sizes)] for t in transfers))
        object.__setattr__(self, "num_ranges", sum(t.num_ranges for t in transfers))

    @property
    def empty(self) -> bool:
        return not self.transfers

    def __len__(self) -> int:
        return len(self.transfers)

    def __iter__(self):
        return iter(self.transfers)

    def as_batch_args(self) -> BatchArgs:
        """Convert to python lists, converting each distinct (shared) array only once."""
        converted: dict = {}

        def as_list(array: np.ndarray) -> List[int]:
            # Contiguous int64 arrays over the same memory hold the same values.
            key = (array.ctypes.data, array.size)
            if key not in converted:
                converted[key] = array.tolist()
            return converted[key]

        return BatchArgs(
            local_indices=[t.local_index for t in self.transfers],
            remote_indices=[t.remote_index for t in self.transfers],
            local_offsets=[as_list(t.local_offsets) for t in self.transfers],
            remote_offsets=[as_list(t.remote_offsets) for t in self.transfers],
            sizes=[as_list(t.sizes) for t in self.transfers],
        )
