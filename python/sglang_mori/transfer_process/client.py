"""The scheduler's side of the transfer process: spawn it, hand chunks to it, read its statuses.

Everything here runs on SGLang's scheduler thread except the death watcher, which blocks in the
kernel on the child's sentinel and holds no GIL while it waits. A room's status is one read of the
shared status table; its failure reason is read only once it failed. If the child dies, every room
still open reads as failed with the child's exit named, and later hand-offs fail their room at once.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import sys
import threading
import time
import types
from multiprocessing.connection import wait as wait_for_sentinels
from typing import Dict, List, Optional

from sglang_mori.transfer_process import handoff
from sglang_mori.transfer_process.child import ChildSpec, main as child_main
from sglang_mori.transfer_process.status_table import NO_STATUS, StatusTable

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0


@contextlib.contextmanager
def _main_module_hidden(hide: bool = True):
    """Start the child without re-running this process's main module in it. A spawned child first
    imports its parent's main module (multiprocessing's preparation step); under SGLang that is
    SGLang's launcher and all it imports. The child's start-up took 16.5-17.3 s of CPU inside SGLang
    (session 20, one H200) against 8-9 s in the project's GPU rig (session 19), and added ~14 s to the
    prefill server's start. The child needs none of it: its entry point and arguments are importable
    by name. A stand-in main, without a spec or a file, for the few milliseconds of start() leaves
    the preparation nothing to import. `hide=False` keeps the main module (a target defined there)."""
    main = sys.modules.get("__main__")
    if not hide:
        yield
        return
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        if main is not None:
            sys.modules["__main__"] = main


class TransferProcessError(RuntimeError):
    """The transfer process did not start (it failed to map, register or prove its pools, or died):
    the manager keeps its transfers in-process with this as the refusal."""


class TransferProcess:
    def __init__(self, spec: ChildSpec, slots: int, start_timeout_s: float = START_TIMEOUT_S, target=child_main):
        """`target`: the child's entry point (benchmarks wrap it; it must be importable there)."""
        self.table = StatusTable.create(slots)
        spec.table_name, spec.table_slots, spec.parent_pid = self.table.name, slots, os.getpid()
        mine, theirs = handoff.channel_pair()
        self.sender = handoff.Sender(mine)
        self._socket = mine
        self.process = multiprocessing.get_context("spawn").Process(
            target=target, args=(spec, theirs), name="sglang-mori-transfer", daemon=True)
        # a target defined in the main script itself (test/manual/hop_latency_cpu.py) needs it re-run
        with _main_module_hidden(getattr(target, "__module__", None) != "__main__"):
            self.process.start()
        theirs.close()
        self.dead_reason: Optional[str] = None
        self.slots: Dict[int, int] = {}  # room -> slot of its current life
        self._free: List[int] = list(range(slots - 1, -1, -1))
        self._releasing: List[int] = []
        self.port = self._wait_ready(start_timeout_s)
        self._watcher = threading.Thread(target=self._watch, name="mori-transfer-watch", daemon=True)
        self._watcher.start()
        logger.info("sglang-mori: transfer process pid %d serves control port %d", self.process.pid, self.port)

    def _wait_ready(self, timeout_s: float) -> int:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            port = self.table.ready_port()
            if port is not None:
                return port
            failure = self.table.startup_failure()
            if failure is not None:  # it exits by itself after publishing it
                self.close()
                raise TransferProcessError(f"the transfer process could not start: {failure}")
            if wait_for_sentinels([self.process.sentinel], timeout=0.05):
                failure = self.table.startup_failure()  # published just before it exited
                self.process.join(timeout=5.0)  # the sentinel fires before the exit code is collected
                code = self.process.exitcode
                self.close()
                raise TransferProcessError(
                    f"the transfer process could not start: {failure}" if failure is not None else
                    f"the transfer process exited with code {code} during start-up (its log says why)")
        self.close()
        raise TransferProcessError(f"the transfer process did not start within {timeout_s:.0f} s")

    def _watch(self) -> None:
        wait_for_sentinels([self.process.sentinel])
        self.process.join(timeout=5.0)  # the sentinel fires before the exit code is collected
        if self.dead_reason is None:
            self.dead_reason = (f"sglang-mori transfer process (pid {self.process.pid}) exited with code "
                                f"{self.process.exitcode} while the room was in flight")
            logger.error("sglang-mori: %s", self.dead_reason)

    # --- hand-offs (SGLang's scheduler thread) ---------------------------------------------
    def claim(self, room: int) -> Optional[str]:
        """Start the room's life in the child; the reason it must fail at once, or None."""
        if self.dead_reason is not None:
            return self.dead_reason
        if room in self.slots:  # a life SGLang never cleared: end it before the new one
            self.release(room)
        slot = self._take_slot()
        if slot is None:
            return f"sglang-mori transfer process: all {self.table.slots} status slots are in use"
        self.table.open_slot(slot)
        self.slots[room] = slot
        error = self._send(self.sender.claim, slot, room)
        if error is not None:
            del self.slots[room]
        return error

    def chunk(self, room: int, pages, start: int, stop: int, is_last: bool, aux_index: Optional[int],
              aux: Optional[list], num_kv_tokens: Optional[int]) -> Optional[str]:
        slot = self.slots.get(room)
        if slot is None:
            return None  # no life here (its claim failed): the room already reads as failed
        if self.dead_reason is not None:
            return self.dead_reason
        try:  # _send's work, inline: this runs once a request inside SGLang's send()
            self.sender.chunk(slot, room, pages, start, stop, is_last, aux_index, aux, num_kv_tokens)
        except OSError as exc:
            return self._unreachable(exc)
        return None

    def release(self, room: int) -> None:
        slot = self.slots.pop(room, None)
        if slot is None:
            return
        self._releasing.append(slot)
        self._send(self.sender.release, slot, room)

    def fail(self, room: int, reason: str, label: str) -> None:
        slot = self.slots.get(room)
        if slot is not None:
            self._send(self.sender.fail, slot, room, reason, label)

    def _send(self, method, *args) -> Optional[str]:
        if self.dead_reason is not None:
            return self.dead_reason
        try:
            method(*args)
        except OSError as exc:
            return self._unreachable(exc)
        return None

    def _unreachable(self, exc: OSError) -> str:
        """The child's end is gone: the watcher names the exit."""
        self.process.join(timeout=1.0)
        self.dead_reason = self.dead_reason or f"sglang-mori transfer process unreachable: {exc}"
        return self.dead_reason

    def _take_slot(self) -> Optional[int]:
        if not self._free and self._releasing:
            released = self.table.released
            keep = []
            for slot in self._releasing:
                (self._free if released[slot] else keep).append(slot)
            self._releasing = keep
        return self._free.pop() if self._free else None

    # --- statuses ----------------------------------------------------------------------------
    def status(self, room: int) -> Optional[int]:
        """The child's latest status of the room (NO_STATUS before its first), None if not ours."""
        slot = self.slots.get(room)
        return None if slot is None else int(self.table.status[slot])

    def reason(self, room: int) -> str:
        slot = self.slots.get(room)
        return "" if slot is None else self.table.read_reason(slot)

    def destinations(self, room: int):
        """(destination count, decode prefix length) the child published with WaitingForInput."""
        slot = self.slots[room]
        return int(self.table.replicas[slot]), int(self.table.prefix[slot])

    # --- lifecycle -----------------------------------------------------------------------------
    def close(self, timeout_s: float = 10.0) -> None:
        self.dead_reason = self.dead_reason or "sglang-mori transfer process stopped"
        try:
            self._socket.close()  # the child reads end-of-file, stops its service and exits
        except OSError:
            pass
        self.process.join(timeout=timeout_s)
        if self.process.is_alive():
            logger.warning("sglang-mori: transfer process pid %d did not stop in %.0f s; killing it",
                           self.process.pid, timeout_s)
            self.process.kill()
            self.process.join(timeout=timeout_s)
        self.table.close()
