"""PrefillService: accept decode's registrations and room metadata, write KV, report completion.

Built from explicit parts (parts.py). Threads, all daemon and stoppable:
- control:    decode's messages on the manager's PULL socket (control.py), and housekeeping; while
              SGLang polls a room waiting for its destinations, its poll reads them (inbox.py);
- shard-N:    chunk planning and submission (submitter.py);
- completion: watches writes, concludes and drains rooms (completion.py).
The scheduler thread calls `claim` / `release` (a sender starts / is cleared) and `add_chunk`
(layer-wise: `track_last_without_writes`). Success is decided by whichever thread sees a room
complete (success.py).
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Optional

import numpy as np
import zmq

from sglang_mori import protocol
from sglang_mori.backend.inbox import Inbox
from sglang_mori.backend.prefill.completion import Completion
from sglang_mori.backend.prefill.control import PrefillControl
from sglang_mori.backend.prefill.effects import RoomEffects
from sglang_mori.backend.prefill.failures import ABORTED, CLEARED_ON_PREFILL, OTHER, PrefillFailures
from sglang_mori.backend.prefill.parts import PrefillParts
from sglang_mori.backend.prefill.submitter import Chunk, ChunkSubmitter
from sglang_mori.backend.prefill.success import SuccessDecider

logger = logging.getLogger(__name__)

PRUNE_INTERVAL_S = 1.0
# How long the control thread waits for a message before it looks at the stop flag and prunes.
CONTROL_WAKE_MS = 200


class PrefillService:
    def __init__(self, parts: PrefillParts, reject: Callable[[protocol.ProtocolError, str], None]):
        self.p = parts
        self.effects = RoomEffects(parts)
        self.failures = PrefillFailures(parts, self.effects)
        self.control = PrefillControl(parts, self.effects, self.failures, reject)
        self.success = SuccessDecider(parts, self.effects)
        self.submitter = ChunkSubmitter(parts, self.effects, self.failures, self.success)
        self.completion = Completion(parts, self.effects, self.failures, self.control.fail_rooms_of_peer,
                                     self.success)
        self.stopped = threading.Event()
        self.threads: list = []
        # decode's messages: read by the control thread, and by SGLang's scheduler when it polls a
        # room still waiting for its destinations (poll_inbox; inbox.py says why)
        self.inbox = (Inbox(parts.control_socket, self._handle_control, "prefill control socket")
                      if getattr(parts, "control_socket", None) is not None else None)

    # --- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        if self.inbox is not None:
            self._spawn("mori-control", self._control_loop)
        for i, q in enumerate(self.submitter.queues):
            self._spawn(f"mori-shard-{i}", self.submitter.run_shard, q)
        self._spawn("mori-shard-stalled", self.submitter.run_shard, self.submitter.stalled_queue)
        self._spawn("mori-completion", self._completion_loop)

    def _spawn(self, name, target, *args) -> None:
        t = threading.Thread(target=target, args=args, name=name, daemon=True)
        t.start()
        self.threads.append(t)

    def stop(self) -> None:
        self.stopped.set()
        if self.inbox is not None:
            self.inbox.close()
        self.submitter.stop()
        self.p.rooms.notify()
        for t in self.threads:
            t.join(timeout=3)

    def _control_loop(self) -> None:
        try:
            self._control_loop_body()
        finally:
            self.inbox.thread_done()

    def _control_loop_body(self) -> None:
        inbox = self.inbox
        next_prune = 0.0
        while not self.stopped.is_set():
            try:
                now = self.p.clock()
                if now >= next_prune:
                    next_prune = now + PRUNE_INTERVAL_S
                    self.control.prune()
                inbox.wait_and_drain(CONTROL_WAKE_MS)
            except zmq.ZMQError:
                if self.stopped.is_set():
                    return
                logger.exception("sglang-mori: control socket error")
            except Exception:  # a bug must not stop the control thread
                logger.exception("sglang-mori: control thread failed")

    def _handle_control(self, frames, polled: bool) -> None:
        try:
            self.control.handle(frames, never_block=polled)
        except Exception:  # a bug must not stop whichever thread read the message
            logger.exception("sglang-mori: control message handling failed")

    def _completion_loop(self) -> None:
        while not self.stopped.is_set():
            try:
                self.completion.run_once()
            except Exception:
                logger.exception("sglang-mori: completion loop error")

    # --- the scheduler's side ---------------------------------------------------------------
    def poll_inbox(self) -> None:
        """SGLang polls a room still waiting for decode's destinations: handle what decode sent,
        here, instead of waiting for the control thread to wake and take the GIL (inbox.py)."""
        if self.inbox is not None:
            self.inbox.drain_nowait()

    def claim(self, room_id: int) -> Optional[str]:
        """A sender for `room_id` starts here. Returns the reason it must fail at once (decode
        aborted it, or its metadata was bad, before the request reached this rank), else None.
        A READY room's destinations go to SGLang (WaitingForInput lets the scheduler send)."""
        p = self.p
        with self.effects.transition() as fx:
            r = p.rooms.claim(room_id, p.clock(), fx)
            return r.reason if r.failed else None

    def release(self, room_id: int) -> None:
        """The room's sender was cleared: this life ends (its writes may still drain). A life
        still open fails through the failure door; decode heard of it from the sender's abort."""
        p = self.p
        with self.effects.transition() as fx:
            life = p.rooms.release_sender(room_id, p.clock())
            if life is not None and not life.concluded and (life.writes or life.submitting):
                self.failures.conclude_locked(life, CLEARED_ON_PREFILL, ABORTED, fx, tell_decode=False)
            fresh = p.rooms.get(room_id)
        if fresh is not None:
            logger.info("sglang-mori: room %s: a queued attempt starts the room's next life", room_id)

    def add_chunk(self, room_id: int, kv_indices, index_slice: slice, is_last: bool, **kw) -> None:
        self.submitter.enqueue(Chunk(
            room=room_id, kv_indices=np.asarray(kv_indices, dtype=np.int64), index_slice=index_slice,
            is_last=is_last, aux_index=kw.get("aux_index"), state_indices=kw.get("state_indices"),
            wait_event=kw.get("wait_event"), num_kv_tokens=kw.get("num_kv_tokens"),
        ))

    def track_last_without_writes(self, chunk: Chunk) -> None:
        """Layer-wise `send()`'s last chunk when the forward streamed every page of it: tracked on
        the scheduler's thread, and Success decided there if every streamed write is done (it
        usually is: the copies ran during the forward), instead of two wake-ups (a shard thread,
        then the completion thread) that each wait for the GIL. Queued like any chunk behind an
        earlier chunk of the room still waiting for its shard."""
        if not self.submitter.track_without_writes(chunk):
            self.submitter.enqueue(chunk)
        elif chunk.life is not None:
            self.success.try_succeed(chunk.life, never_block=True)

    def fail(self, room_id: int, reason: str, label: str = OTHER) -> bool:
        return self.failures.fail(room_id, reason, label)

    # --- introspection ---------------------------------------------------------------------------
    def debug_snapshot(self) -> dict:
        out = self.p.rooms.sizes()
        out["prefill.inflight_writes"] = self.p.peers.budget.total()
        out["prefill.inflight_bytes"] = self.p.peers.budget.total_bytes()
        out["prefill.held_writes"] = self.p.peers.budget.holding
        out["prefill.queued_chunks"] = self.submitter.queued()
        return out
