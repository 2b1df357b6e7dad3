"""Prefill rooms: one state machine per room, all of them in one registry under one lock.

A room's life on a prefill rank (states are `Phase`):

    AWAITING_METADATA --(every decode destination known)--> READY --(first chunk)--> SUBMITTING
          |                                                   |                           |
          +-------------------- fail / abort -----------------+---------------------------+
                                                              v
                                                          CONCLUDED  (outcome decided; writes may
                                                              |       still be on the wire)
                                      every write terminal    |    a write cannot be proven drained
                                              DRAINED <-------+-------> POISONED

Two actors open a room: the scheduler's sender (`claim`) and decode's RoomMetadata (`add_target`),
in either order. A room leaves the registry once it is terminal (DRAINED/POISONED) and its sender
is gone (`release_sender`), or, never claimed, after the bootstrap timeout (`prune_unclaimed`).
A life whose sender is cleared while its writes still drain moves aside (`draining`), so the same
room id can start a new life at once (retract-rebootstrap).

Replays are told from new attempts by decode's attempt id, never by "finished recently": every
attempt a finished life served is remembered (bounded) and metadata naming one is a replay.

Nothing here sends, sleeps or touches SGLang: the registry's transitions record what SGLang, the
in-flight budget, decode and the metrics must see in an `Effects` (effects.py), and the one applier
carries it out. Layer-wise streaming keeps a room's stream state in the room (`layerwise`) and the
rank's checkpoint hazards here, under the same lock. Time is passed in, so tests drive every
transition with a fake clock.
"""

from __future__ import annotations

import collections
import enum
import threading
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import numpy as np

from sglang_mori.backend import room_status
from sglang_mori.backend.prefill.effects import Effects, Failure, Success
from sglang_mori.engine import WriteState

# Attempts of finished lives remembered for replay detection (count and age bounds).
FINISHED_ATTEMPTS_MAX = 100_000
FINISHED_ATTEMPTS_TTL_S = 300.0
# Metadata for a new attempt that arrives while the previous life still runs waits here.
NEXT_LIFE_MAX_TARGETS = 64


class Phase(enum.Enum):
    AWAITING_METADATA = "awaiting_metadata"
    READY = "ready"
    SUBMITTING = "submitting"
    CONCLUDED = "concluded"
    DRAINED = "drained"
    POISONED = "poisoned"


class Sender(enum.Enum):
    """The scheduler's sender for the room on this rank."""

    NONE = "none"  # never claimed: decode's messages opened the room, SGLang holds nothing for it
    HELD = "held"  # a sender exists: SGLang's tables for the room id are this life's
    CLEARED = "cleared"  # its sender was cleared: the life is over (its writes may still drain)


class Outcome(enum.Enum):
    """Decided once, when the room leaves the open phases."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"


TERMINAL = (Phase.DRAINED, Phase.POISONED)
OPEN = (Phase.AWAITING_METADATA, Phase.READY, Phase.SUBMITTING)


@dataclass
class RoomTarget:
    """One decode rank's destination for one room (from RoomMetadata).

    `endpoint` (ip), `dst_port`, `is_dummy` and `required_dst_info_num` are the names SGLang's
    common code reads from its `transfer_infos` table, which holds these objects.
    """

    engine_key: str
    attempt: int
    endpoint: str
    dst_port: int
    kv_indices: np.ndarray
    aux_index: Optional[int]
    state_indices: Optional[list]
    required_dst_info_num: int
    decode_prefix_len: Optional[int]
    is_dummy: bool
    reject_reason: Optional[str] = None
    # The planner that found every KV index within decode's buffers (plans.check_destination):
    # the chunks planned by that same planner skip the per-chunk check of decode's indices.
    kv_checked_by: object = field(default=None, repr=False, compare=False)

    @property
    def address(self) -> Tuple[str, int]:
        return (self.endpoint, self.dst_port)


def decode_prefix_len(targets) -> int:
    """The decode prefix of a room (tokens decode holds already; its `kv_indices` start after
    them): the first non-zero one among its destinations, else 0. SGLang reads the same value at
    `finalize_bootstrap` (`pop_decode_prefix_len`, published by `publish_destinations`), so what
    layer-wise streams before that agrees with the `send()` after it."""
    return next((t.decode_prefix_len for t in targets if t.decode_prefix_len), 0)


@dataclass
class TrackedWrite:
    handle: object  # engine.TransferHandle
    deadline: float


@dataclass
class PrefillRoom:
    room: int
    created_at: float
    phase: Phase = Phase.AWAITING_METADATA
    sender: Sender = Sender.NONE
    targets: Dict[str, RoomTarget] = field(default_factory=dict)
    required: int = 1
    next_life: Dict[str, RoomTarget] = field(default_factory=dict)
    writes: List[TrackedWrite] = field(default_factory=list)
    # Submit tokens held: submitter threads between their live check and tracking their writes,
    # and layer-wise batches between their publication and their end (a count, not a phase: any
    # number of holders at once).
    submitting: int = 0
    # Chunks the scheduler queued for a shard that no shard has taken yet (submitter.py): a last
    # chunk with nothing to write may be tracked on the scheduler's thread only behind none.
    queued: int = 0
    # Its chunks go through the stalled-decodes shard from now on (submitter.py), in order.
    on_stalled_shard: bool = False
    last_submitted: bool = False
    aux_index: Optional[int] = None
    outcome: Optional[Outcome] = None  # set on leaving the open phases
    reason: Optional[str] = None
    concluded_at: float = 0.0
    layerwise: object = None  # layerwise.session.RoomRecord of this life, once it streams
    fenced: bool = False  # its running writes' peers were fenced (fence.py), at most once
    # The last chunk's TransferStarted, held back (announce.py): due at `announce_at` unless the
    # room concludes first, to each (decode address, attempt) in `announce_to`.
    announce_at: Optional[float] = None
    announce_to: Optional[list] = None

    # --- queries ------------------------------------------------------------------------
    @property
    def claimed(self) -> bool:
        """A sender for this room exists on this rank."""
        return self.sender is Sender.HELD

    @property
    def ever_claimed(self) -> bool:
        return self.sender is not Sender.NONE

    @property
    def succeeded(self) -> bool:
        return self.outcome is Outcome.SUCCEEDED

    @property
    def failed(self) -> bool:
        return self.outcome is Outcome.FAILED

    @property
    def concluded(self) -> bool:
        return self.phase not in OPEN

    @property
    def terminal(self) -> bool:
        return self.phase in TERMINAL

    def is_ready(self) -> bool:
        return len(self.targets) >= self.required

    def live_targets(self) -> List[RoomTarget]:
        return [t for t in self.targets.values() if not t.is_dummy]

    def notify_destinations(self) -> List[Tuple[Tuple[str, int], int]]:
        """(decode address, attempt) of each live target, once each: a status names the attempt of
        the receiver it goes to, so decode never applies it to a later receiver of the room id."""
        out: List[Tuple[Tuple[str, int], int]] = []
        for t in self.live_targets():
            if (t.address, t.attempt) not in out:
                out.append((t.address, t.attempt))
        return out

    def attempts(self) -> frozenset:
        return frozenset(t.attempt for t in self.targets.values())

    def unfinished(self) -> list:
        return [w.handle for w in self.writes if not w.handle.quiescent()]

    def outstanding(self) -> int:
        """What SGLang must see as "writes outstanding": submitters at work plus running writes."""
        return self.submitting + len(self.unfinished())

    def drain_proven(self) -> bool:
        return all(w.handle.drained() for w in self.writes)

    def verdict(self, now: float) -> Tuple[WriteState, str]:
        """(state, reason) over every write: FAILED on the first failure or expired deadline,
        RUNNING while any runs, SUCCEEDED when all succeeded (vacuously with none)."""
        running = False
        for w in self.writes:
            state = w.handle.state()
            if state is WriteState.RUNNING:
                if now > w.deadline:
                    return WriteState.FAILED, (
                        f"KV transfer to decode engine {w.handle.peer_key} timed out: not complete "
                        f"after {(now - w.handle.started_at) * 1000:.0f} ms (SGLANG_MORI_TRANSFER_TIMEOUT_MS)"
                    )
                running = True
            elif state is WriteState.FAILED:
                return WriteState.FAILED, (
                    f"KV transfer to decode engine {w.handle.peer_key} failed: {w.handle.failure_message()}"
                )
        return (WriteState.RUNNING, "") if running else (WriteState.SUCCEEDED, "")

    def ready_to_succeed(self, now: float) -> bool:
        """Success may be concluded now: open, the last chunk tracked, no submit token held, and
        every tracked write succeeded. Meaningful only under the registry lock: `end_submit`
        changes the writes and the flags together, so a verdict and flags read apart (one before
        a last chunk was tracked, the other after) could approve writes still running."""
        return (not self.concluded and self.last_submitted and not self.submitting
                and self.verdict(now)[0] is WriteState.SUCCEEDED)

    # --- transitions --------------------------------------------------------------------
    def add_target(self, target: RoomTarget) -> bool:
        """Record one decode rank's destination; True when this made the room READY."""
        if self.phase is not Phase.AWAITING_METADATA:
            raise RoomStateError(self, "add a destination")
        self.targets[target.engine_key] = target
        self.required = max(1, target.required_dst_info_num)
        if self.is_ready():
            self.phase = Phase.READY
            return True
        return False

    def begin_submit(self) -> bool:
        """A submitter starts on a chunk; False (nothing changes) unless the room takes writes."""
        if self.phase not in (Phase.READY, Phase.SUBMITTING) or not self.claimed:
            return False
        self.phase = Phase.SUBMITTING
        self.submitting += 1
        return True

    def end_submit(self, writes: List[TrackedWrite], last_chunk: bool, aux_index: Optional[int]) -> None:
        """The submitter's writes are tracked (whatever happened to the room meanwhile)."""
        self.submitting -= 1
        self.writes.extend(writes)
        if last_chunk and not self.concluded:
            self.aux_index = aux_index
            self.last_submitted = True

    def conclude(self, ok: bool, reason: Optional[str], now: float) -> bool:
        """Decide the outcome once; False when it was decided already."""
        if self.concluded:
            return False
        self.phase = Phase.CONCLUDED
        self.outcome = Outcome.SUCCEEDED if ok else Outcome.FAILED
        self.reason = reason
        self.concluded_at = now
        return True

    def try_finish(self, now: float, give_up_after_s: float) -> Optional[Phase]:
        """CONCLUDED -> DRAINED or POISONED once nothing more can be learnt; None while writes run.

        DRAINED: every write is terminal and none can still land (succeeded, or failed before
        posting). POISONED: a failed write may still have bytes on the wire (MORI fails a transfer
        at its first error while its other QPs keep writing), or writes stayed running past
        `give_up_after_s` after the conclusion: nothing proves the decode pages are safe."""
        if self.phase is not Phase.CONCLUDED or self.submitting:
            return None
        if self.unfinished():
            if now - self.concluded_at <= give_up_after_s:
                return None
            self.phase = Phase.POISONED
            return self.phase
        self.phase = Phase.DRAINED if (self.succeeded or self.drain_proven()) else Phase.POISONED
        return self.phase


class RoomStateError(RuntimeError):
    def __init__(self, room: PrefillRoom, action: str):
        super().__init__(f"room {room.room}: cannot {action} in phase {room.phase.value}")


class MetadataVerdict(enum.Enum):
    ACCEPTED = "accepted"  # recorded; `ready` says whether the room became READY
    REPLAY = "replay"  # an attempt this rank already served or holds: dropped
    QUEUED_NEXT_LIFE = "queued_next_life"  # a new attempt while the previous life still runs
    REJECTED = "rejected"  # the room is past taking destinations and no next life can be queued


@dataclass
class MetadataOutcome:
    verdict: MetadataVerdict
    room: Optional[PrefillRoom] = None
    ready: bool = False
    detail: str = ""


class PrefillRoomRegistry:
    """Every room of one prefill rank. `lock` guards every room and table here; callers hold it
    (`with registry.lock:`) around each transition and its bookkeeping, so "room is live" and
    "its writes are tracked" can never be separated by an abort."""

    def __init__(self):
        self.lock = threading.Lock()
        self._changed = threading.Condition(self.lock)
        self.generation = 0
        self.rooms: Dict[int, PrefillRoom] = {}
        # Lives whose sender was cleared while writes still drain, keyed by (room, serial).
        self.draining: Dict[Tuple[int, int], PrefillRoom] = {}
        self._serial = 0
        self._finished: "collections.OrderedDict[int, float]" = collections.OrderedDict()  # attempt -> time
        # Layer-wise: lives whose streamed pages a radix checkpoint moved while writes from them
        # may still run; the next forward waits for them (layerwise/session.py).
        self.hazards: List[PrefillRoom] = []

    def open_count(self) -> int:
        """Rooms held in any state, draining lives included (the open-rooms gauge)."""
        with self.lock:
            return len(self.rooms) + len(self.draining)

    # --- lookups (lock held) --------------------------------------------------------------
    def get(self, room: int) -> Optional[PrefillRoom]:
        return self.rooms.get(room)

    def draining_lives(self, room: int) -> List[PrefillRoom]:
        return [r for (rid, _), r in self.draining.items() if rid == room]

    def with_writes(self) -> List[PrefillRoom]:
        """Rooms the completion thread must watch: submission began (a room whose destinations are
        all dummies has chunks but no writes, and still concludes), or concluded and not terminal."""
        out = [r for r in self.rooms.values() if r.phase in (Phase.SUBMITTING, Phase.CONCLUDED)]
        out.extend(self.draining.values())
        return out

    def owns_sglang_state(self, r: PrefillRoom) -> bool:
        """Whether `r` may write SGLang's per-room-id tables: it is the room id's current life, or
        the id has none (a draining life must not clobber a new life's entries)."""
        if not r.ever_claimed:
            return False  # decode's messages opened it: SGLang holds nothing for it
        current = self.rooms.get(r.room)
        return current is None or current is r

    def finished_attempt(self, attempt: int, now: float) -> bool:
        at = self._finished.get(attempt)
        return at is not None and now - at <= FINISHED_ATTEMPTS_TTL_S

    # --- transitions (lock held) ------------------------------------------------------------
    def open(self, room: int, now: float) -> PrefillRoom:
        r = self.rooms.get(room)
        if r is None:
            r = self.rooms[room] = PrefillRoom(room=room, created_at=now)
        return r

    def claim(self, room: int, now: float, fx: Optional[Effects] = None) -> PrefillRoom:
        """A sender for `room` starts on this rank (its request reached prefill). SGLang then
        sees the failure decode caused before it arrived, or the destinations of a READY room."""
        fx = Effects() if fx is None else fx
        # A failure record left by an earlier life of this id would be adopted by this one.
        fx.stale_failures.append(room)
        r = self.open(room, now)
        r.sender = Sender.HELD
        if r.failed:
            fx.failures.append(Failure(room, r.reason, None, [], in_sglang=True))
        else:
            self._publish_destinations(r, fx)
        return r

    def _publish_destinations(self, r: PrefillRoom, fx: Effects) -> None:
        """A claimed READY room: SGLang may send into its destinations (WaitingForInput)."""
        if r.claimed and r.phase is Phase.READY:
            fx.published.append((r.room, dict(r.targets)))

    def add_target(self, target: RoomTarget, room: int, now: float, fx: Optional[Effects] = None) -> MetadataOutcome:
        if self.finished_attempt(target.attempt, now):
            return MetadataOutcome(MetadataVerdict.REPLAY, detail=f"attempt {target.attempt} already served")
        r = self.open(room, now)
        known = r.targets.get(target.engine_key)
        if known is not None and known.attempt == target.attempt:
            return MetadataOutcome(MetadataVerdict.REPLAY, r, detail=f"attempt {target.attempt} is in this room already")
        if r.phase is Phase.AWAITING_METADATA and known is None:
            ready = r.add_target(target)
            if ready:
                self._publish_destinations(r, Effects() if fx is None else fx)
            return MetadataOutcome(MetadataVerdict.ACCEPTED, r, ready=ready)
        if not r.concluded:
            # Never re-target a live room: a different attempt for it is either forged or from a
            # decode that has not aborted the attempt this life serves.
            return MetadataOutcome(MetadataVerdict.REJECTED, r, detail=(
                f"attempt {target.attempt} from {target.engine_key} for a room in phase {r.phase.value} "
                "serving another attempt"))
        # A new attempt after this life concluded (decode aborted it, retracted the request and
        # bootstrapped it again) while its sender is still here: it belongs to the next life.
        pending = r.next_life.get(target.engine_key)
        if pending is not None and pending.attempt == target.attempt:
            return MetadataOutcome(MetadataVerdict.REPLAY, r, detail=f"attempt {target.attempt} already queued")
        if len(r.next_life) >= NEXT_LIFE_MAX_TARGETS and target.engine_key not in r.next_life:
            return MetadataOutcome(MetadataVerdict.REJECTED, r,
                                   detail=f"room in phase {r.phase.value} with {len(r.next_life)} queued destinations")
        r.next_life[target.engine_key] = target
        return MetadataOutcome(MetadataVerdict.QUEUED_NEXT_LIFE, r)

    def abort_attempt(self, room: int, attempt: int, now: float) -> Tuple[Optional[PrefillRoom], bool]:
        """Decode aborted `attempt` of `room`. Returns (the life it ends or None, known): `known`
        is False when no life here knows the attempt yet (its request has not reached this rank)."""
        if self.finished_attempt(attempt, now):
            return None, True  # the life it named is over already
        r = self.rooms.get(room)
        if r is None:
            # A life of this room id still draining here knows it, even when the attempt is not
            # recognised: never open an "aborted before arrival" room beside it.
            return None, bool(self.draining_lives(room))
        for key, t in list(r.next_life.items()):
            if t.attempt == attempt:
                del r.next_life[key]  # a queued attempt that will never be served
                return None, True
        if not r.targets or attempt in r.attempts():
            return r, True
        return None, False

    def release_sender(self, room: int, now: float) -> Optional[PrefillRoom]:
        """The room's sender was cleared. Its life ends here: forgotten now if terminal (or
        nothing was ever submitted), else moved aside to drain (the caller fails it through the
        failure door if it was still open). A queued next life takes over the room id. Returns
        the life that ended."""
        r = self.rooms.pop(room, None)
        if r is None:
            return None
        r.sender = Sender.CLEARED
        for attempt in r.attempts():
            self._remember_finished(attempt, now)
        if not r.terminal and (r.writes or r.submitting):
            self._serial += 1
            self.draining[(room, self._serial)] = r
        if r.next_life:
            fresh = self.open(room, now)
            for target in r.next_life.values():
                if fresh.phase is Phase.AWAITING_METADATA:
                    fresh.add_target(target)
        if not r.terminal or r.next_life:
            # The completion thread watches what drains and what opens; a terminal life that
            # leaves is nothing to it (the usual clear after Success: no wake-up, no pass).
            self.notify_locked()
        return r

    # --- transitions with effects (lock held; `fx` from RoomEffects.transition()) ------------
    def _publish_outstanding(self, r: PrefillRoom, fx: Effects) -> None:
        if self.owns_sglang_state(r):
            fx.outstanding[r.room] = r.outstanding()

    def begin_submit(self, r: PrefillRoom, fx: Effects, *, transferring: bool = True) -> bool:
        """A submitter takes a submit token on `r`; False (nothing changes) unless it takes writes.
        The first one moves SGLang's status to Transferring, unless `transferring` is False: a
        request SGLang still holds as `pending_bootstrap` (optimistic prefill) must poll
        WaitingForInput until its `finalize_bootstrap` (SGLang 0.5.23's handle_pending_bootstrap
        raises on any other state), and it then treats Transferring and WaitingForInput alike."""
        first = r.phase is Phase.READY
        if not r.begin_submit():
            return False
        self._publish_outstanding(r, fx)
        if first and transferring:
            fx.statuses.append((r.room, room_status.TRANSFERRING))
        return True

    def end_submit(self, r: PrefillRoom, writes: List[TrackedWrite], last_chunk: bool, aux_index: Optional[int],
                   fx: Effects) -> None:
        """The token's writes are tracked (whatever happened to the room meanwhile)."""
        r.end_submit(writes, last_chunk, aux_index)
        self._publish_outstanding(r, fx)
        fx.changed = True

    def succeed(self, r: PrefillRoom, aux_index: Optional[int], aux: Optional[list], now: float, fx: Effects) -> bool:
        """Every write succeeded after the last chunk: Success to SGLang and decode, with `aux`
        (read from `aux_index`). Decided here, on the room as it is under the lock: False, and
        nothing changes, unless `ready_to_succeed` holds now and `aux_index` is still the room's
        (a pass that looked before a submitter tracked more writes must not conclude)."""
        if not r.ready_to_succeed(now) or r.aux_index != aux_index:
            return False
        if not r.conclude(True, None, now):
            return False
        fx.successes.append(Success(r.room, r.notify_destinations(), aux))
        fx.changed = True
        return True

    def return_slots(self, r: PrefillRoom, fx: Effects, *, every: bool = False) -> None:
        """Return the in-flight budget of each write that turned quiescent (`every`: of each
        write not returned yet, the room being given up on). Each slot goes back once."""
        for w in r.writes:
            handle = w.handle
            if not handle.released and (every or handle.quiescent()):
                handle.released = True
                fx.slots.append(handle)

    def settle(self, r: PrefillRoom, now: float, give_up_after_s: float, fx: Effects) -> Optional[Phase]:
        """The completion thread's pass over a room with writes: return finished writes' slots,
        publish what is outstanding, and once the room is DRAINED or POISONED forget a draining
        life, return every remaining slot and release (DRAINED) or poison decode's held ACKs."""
        self.return_slots(r, fx)
        finished = r.try_finish(now, give_up_after_s)
        owns = self.owns_sglang_state(r)
        if finished is None:
            self._publish_outstanding(r, fx)
            return None
        if owns:
            fx.outstanding[r.room] = None
        self.forget_if_done(r)
        # Never visited again: a write that turned quiescent after the pass above and before
        # try_finish saw every write quiescent would keep its slot otherwise.
        self.return_slots(r, fx, every=True)
        if owns:
            if finished is Phase.POISONED:
                fx.poisoned.append(r.room)
            else:
                fx.acks.append(r.room)
        return finished

    # --- layer-wise (lock held) ----------------------------------------------------------------
    def batch_ended(self, r: PrefillRoom) -> None:
        """A published layer-wise batch of `r` reached its end marker."""
        r.layerwise.pending_batches -= 1

    def add_hazard(self, r: PrefillRoom) -> None:
        if not any(h is r for h in self.hazards):
            self.hazards.append(r)

    def take_hazards(self) -> List[PrefillRoom]:
        hazards, self.hazards = self.hazards, []
        return hazards

    def forget_if_done(self, r: PrefillRoom) -> bool:
        """Drop a terminal draining life. A current life stays until its sender is cleared
        (`release_sender`) or, never claimed, until `prune_unclaimed`: a room decode aborted
        before its request arrived must still fail that request's sender when it comes."""
        if not r.terminal:
            return False
        for key, life in list(self.draining.items()):
            if life is r:
                del self.draining[key]
                return True
        return False

    def prune_unclaimed(self, now: float, ttl_s: float) -> List[PrefillRoom]:
        """Rooms that decode's messages opened and no request claimed within `ttl_s`: metadata
        for a request that never reaches this rank, or hostile input."""
        dropped = []
        for room, r in list(self.rooms.items()):
            if not r.ever_claimed and now - r.created_at > ttl_s and not r.writes and not r.submitting:
                del self.rooms[room]
                dropped.append(r)
        return dropped

    def _remember_finished(self, attempt: int, now: float) -> None:
        self._finished[attempt] = now
        self._finished.move_to_end(attempt)
        while self._finished and (
            len(self._finished) > FINISHED_ATTEMPTS_MAX
            or now - next(iter(self._finished.values())) > FINISHED_ATTEMPTS_TTL_S
        ):
            self._finished.popitem(last=False)

    # --- wake-ups -------------------------------------------------------------------------
    def notify_locked(self) -> None:
        self.generation += 1
        self._changed.notify_all()

    def notify(self) -> None:
        """Something changed (writes tracked, a room concluded): wake the completion thread."""
        with self.lock:
            self.notify_locked()

    def wait_for_change(self, seen_generation: int, timeout: float) -> None:
        """Sleep until notify() since `seen_generation`, or timeout. The completion thread must
        never spin: between two chunks a busy loop would hold the GIL against the forward pass."""
        with self.lock:
            if self.generation == seen_generation:
                self._changed.wait(timeout)

    def sizes(self) -> dict:
        with self.lock:
            claimed = sum(1 for r in self.rooms.values() if r.ever_claimed)
            return {
                "prefill.rooms": claimed,
                # Opened by decode's messages before any request claimed them (pruned after the
                # bootstrap timeout).
                "prefill.unclaimed_rooms": len(self.rooms) - claimed,
                "prefill.draining": len(self.draining),
                "prefill.rooms_with_writes": len(self.with_writes()),
            }
