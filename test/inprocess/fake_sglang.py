"""A stand-in for SGLang's per-room tables with the SGLangAdapter's methods, backed by dicts, so the
services run in one process without SGLang (whose import alone takes seconds and pulls torch).

It mirrors the rules of SGLang 0.5.23's CommonKVManager that the services rely on: update_status
only opens a room with Bootstrapping/WaitingForInput, Failed is terminal and otherwise statuses only
rise; a deferred abort ACK is held until `release_acks` while writes are outstanding, and never
sent for a poisoned room.
"""

from __future__ import annotations

import threading

from sglang_mori.backend import room_status as S


class FakeSGLang:
    def __init__(self, prefill_rank: int = 0, deferred_release: bool = True, bootstrap_timeout_s: float = 300.0,
                 decode_release_timeout_s: float = 30.0):
        self.prefill_rank = prefill_rank
        self.deferred_release = deferred_release
        self.decode_release_timeout_s = decode_release_timeout_s  # SGLang's deferred-release timeout
        self.bootstrap_timeout_s = bootstrap_timeout_s
        self.lock = threading.Lock()
        self.request_status: dict = {}
        self.failure_records: dict = {}
        self.transfer_infos: dict = {}
        self.outstanding: dict = {}
        self.held_acks: dict = {}  # room -> [(ip, port, generation)]
        self.poisoned: set = set()
        self.acks_sent: list = []  # (room, ip, port, generation)
        self.prefill_statuses: list = []  # decode: apply_prefill_status calls
        self.abort_acks_noted: list = []

    # --- the scheduler's side, as SGLang's sender/receiver drive it --------------------------------
    def open(self, room: int) -> None:
        self.set_status(room, S.BOOTSTRAPPING)

    def clear(self, room: int, consume_failure: bool = True) -> None:
        """What the scheduler does with a finished sender: failure_exception() (pops the reason)
        for a failed one, then clear()."""
        with self.lock:
            if consume_failure:
                self.failure_records.pop(room, None)
            self.request_status.pop(room, None)
            self.transfer_infos.pop(room, None)
        self.release_acks(room)

    # --- adapter API ----------------------------------------------------------------------------
    def status(self, room):
        with self.lock:
            return self.request_status.get(room)

    def set_status(self, room, status):
        with self.lock:
            current = self.request_status.get(room)
            if current is None:
                if status in (S.BOOTSTRAPPING, S.WAITING_FOR_INPUT):
                    self.held_acks.pop(room, None)
                    self.poisoned.discard(room)
                    self.outstanding.pop(room, None)
                    self.request_status[room] = status
                return
            if status == S.FAILED:
                self.request_status[room] = S.FAILED
            elif current != S.FAILED:
                self.request_status[room] = max(current, status)

    def fail(self, room, reason):
        with self.lock:
            self.failure_records.setdefault(room, reason)
        self.set_status(room, S.FAILED)

    def drop_stale_failure(self, room):
        with self.lock:
            if self.request_status.get(room) != S.FAILED:
                self.failure_records.pop(room, None)

    def failure_reason(self, room):
        with self.lock:
            return self.failure_records.get(room)

    def publish_destinations(self, room, targets):
        with self.lock:
            self.transfer_infos[room] = dict(targets)
        self.set_status(room, S.WAITING_FOR_INPUT)

    def check_peer_aux_buffer_count(self, peer, count):
        pass

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
                self.held_acks.setdefault(room, []).append((ip, port, generation))

    def release_acks(self, room):
        with self.lock:
            if self.outstanding.get(room, 0) > 0:
                return
            if room in self.poisoned:
                self.held_acks.pop(room, None)
                return
            for ip, port, generation in self.held_acks.pop(room, []):
                self.acks_sent.append((room, ip, port, generation))

    def apply_prefill_status(self, room, status, prefill_rank, reason):
        self.prefill_statuses.append((room, status, prefill_rank, reason))
        if status == S.FAILED:
            self.fail(room, reason or "failed on prefill")
        else:
            self.set_status(room, status)

    def arm_deferred_abort(self, room):
        with self.lock:
            self.abort_generations = getattr(self, "abort_generations", 0) + 1
            return self.abort_generations

    def note_abort_ack(self, room, prefill_rank, generation):
        self.abort_acks_noted.append((room, prefill_rank, generation))

    def publish_handed_destinations(self, room, replicas, prefix):
        """The scheduler's side of the transfer process: the child published the room's
        destinations (their count and decode's prefix length) in the status table."""
        with self.lock:
            self.transfer_infos[room] = {"transfer-process": (replicas, prefix)}
        self.set_status(room, S.WAITING_FOR_INPUT)
