"""The only module that touches SGLang's private members (SGLang 0.5.23's common disaggregation
classes). When SGLang changes, this file changes and nothing else does.

At import it checks that every private method it relies on exists and names the missing ones;
the per-instance tables SGLang creates in `__init__` are checked once a manager is built
(`check_manager`). Everything here is a one-line pass-through with a public name.
"""

from __future__ import annotations

from typing import Iterable, List, Optional, Tuple

from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common.conn import (
    AckTarget,
    CommonKVManager,
    CommonKVReceiver,
    CommonKVSender,
)

_REQUIRED_METHODS = {
    CommonKVManager: (
        "_prefill_unique_rank",
        "_maybe_ack_drained_abort",
        "_room_notify_targets",
        "_encode_kv_status_message",
        "_send_abort_ack",
        "_start_heartbeat_checker_thread",
    ),
    CommonKVReceiver: ("_send_abort_notification", "_clear", "_connect_to_bootstrap_server"),
    CommonKVSender: (),
}
# Created by CommonKVManager.__init__ (per role), so only checkable on an instance.
_REQUIRED_MANAGER_TABLES = {
    "prefill": ("_zmq_ctx", "_staging_outstanding", "_deferred_ack_targets", "_deferred_ack_poisoned_rooms"),
    "decode": ("_zmq_ctx", "_deferred_abort_ack_tracker", "_heartbeat_shutdown"),
}


class SGLangIncompatible(ImportError):
    pass


def _missing(pairs: Iterable[Tuple[object, str]]) -> List[str]:
    return [f"{getattr(owner, '__name__', type(owner).__name__)}.{name}" for owner, name in pairs
            if not hasattr(owner, name)]


def _check_classes() -> None:
    missing = _missing((cls, name) for cls, names in _REQUIRED_METHODS.items() for name in names)
    if missing:
        raise SGLangIncompatible(
            "sglang-mori relies on SGLang 0.5.23 internals that this SGLang lacks: " + ", ".join(missing)
        )
    from sglang_mori.backend import room_status as ours

    for name, value in (("Failed", ours.FAILED), ("Bootstrapping", ours.BOOTSTRAPPING),
                        ("WaitingForInput", ours.WAITING_FOR_INPUT), ("Transferring", ours.TRANSFERRING),
                        ("Success", ours.SUCCESS)):
        if getattr(KVPoll, name, None) != value:
            raise SGLangIncompatible(f"SGLang's KVPoll.{name} is {getattr(KVPoll, name, None)!r}, "
                                     f"sglang-mori mirrors it as {value} (backend/room_status.py)")


_check_classes()


def check_manager(mgr, role: str) -> None:
    missing = _missing((mgr, name) for name in _REQUIRED_MANAGER_TABLES[role])
    if missing:
        raise SGLangIncompatible(
            f"sglang-mori ({role}) relies on SGLang 0.5.23 manager tables this SGLang lacks: " + ", ".join(missing)
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
        super()._clear()
        self.after_clear()

    def notify_abort(self, *, force_arm: bool = False) -> None:
        raise NotImplementedError

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
    """Entries SGLang's private per-room tables still hold (for debug snapshots)."""
    out = {}
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


def arm_abort_generation(receiver) -> int:
    receiver._abort_generation = receiver.kv_mgr.register_deferred_abort_room(receiver.bootstrap_room)
    return receiver._abort_generation


def abort_generation(receiver) -> Optional[int]:
    return receiver._abort_generation


def bootstrap_socket(receiver, info: dict):
    """(socket, lock) to the prefill rank `info` names, from SGLang's shared socket cache."""
    return receiver._connect_to_bootstrap_server(info)
