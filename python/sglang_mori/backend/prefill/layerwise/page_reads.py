"""The source pages of a layer-wise stream, read off the forward's launch path.

`begin_batch` learns a stream's prefill pages from the request's `req_to_token` row. On a GPU that
row is device memory, and a plain read (`.cpu()`) blocks the scheduler thread until the device has
run everything queued before it, right before the forward's first kernel is launched
(docs/benchmarks.md, Session 16). Nobody needs the pages that early: the worker posts the first
group only after a layer's event. So for a device row `begin_batch` only queues a copy of the
needed slots into pinned host memory on the current stream (after SGLang's own writes of the row,
before the forward; the same stream position a `.cpu()` would read) and records an event; the
first reader of the pages (the worker, after the layer's event, later on that stream) waits on it,
by then long complete (the wait releases the GIL). A host row (CPU, softio's host path, tests) is
read at once, as before.
"""

from __future__ import annotations

import logging
import threading
from typing import Optional

import numpy as np

logger = logging.getLogger(__name__)
_warned = []


class SourcePages:
    """Prefill page indices, known now (`pages`) or still on their way from the device (`copy`:
    (pinned host slots, event recorded after the copy)). `sub` slices without waiting."""

    def __init__(self, pages: Optional[np.ndarray] = None, *, copy=None, count: int = 0, page_size: int = 1,
                 parent: "Optional[SourcePages]" = None, lo: int = 0):
        self._pages = pages
        self._copy = copy
        self._count = len(pages) if pages is not None else count
        self._page_size = page_size
        self._parent, self._lo = parent, lo
        self._lock = threading.Lock()

    @classmethod
    def of(cls, pages) -> "SourcePages":
        return pages if isinstance(pages, SourcePages) else cls(np.asarray(pages, dtype=np.int64))

    def __len__(self) -> int:
        return self._count

    @property
    def pending(self) -> bool:
        """Not resolved yet (the device copy was not waited for)."""
        return self._pages is None

    def sub(self, lo: int, hi: int) -> "SourcePages":
        """Pages [lo, hi) of these, resolved when they are (no wait here)."""
        lo, hi = max(0, lo), max(max(0, lo), min(hi, self._count))
        if self._pages is not None:
            return SourcePages(self._pages[lo:hi])
        return SourcePages(count=hi - lo, parent=self, lo=lo)

    def resolve(self) -> np.ndarray:
        """The page indices, waiting for the device copy if it has not landed yet."""
        with self._lock:
            if self._pages is None:
                if self._parent is not None:
                    self._pages = self._parent.resolve()[self._lo:self._lo + self._count]
                else:
                    host, ready = self._copy
                    ready.synchronize()  # the copy has landed; releases the GIL while it waits
                    self._pages = np.asarray(host.numpy(), dtype=np.int64) // self._page_size
                self._copy = self._parent = None
            return self._pages


def read_source_pages(row_tokens, tok_lo: int, tok_hi: int, page_size: int) -> SourcePages:
    """The prefill pages of tokens [tok_lo, tok_hi) of a `req_to_token` row, without a blocking
    device read: a device row's slots are copied asynchronously and resolved on first use."""
    slots = row_tokens[tok_lo:tok_hi:page_size]
    if getattr(slots, "is_cuda", False):
        try:
            return SourcePages(copy=start_device_copy(slots), count=int(slots.shape[0]), page_size=page_size)
        except Exception as exc:  # e.g. no pinned memory here: read it the blocking way
            if not _warned:
                _warned.append(True)
                logger.warning("sglang-mori: layer-wise: asynchronous page read unavailable (%r); reading "
                               "source pages with a blocking device read", exc)
            slots = slots.cpu()
    if hasattr(slots, "numpy"):  # a host torch row (a CPU pool)
        slots = slots.numpy()
    return SourcePages(np.asarray(slots, dtype=np.int64) // page_size)


def start_device_copy(slots):
    """Queue a copy of device `slots` into pinned host memory on the current stream; (host, event)."""
    import torch

    host = torch.empty(tuple(slots.shape), dtype=slots.dtype, pin_memory=True)
    stream = torch.cuda.current_stream(slots.device)
    host.copy_(slots, non_blocking=True)  # pinned destination: truly asynchronous
    event = torch.cuda.Event()
    event.record(stream)
    return host, event
