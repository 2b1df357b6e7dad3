"""The transfer process's stand-in for SGLang's per-room tables, behind the SGLangAdapter's methods.

The prefill service updates SGLang's tables only through the adapter (sglang_adapter.py). In the
transfer process there is no SGLang manager, so this class keeps the same rules SGLang 0.5.23's
CommonKVManager applies (a room opens only with Bootstrapping, Failed is terminal, otherwise
statuses only rise, the first failure reason wins; a deferred abort ACK waits until no write is
outstanding and is never sent for a poisoned room) and mirrors every status change into the room's
slot of the status table, where the scheduler's poll() reads it. ACKs are sent from here, by the
transfer process's messenger, as SGLang's manager would send them.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Dict, Optional

from sglang_mori import protocol
from sglang_mori.backend import room_status as S
from sglang_mori.backend.prefill.rooms import decode_prefix_len

logger = logging.getLogger(__name__)


class ChildTables:
    def __init__(self, table, messenger, prefill_rank: int, aux_buffers: int, deferred_release: bool,
                 bootstrap_timeout_s: float, decode_release_timeout_s: float):
        self.table = table
        self.messenger = messenger
        self.prefill_rank = prefill_rank
        self.aux_buffers = aux_buffers
        self.deferred_release = deferred_release
        self.bootstrap_timeout_s = bootstrap_timeout_s
        self.decode_release_timeout_s = decode_release_timeout_s
        self.lock = threading.Lock()
        self.slots: Dict[int, int] = {}  # room -> its slot in the status table (this life)
        self.statuses: Dict[int, int] = {}
        self.reasons: Dict[int, str] = {}
        self.outstanding: Dict[int, int] = {}
        self.held_acks: Dict[int, dict] = {}
        self.poisoned: set = set()
        # One line when the first room reaches Success: the proof, in the server's log, that this
        # process carried traffic (scripts/gpu_sglang/tproc_check.py fails a run without it).
        self.first_success_logged = False

    # --- the hand-off reader's side ---------------------------------------------------------
    def open(self, room: int, slot: int) -> None:
        """A claim record: the room's new life writes into `slot`."""
        with self.lock:
            self.slots[room] = slot
        self.set_status(room, S.BOOTSTRAPPING)

    def close(self, room: int, slot: int) -> None:
        """A release record (SGLang's sender.clear()): the scheduler forgot the room; its slot is
        never written again once marked released."""
        with self.lock:
            if self.slots.get(room) == slot:
                del self.slots[room]
            self.statuses.pop(room, None)
            self.reasons.pop(room, None)
            self.table.mark_released(slot)
        self.release_acks(room)

    def _mirror(self, room: int, status: int, reason: Optional[str] = None, replicas: int = 0,
                prefix: int = 0) -> None:
        slot = self.slots.get(room)
        if slot is not None:
            self.table.write(slot, status, reason, replicas, prefix)

    # --- the adapter's methods ----------------------------------------------------------------
    def status(self, room):
        with self.lock:
            return self.statuses.get(room)

    def set_status(self, room, status, **mirror):
        with self.lock:
            current = self.statuses.get(room)
            if current is None:
                if status not in (S.BOOTSTRAPPING, S.WAITING_FOR_INPUT):
                    return
                self.held_acks.pop(room, None)
                self.poisoned.discard(room)
                self.outstanding.pop(room, None)
                new = status
            elif status == S.FAILED or current == S.FAILED:
                new = S.FAILED
            else:
                new = max(current, status)
            self.statuses[room] = new
            if new != current or mirror:
                self._mirror(room, new, **mirror)
            first_success = new == S.SUCCESS and not self.first_success_logged
            self.first_success_logged |= first_success
        if first_success:
            logger.info("sglang-mori transfer process pid %d: first room reached Success (room %s)", os.getpid(), room)

    def fail(self, room, reason):
        with self.lock:
            self.reasons.setdefault(room, reason)
            first = self.reasons[room]
        self.set_status(room, S.FAILED, reason=first)

    def drop_stale_failure(self, room):
        with self.lock:
            if self.statuses.get(room) != S.FAILED:
                self.reasons.pop(room, None)

    def failure_reason(self, room):
        with self.lock:
            return self.reasons.get(room)

    def publish_destinations(self, room, targets):
        infos = list(targets.values())
        replicas = max(1, int(getattr(infos[0], "required_dst_info_num", 1) or 1)) if infos else 1
        self.set_status(room, S.WAITING_FOR_INPUT, replicas=replicas, prefix=decode_prefix_len(infos))

    def check_peer_aux_buffer_count(self, peer, count):
        if count != self.aux_buffers:
            logger.error("sglang-mori: decode %s registered %d metadata buffers but this prefill has %d; "
                         "only the first %d are transferred", peer, count, self.aux_buffers,
                         min(count, self.aux_buffers))

    def set_outstanding(self, room, count):
        with self.lock:
            self.outstanding[room] = count

    def drop_outstanding(self, room):
        with self.lock:
            self.outstanding.pop(room, None)

    def ack_poisoned(self, room):
        with self.lock:
            return room in self.poisoned

    def poison(self, room):
        with self.lock:
            self.held_acks.pop(room, None)
            self.poisoned.add(room)

    def hold_ack(self, room, ip, port, generation):
        with self.lock:
            if room not in self.poisoned:
                self.held_acks.setdefault(room, {})[(ip, port)] = generation

    def release_acks(self, room):
        with self.lock:
            if self.outstanding.get(room, 0) > 0:
                return
            targets = self.held_acks.pop(room, {})
            if room in self.poisoned:
                return
        for (ip, port), generation in targets.items():
            self.messenger.send((ip, port), protocol.AbortAck(room=room, prefill_rank=self.prefill_rank,
                                                              generation=generation))
