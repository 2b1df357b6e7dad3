"""The services' one window onto SGLang's per-room tables.

SGLang's scheduler polls `request_status`, reads `transfer_infos` and `failure_records`, and holds
abort ACKs in its deferred-release tables; our room state machines update them only through this
class, on transitions. The services never see the manager: tests give them a fake with the same
methods (test/inprocess/fake_sglang.py).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Dict, Optional

from sglang_mori.backend import room_status
from sglang_mori.backend import sglang_compat as compat
from sglang_mori.backend.prefill.rooms import decode_prefix_len

# The one entry of a room's transfer_infos when the transfer process holds its destinations.
HANDED_DESTINATIONS = "sglang-mori-transfer-process"


class SGLangAdapter:
    def __init__(self, mgr):
        self._mgr = mgr

    # --- identity and settings -----------------------------------------------------------------
    @property
    def prefill_rank(self) -> int:
        return compat.prefill_unique_rank(self._mgr)

    @property
    def bootstrap_timeout_s(self) -> float:
        # Set on prefill managers only (sglang_manifest.OPTIONAL); 300 s is the default of SGLang's
        # SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT, which sets it.
        return float(getattr(self._mgr, "bootstrap_timeout", 300) or 300)

    @property
    def deferred_release(self) -> bool:
        return bool(self._mgr.enable_deferred_decode_kv_release)

    @property
    def decode_release_timeout_s(self) -> float:
        """How long decode's SGLang holds a failed room's pages for prefill's abort ACK
        (SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT), read from this process's
        environment: prefill cannot see decode's, so both must be launched with the same value."""
        return compat.deferred_release_timeout_s()

    # --- room status ---------------------------------------------------------------------------
    def status(self, room: int) -> Optional[int]:
        return self._mgr.request_status.get(room)

    def set_status(self, room: int, status: int) -> None:
        self._mgr.update_status(room, status)

    def fail(self, room: int, reason: str) -> None:
        """Record the reason (the first cause wins) and mark the room Failed; decode is told by
        the caller, or already knows."""
        with self._mgr.failure_lock:
            self._mgr.failure_records.setdefault(room, reason)
        self._mgr.update_status(room, room_status.FAILED)

    def drop_stale_failure(self, room: int) -> None:
        """A new request opened `room`: a failure record without a Failed status belongs to an
        earlier request with this id whose sender or receiver was cleared before anyone read it."""
        if self._mgr.request_status.get(room) != room_status.FAILED:
            with self._mgr.failure_lock:
                self._mgr.failure_records.pop(room, None)

    def failure_reason(self, room: int) -> Optional[str]:
        with self._mgr.failure_lock:
            return self._mgr.failure_records.get(room)

    # --- prefill: destinations -----------------------------------------------------------------
    def publish_destinations(self, room: int, targets: Dict[str, object]) -> None:
        """Every decode destination of a claimed room is known: SGLang may now send into it."""
        mgr = self._mgr
        mgr.transfer_infos[room] = dict(targets)
        mgr.resolve_kv_replica_factor(mgr.transfer_infos[room])
        mgr.req_to_decode_prefix_len[room] = decode_prefix_len(targets.values())
        mgr.update_status(room, room_status.WAITING_FOR_INPUT)

    def publish_handed_destinations(self, room: int, replicas: int, prefix: int) -> None:
        """The transfer process knows the room's destinations (SGLANG_MORI_TRANSFER_PROCESS): SGLang
        gets what it reads of them here, their count (the MLA replica factor) and decode's prefix
        length. The entry is a dummy, so SGLang's own status notifications skip it: the transfer
        process tells decode itself."""
        mgr = self._mgr
        mgr.transfer_infos[room] = {HANDED_DESTINATIONS: SimpleNamespace(required_dst_info_num=replicas,
                                                                         is_dummy=True)}
        mgr.resolve_kv_replica_factor(mgr.transfer_infos[room])
        mgr.req_to_decode_prefix_len[room] = prefix
        mgr.update_status(room, room_status.WAITING_FOR_INPUT)

    def check_peer_aux_buffer_count(self, peer: str, count: int) -> None:
        self._mgr.check_peer_aux_buffer_count(peer, count)

    # --- prefill: writes outstanding and deferred abort ACKs ------------------------------------
    def set_outstanding(self, room: int, count: int) -> None:
        compat.set_writes_outstanding(self._mgr, room, count)

    def drop_outstanding(self, room: int) -> None:
        compat.drop_writes_outstanding(self._mgr, room)

    def ack_poisoned(self, room: int) -> bool:
        return compat.ack_poisoned(self._mgr, room)

    def poison(self, room: int) -> None:
        self._mgr.poison_deferred_ack_room(room)

    def hold_ack(self, room: int, ip: str, port: int, generation: int) -> None:
        self._mgr.register_deferred_ack_target(room, compat.ack_target(ip, port, generation))

    def release_acks(self, room: int) -> None:
        compat.ack_drained_abort(self._mgr, room)

    # --- decode ----------------------------------------------------------------------------------
    def apply_prefill_status(self, room: int, status: int, prefill_rank: int, reason: Optional[str]) -> None:
        self._mgr.apply_prefill_status(bootstrap_room=room, status=status, prefill_rank=prefill_rank,
                                       failure_reason=reason)

    def note_abort_ack(self, room: int, prefill_rank: int, generation: int) -> None:
        self._mgr.note_abort_ack(room, prefill_rank, generation)

    def arm_deferred_abort(self, room: int) -> int:
        """Decode: the room waits for abort ACKs before SGLang reuses its pages; the generation
        the ACKs must carry."""
        return self._mgr.register_deferred_abort_room(room)
