"""The only module that touches SGLang's private members (SGLang 0.5.23's common disaggregation
classes), and the one that imports SGLang's classes for the rest of the package. When SGLang
changes, this file, sglang_fields.py and the manifest change and nothing else does.

Every member used is declared in sglang_manifest.py. At import the common classes' members are
checked; when a manager is built, every declared member, function and hook target
(`sglang_manifest.check_installed`) and the per-instance tables of its role (`check_manager`).
Everything here is a one-line pass-through with a public name.
"""

from __future__ import annotations

from typing import List, Optional

from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll  # noqa: F401 (KVArgs: re-exported)
from sglang.srt.disaggregation.common.conn import (  # noqa: F401 (re-exported)
    AckTarget,
    CommonKVBootstrapServer,
    CommonKVManager,
    CommonKVReceiver,
    CommonKVSender,
)
from sglang.srt.disaggregation.utils import DisaggregationMode  # noqa: F401 (re-exported)

from sglang_mori.backend import sglang_manifest as manifest
from sglang_mori.backend.sglang_manifest import SGLangIncompatible  # noqa: F401 (re-exported)

# Created by CommonKVManager.__init__ for one role only, so checked on an instance.
_REQUIRED_MANAGER_TABLES = {
    "prefill": ("_zmq_ctx", "_staging_outstanding", "_deferred_ack_targets", "_deferred_ack_poisoned_rooms"),
    "decode": ("_zmq_ctx", "_deferred_abort_ack_tracker", "_heartbeat_shutdown"),
}


def _check_classes() -> None:
    common = {owner: manifest.MEMBERS[owner] for owner in ("CommonKVManager", "CommonKVSender", "CommonKVReceiver")}
    missing = manifest.missing_members(common, with_functions=False)
    if missing:
        import sglang

        raise SGLangIncompatible(manifest.incompatibility(missing, getattr(sglang, "__version__", "unknown")))
    from sglang_mori.backend import room_status as ours

    for name, value in (("Failed", ours.FAILED), ("Bootstrapping", ours.BOOTSTRAPPING),
                        ("WaitingForInput", ours.WAITING_FOR_INPUT), ("Transferring", ours.TRANSFERRING),
                        ("Success", ours.SUCCESS)):
        if getattr(KVPoll, name, None) != value:
            raise SGLangIncompatible(f"SGLang's KVPoll.{name} is {getattr(KVPoll, name, None)!r}, "
                                     f"sglang-mori mirrors it as {value} (backend/room_status.py)")


_check_classes()


def check_manager(mgr, role: str) -> None:
    """Start-up: every declared member of the installed SGLang, then this role's tables."""
    manifest.check_installed()
    missing = [f"{type(mgr).__name__}.{name}" for name in _REQUIRED_MANAGER_TABLES[role] if not hasattr(mgr, name)]
    if missing:
        raise SGLangIncompatible(
            f"sglang-mori ({role}) supports SGLang {manifest.SUPPORTED_SGLANG_VERSION}; this SGLang's manager "
            "lacks the tables: " + ", ".join(missing)
        )


# --- base classes: SGLang's private hooks forwarded to public methods of ours -------------------

class CompatKVManager(CommonKVManager):
    """CommonKVManager whose private extension points call `encode_status_message` and
    `send_abort_ack`, which MoriKVManager implements."""

    def _encode_kv_status_message(self, *, bootstrap_room, status, failure_reason) -> List[bytes]:
        return self.encode_status_message(int(bootstrap_room), int(status), failure_reason)

    def _send_abort_ack(self, room: int, target) -> None:
        self.send_abort_ack(int(room), target.ip, int(target.port), target.generation)

    def encode_status_message(self, room: int, status: int, reason: Optional[str]) -> List[bytes]:
        raise NotImplementedError

    def send_abort_ack(self, room: int, ip: str, port: int, generation: Optional[int]) -> None:
        raise NotImplementedError


class CompatKVReceiver(CommonKVReceiver):
    """CommonKVReceiver whose abort notification and clean-up call public methods of ours."""

    def _send_abort_notification(self, *, force_arm: bool = False):
        self.notify_abort(force_arm=force_arm)

    def _clear(self) -> None:
        self.before_clear()
        super()._clear()
        self.after_clear()

    def notify_abort(self, *, force_arm: bool = False) -> None:
        raise NotImplementedError

    def before_clear(self) -> None:
        pass

    def after_clear(self) -> None:
        pass


# --- manager internals --------------------------------------------------------------------------

def prefill_unique_rank(mgr) -> int:
    return mgr._prefill_unique_rank()


def zmq_context(mgr):
    return mgr._zmq_ctx


def room_notify_targets(mgr, room: int) -> list:
    return mgr._room_notify_targets(room)


def set_writes_outstanding(mgr, room: int, count: int) -> None:
    """SGLang's per-room staging counter, which we use as "writes still outstanding": while it is
    positive, sender.clear() holds a pending abort ACK and poll() holds back Success."""
    mgr._staging_outstanding[room] = count


def drop_writes_outstanding(mgr, room: int) -> None:
    mgr._staging_outstanding.pop(room, None)


def ack_drained_abort(mgr, room: int) -> None:
    """Send the abort ACKs held for `room` (SGLang pops them, so at most once)."""
    mgr._maybe_ack_drained_abort(room)


def ack_poisoned(mgr, room: int) -> bool:
    return room in mgr._deferred_ack_poisoned_rooms


def ack_target(ip: str, port: int, generation: int):
    return AckTarget(ip, port, generation)


def start_heartbeat_checker(mgr):
    return mgr._start_heartbeat_checker_thread()


def stop_heartbeat_checker(mgr) -> None:
    event = getattr(mgr, "_heartbeat_shutdown", None)
    if event is not None:
        event.set()


def room_count(request_status) -> int:
    """Rooms in SGLang's `request_status`: a dict, or on a prefill with PP > 1 a PPConsensusStore,
    which has no len() (its own rooms are in `_local_map`; the peers' replicas do not count)."""
    local = getattr(request_status, "_local_map", None)
    return len(request_status if local is None else local)


def table_sizes(mgr) -> dict:
    """Entries SGLang's per-room tables still hold (for debug snapshots). Some exist on one role
    only (sglang_manifest.OPTIONAL)."""
    out = {"sglang.request_status": room_count(mgr.request_status)}
    with mgr.failure_lock:
        out["sglang.failure_records"] = len(mgr.failure_records)
    for name in ("transfer_infos", "req_to_decode_prefix_len", "required_prefill_response_num_table",
                 "prefill_response_tracker"):
        table = getattr(mgr, name, None)
        if table is not None:
            out[f"sglang.{name}"] = len(table)
    tracker = getattr(mgr, "addr_to_rooms_tracker", None)
    if tracker is not None:
        out["sglang.addr_to_rooms_tracker"] = sum(len(v) for v in list(tracker.values()))
    for name, label in (("_staging_outstanding", "sglang.writes_outstanding"),
                        ("_deferred_ack_targets", "sglang.deferred_ack_targets"),
                        ("_deferred_abort_ack_tracker", "sglang.deferred_abort_ack_tracker")):
        table = getattr(mgr, name, None)
        if table is not None:
            out[label] = sum(1 for v in list(table.values()) if v)
    return out


# --- receiver internals -------------------------------------------------------------------------

def owns_room(receiver) -> bool:
    return receiver._owns_bootstrap_room


def disown_room(receiver) -> None:
    """This receiver must never touch its room's state (another live request owns the id)."""
    receiver._owns_bootstrap_room = False


def set_abort_generation(receiver, generation: int) -> None:
    receiver._abort_generation = generation


def abort_generation(receiver) -> Optional[int]:
    return receiver._abort_generation


def bootstrap_socket(receiver, info: dict):
    """(socket, lock) to the prefill rank `info` names, from SGLang's shared socket cache."""
    return receiver._connect_to_bootstrap_server(info)


def deferred_release_timeout_s() -> float:
    """SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT as SGLang reads it (decode.py's
    DecodeTransferQueue): how long decode holds a failed room's pages waiting for prefill's ACK."""
    from sglang.srt.environ import envs

    return float(envs.SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT.get())
