"""The transfer process: one per prefill rank, spawned by the scheduler's manager (client.py).

It owns the transfer engine and runs today's prefill service (control, shard and completion
threads) unchanged, on KV pools it maps from the scheduler (pools.py). Decode reaches it directly:
the scheduler advertises this process's control port at bootstrap. This thread reads hand-off
records and makes the calls SGLang's scheduler thread makes in-process (claim, add_chunk, release,
fail). It ends when the scheduler closes the channel, and dies with the scheduler (parent-death
signal, and the channel's end-of-file if the signal was armed too late).
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import os
import signal
from dataclasses import dataclass
from typing import List, Optional

from sglang_mori.transfer_process.pools import PoolImport

logger = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1


@dataclass
class ChildSpec:
    config: object  # MoriConfig
    layout: bytes  # plans.encode_layout
    kv: List[PoolImport]
    on_gpu: bool
    device: int
    host: str  # the engine's address (SGLANG_MORI_HOST, or SGLang's local IP)
    control_host: str  # where decode's messages arrive (SGLang's local IP, advertised at bootstrap)
    table_name: str
    table_slots: int
    parent_pid: int
    prefill_rank: int = 0
    aux_buffers: int = 1
    owns_aux: bool = True
    deferred_release: bool = True
    bootstrap_timeout_s: float = 300.0
    decode_release_timeout_s: float = 30.0
    log_level: int = logging.INFO


def _die_with_parent(parent_pid: int) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the channel's end-of-file still ends us
        pass
    if os.getppid() != parent_pid:  # the scheduler died before the signal was armed
        os._exit(1)


def main(spec: ChildSpec, channel) -> None:
    """Entry point of the spawned process."""
    _die_with_parent(spec.parent_pid)
    configure_logging(spec.log_level)
    if spec.on_gpu:
        try:  # loads the GPU runtime torch ships, which cuda_runtime / device_runtime find among our mappings
            import torch  # noqa: F401
        except ImportError:
            pass
        _block_on_gpu_waits(spec.device)
    from sglang_mori.transfer_process.child_parts import ChildService, StartupFailed

    try:
        service = ChildService(spec)
    except StartupFailed as exc:  # published in the status table: the scheduler names it and stays in-process
        logger.error("sglang-mori transfer process pid %d could not start: %s", os.getpid(), exc)
        return
    try:
        service.serve(channel)
    finally:
        service.close()


def configure_logging(level: int) -> None:
    """This process's own log setup, replacing any it found: under SGLang the spawn first imports
    SGLang's launcher as the main module, and the root logger came configured (SGLang's format)
    at a level that dropped our INFO lines (session 20, one H200); a plain basicConfig keeps an
    existing setup. Those lines (the start-up proof, the first Success) are what
    scripts/gpu_sglang/tproc_check.py reads in the server's log."""
    logging.basicConfig(level=level, format="%(asctime)s transfer-process %(levelname)s %(message)s", force=True)


def _block_on_gpu_waits(device: int) -> None:
    """Before anything creates this process's GPU context: waits block instead of spinning a core
    (device_runtime.py says why). Not fatal: the child still works, at a core's cost."""
    from sglang_mori.transfer_process import device_runtime

    runtime = device_runtime.load()
    try:
        if runtime is None:
            raise device_runtime.DeviceRuntimeError("no CUDA or HIP runtime loaded")
        runtime.block_on_waits(device)
    except (device_runtime.DeviceRuntimeError, OSError, AttributeError) as exc:
        logger.warning("sglang-mori transfer process: GPU waits will spin a core (could not ask for blocking "
                       "waits: %s)", exc)


class AuxStore:
    """Aux items that rode on last-chunk records, by a token that stands in for SGLang's aux
    index (the service reads aux through `read_aux(index)` when it decides Success)."""

    def __init__(self):
        self._tokens = itertools.count(1)
        self.items: dict = {}
        self.by_room: dict = {}

    def put(self, room: int, items: Optional[list]) -> Optional[int]:
        if items is None:
            return None
        token = next(self._tokens)
        self.items[token] = items
        self.by_room.setdefault(room, []).append(token)
        return token

    def drop_room(self, room: int) -> None:
        for token in self.by_room.pop(room, ()):
            self.items.pop(token, None)
