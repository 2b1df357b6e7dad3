"""Which bootstrap servers decode could not reach, for how long: the reason of the rooms SGLang
aborts after giving up on one (it would otherwise record only "Aborted by AbortReq.")."""

from __future__ import annotations

import threading
import time
from typing import Callable, Dict, Optional, Tuple

MAX_ADDRESSES = 1024


class BootstrapReachability:
    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._lock = threading.Lock()
        self._failures: Dict[str, Tuple[float, int]] = {}  # addr -> (first failure, attempts)

    def record(self, addr: str, ok: bool) -> None:
        with self._lock:
            if ok:
                self._failures.pop(addr, None)
                return
            first, attempts = self._failures.get(addr, (self._clock(), 0))
            if addr not in self._failures and len(self._failures) >= MAX_ADDRESSES:
                self._failures.pop(next(iter(self._failures)))  # bounded
            self._failures[addr] = (first, attempts + 1)

    def reason(self, addr: str) -> Optional[str]:
        with self._lock:
            entry = self._failures.get(addr)
        if entry is None:
            return None
        first, attempts = entry
        return (f"bootstrap server {addr} unreachable: {attempts} attempts over {self._clock() - first:.1f} s "
                "could not fetch the prefill server's parallel info")

    def forget(self, addr: str) -> None:
        with self._lock:
            self._failures.pop(addr, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._failures)
