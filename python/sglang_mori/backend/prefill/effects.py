"""What prefill room transitions change outside the registry, and the one applier that does it.

The registry's transitions (rooms.py) never touch SGLang, the in-flight budget, the messenger or
the metrics: they record what must happen in an `Effects` and return. `RoomEffects.transition()`
is the only way callers run transitions: it holds the registry lock around them, applies the
effects that must stay ordered with the room's state (SGLang's outstanding counts, failure records,
poison marks, held abort ACKs) before it lets the lock go, and everything that may block or send
(statuses that let the scheduler move on, messages, metrics, budget slots) right after. No other
code writes SGLang's room tables or returns a budget slot, so SGLang's view of a room cannot drift
from the registry's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from sglang_mori import protocol
from sglang_mori.backend import room_status

logger = logging.getLogger(__name__)


@dataclass
class Failure:
    """A room concluded failed (or, `label` None, SGLang learns of an earlier failure)."""

    room: int
    reason: str
    label: Optional[str]  # metrics reason; None: counted when the room concluded
    destinations: list  # (decode address, attempt) to tell (empty: decode knows, or nobody to tell)
    in_sglang: bool  # the room's sender holds it: SGLang records the failure


@dataclass
class Success:
    room: int
    destinations: list  # (decode address, attempt)
    aux: Optional[list]


class Effects:
    """Everything a batch of transitions asks of the world, in the order it is applied.

    A plain class with slots, not a dataclass: one is built per transition, several per request
    on the scheduler's process and one between a copy's end and its room's Success, and the
    dataclass's generated __init__ with a default factory per field cost about twice as much
    (issue 28)."""

    __slots__ = ("stale_failures", "outstanding", "failures", "poisoned", "held_acks", "changed", "slots",
                 "statuses", "published", "successes", "acks", "sends", "never_block")

    def __init__(self, never_block: bool = False):
        self.stale_failures: List[int] = []  # a new life: drop an old life's record
        self.outstanding: Dict[int, Optional[int]] = {}  # room -> count (None: drop)
        self.failures: List[Failure] = []
        self.poisoned: List[int] = []
        self.held_acks: List[Tuple[int, str, int, int]] = []  # (room, ip, port, generation)
        self.changed = False  # wake the completion thread
        # --- after the lock ---
        self.slots: list = []  # engine handles whose in-flight budget returns (once each)
        self.statuses: List[Tuple[int, int]] = []  # (room, status) that let SGLang move on
        self.published: List[Tuple[int, dict]] = []  # (room, destinations)
        self.successes: List[Success] = []
        self.acks: List[int] = []  # rooms whose held abort ACKs go out
        self.sends: list = []  # (address, message)
        # The caller is SGLang's scheduler thread: a message that cannot be queued at once is
        # dropped (logged) rather than stall the scheduler up to the send timeout.
        self.never_block = never_block


class RoomEffects:
    """The applier. Built on the service's parts; `transition()` is its one entry for rooms."""

    def __init__(self, parts):
        self.p = parts
        # Called with a room id right after its destinations were published to SGLang (the
        # layer-wise session joins an optimistic request still waiting for them); must not raise.
        self.on_published = None

    def transition(self, *, never_block: bool = False) -> "_Transition":
        """`with effects.transition() as fx:` run transitions on `parts.rooms` (lock held), each
        recording into `fx`; on exit the effects are applied, also when the body raised.
        `never_block`: messages are sent without waiting on a full queue (SGLang's scheduler thread)."""
        return _Transition(self, never_block)

    def take_slot(self, peer_key: str, deadline: float, nbytes: int = 0, abandoned=None):
        """One in-flight write of `nbytes` to `peer_key` (held up to `deadline`, or until
        `abandoned()`: peers.Admission); returned through `fx.slots` once the write's handle is
        terminal, or at once with `return_unused_slot`."""
        return self.p.peers.budget.acquire(peer_key, deadline, nbytes, abandoned)

    def try_slot(self, peer_key: str, nbytes: int = 0) -> bool:
        """`take_slot` when it would admit at once; False, and nothing taken, when it would hold."""
        return self.p.peers.budget.try_acquire(peer_key, nbytes)

    def return_unused_slot(self, peer_key: str, nbytes: int = 0) -> None:
        """A slot taken for a write that was never issued (no handle tracks it)."""
        self.p.peers.budget.release(peer_key, nbytes=nbytes)

    # --- application ----------------------------------------------------------------------------
    def _apply_locked(self, fx: Effects) -> None:
        sglang = self.p.sglang
        for room in fx.stale_failures:
            sglang.drop_stale_failure(room)
        for room, count in fx.outstanding.items():
            if count is None:
                sglang.drop_outstanding(room)
            else:
                sglang.set_outstanding(room, count)
        for f in fx.failures:
            # SGLang's tables change only while the sender holds the room: a failure recorded after
            # its clear() would have no reader (and a later request reusing the id would adopt it).
            if f.in_sglang and sglang.status(f.room) is not None:
                sglang.fail(f.room, f.reason)
                f.reason = sglang.failure_reason(f.room) or f.reason
        for room in fx.poisoned:
            sglang.poison(room)
        for room, ip, port, generation in fx.held_acks:
            sglang.hold_ack(room, ip, port, generation)
        if fx.changed or fx.failures:
            self.p.rooms.notify_locked()

    def _apply_after(self, fx: Effects) -> None:
        p = self.p
        block = not fx.never_block
        for handle in fx.slots:
            p.peers.budget.release(handle.peer_key, nbytes=handle.nbytes)
            state = handle.state()
            ok = state is state.SUCCEEDED
            reason = None if ok else handle.failure_kind().metric_reason
            p.metrics.transfer_finished(handle.peer_key, handle.nbytes, p.clock() - handle.started_at, ok=ok,
                                        reason=reason)
        for room, status in fx.statuses:
            p.sglang.set_status(room, status)
        for room, targets in fx.published:
            p.sglang.publish_destinations(room, targets)
            if self.on_published is not None:
                try:
                    self.on_published(room)
                except Exception:
                    logger.exception("sglang-mori: room %s: after publishing its destinations", room)
        if fx.failures:
            p.peers.budget.wake()  # a write held for a room that just ended is dropped, not posted
        for f in fx.failures:
            if f.label is None:
                continue
            logger.warning("sglang-mori: room %s failed: %s", f.room, f.reason)
            p.metrics.request_finished(ok=False, reason=f.label)
            for address, attempt in f.destinations:
                p.messenger.send(address, protocol.RoomStatus(room=f.room, attempt=attempt, status=room_status.FAILED,
                                                              prefill_rank=p.sglang.prefill_rank, reason=f.reason),
                                 block=block)
        for s in fx.successes:
            p.sglang.set_status(s.room, room_status.SUCCESS)
            for address, attempt in s.destinations:
                p.messenger.send(address, protocol.RoomStatus(room=s.room, attempt=attempt, status=room_status.SUCCESS,
                                                              prefill_rank=p.sglang.prefill_rank, aux=s.aux),
                                 block=block)
            p.metrics.request_finished(ok=True)
        for room in fx.acks:
            p.sglang.release_acks(room)
        for address, message in fx.sends:
            p.messenger.send(address, message, block=block)


class _Transition:
    """RoomEffects.transition() as a plain context manager: several run per request on the
    scheduler's process, and a generator-based one cost a few microseconds more each (issue 28)."""

    __slots__ = ("effects", "lock", "fx")

    def __init__(self, effects: RoomEffects, never_block: bool):
        self.effects = effects
        self.lock = effects.p.rooms.lock
        self.fx = Effects(never_block=never_block)

    def __enter__(self) -> Effects:
        self.lock.acquire()
        return self.fx

    def __exit__(self, *exc) -> bool:
        try:
            try:
                self.effects._apply_locked(self.fx)
            finally:
                self.lock.release()
        finally:
            self.effects._apply_after(self.fx)
        return False
