"""What the manager uses as its prefill service when the transfer process runs: SGLang's calls into
us (claim, add_chunk, release, fail) become hand-off records, and `sync` brings the child's status
of a room into SGLang's tables when SGLang polls it, with no message and no thread of ours.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

from sglang_mori.backend import room_status as S
from sglang_mori.transfer_process.client import TransferProcess
from sglang_mori.transfer_process.status_table import NO_STATUS

logger = logging.getLogger(__name__)


class TransferProcessService:
    def __init__(self, process: TransferProcess, sglang, read_aux: Callable[[Optional[int]], Optional[list]],
                 owns_aux: bool = True):
        self.process = process
        self.sglang = sglang  # SGLangAdapter (or the tests' fake)
        self.read_aux = read_aux
        self.owns_aux = owns_aux
        self._slots = process.slots  # room -> its status slot (the process keeps it)
        self._status = memoryview(process.table.status)  # int8, read as Python ints
        # per slot: the child's status last applied to SGLang's tables, plus 1 (0: none yet)
        self._applied = bytearray(process.table.slots)
        self.published: set = set()  # rooms whose destinations SGLang has (WaitingForInput applied)
        self.handoffs = 0
        self._first_error = True  # log the first hand-off failure's traceback

    @property
    def port(self) -> int:
        return self.process.port

    # --- the service's interface to the manager and sender ------------------------------------
    def start(self) -> None:
        pass  # the child runs its threads since it started

    def stop(self) -> None:
        self._slots = {}  # a later poll finds no room of ours; the table's memory goes away
        self._status.release()
        self.process.close()

    def poll_inbox(self) -> None:
        pass  # decode's messages go to the transfer process

    def claim(self, room_id: int) -> Optional[str]:
        self.published.discard(room_id)
        try:
            refused = self.process.claim(room_id)
        except Exception as exc:  # noqa: BLE001 - as add_chunk: the room fails, never the scheduler
            refused = f"sglang-mori transfer process: room not claimed ({type(exc).__name__}: {exc})"
            logger.error("%s (room %s)", refused, room_id, exc_info=True)
        if refused is not None:  # SGLang reads the reason from its failure records
            self.sglang.fail(room_id, refused)
            return refused
        self._applied[self._slots[room_id]] = 0
        return None

    def release(self, room_id: int) -> None:
        self.published.discard(room_id)
        self.process.release(room_id)

    def fail(self, room_id: int, reason: str, label: str = "other") -> bool:
        self.process.fail(room_id, reason, label)
        return True

    def add_chunk(self, room_id: int, kv_indices, index_slice: slice, is_last: bool, aux_index=None,
                  state_indices=None, num_kv_tokens=None, wait_event=None, **_sglang_kw) -> None:
        """Hand the chunk to the child. Runs inside SGLang's send(), once a request: one function,
        SGLang's keywords bound by name (indices_event and trace_ctx are not used). Nothing raises
        out of it (an exception there ends SGLang's scheduler, every request with it); a chunk that
        cannot be handed over fails its room, with the reason."""
        try:
            # SGLang sends one state entry per state pool with the last chunk: [] for a plain model
            # (none), None for a pool whose kind it has no payload for. The start-up refuses models
            # with state pools, so real entries here mean the deployment changed under us.
            if state_indices is not None and len(state_indices) and any(p is not None for p in state_indices):
                raise ValueError("the transfer process prototype carries no state pools")
            if wait_event is not None:  # a CUDA event cannot cross the process; the pages must be final
                wait_event.synchronize()
            aux = self.read_aux(aux_index) if (is_last and self.owns_aux and aux_index is not None) else None
            self.handoffs += 1
            error = self.process.chunk(room_id, kv_indices, index_slice.start or 0, index_slice.stop or 0, is_last,
                                       aux_index, aux, num_kv_tokens)
        except Exception as exc:  # noqa: BLE001 - one room fails, never the scheduler
            error = f"sglang-mori transfer process: chunk not handed over ({type(exc).__name__}: {exc})"
            logger.error("%s (room %s)", error, room_id, exc_info=self._first_error)
            self._first_error = False  # the first one's traceback is enough
        if error is not None:
            self.sglang.fail(room_id, error)

    # --- SGLang's poll -------------------------------------------------------------------------
    def sync(self, room_id: int) -> None:
        """Apply the child's status of `room_id` to SGLang's tables (called by check_status on every
        poll). The common case, nothing new, is a dict lookup and two byte reads."""
        slot = self._slots.get(room_id)
        if slot is None:
            return
        status = self._status[slot]
        if status + 1 == self._applied[slot] and self.process.dead_reason is None:
            return
        self._apply(room_id, slot, status)

    def _apply(self, room_id: int, slot: int, status: int) -> None:
        process = self.process
        if process.dead_reason is not None and status != S.SUCCESS:
            if self._applied[slot] != S.FAILED + 1:
                self._applied[slot] = S.FAILED + 1
                self.sglang.fail(room_id, process.dead_reason)
            return
        self._applied[slot] = status + 1
        if status == NO_STATUS:
            return
        if status == S.FAILED:
            self.sglang.fail(room_id, process.reason(room_id) or "failed in the sglang-mori transfer process")
            return
        if status >= S.WAITING_FOR_INPUT and room_id not in self.published:
            replicas, prefix = process.destinations(room_id)
            self.published.add(room_id)
            self.sglang.publish_handed_destinations(room_id, replicas, prefix)
        self.sglang.set_status(room_id, status)

    def debug_snapshot(self) -> dict:
        return {"prefill.transfer_process_rooms": len(self.process.slots),
                "prefill.transfer_process_alive": int(self.process.dead_reason is None)}
