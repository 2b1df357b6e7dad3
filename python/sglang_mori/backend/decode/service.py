"""DecodeService: register our buffers with prefill ranks, publish room destinations, apply statuses.

One thread reads the manager's PULL socket (and SGLang's scheduler, when it polls: inbox.py): RoomStatus (Success carries the aux bytes, copied into
the room's aux slot before Success is recorded), TransferStarted (restarts the room's transfer
deadline) and AbortAck. The same thread enforces that deadline, so a prefill that dies mid-transfer
fails its rooms within SGLANG_MORI_TRANSFER_TIMEOUT_MS plus a grace, not after SGLang's 300 s
waiting timeout.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import zmq

from sglang_mori import protocol
from sglang_mori.backend import room_status
from sglang_mori.backend.decode.effects import AUX_DOES_NOT_FIT, TRANSFER_DEADLINE, DecodeEffects
from sglang_mori.backend.decode.rooms import DecodeRoomRegistry
from sglang_mori.backend.failure_reasons import OTHER, TIMEOUT
from sglang_mori.backend.inbox import Inbox
from sglang_mori.backend.messenger import Messenger
from sglang_mori.backend.plans import LocalBuffers, encode_layout
from sglang_mori.config import MoriConfig

logger = logging.getLogger(__name__)

# Margin over the prefill's own per-chunk deadline, so prefill reports a timeout with its reason
# before decode gives up on its own.
DEADLINE_GRACE_S = 5.0


@dataclass
class DecodeIdentity:
    """Where prefill reaches this decode rank, and what it is."""

    ip: str
    port: int  # the manager's PULL socket
    attn_tp_size: int
    attn_tp_rank: int
    dcp_size: int = 1
    dcp_rank: int = 0
    # SGLang's enable_all_cp_ranks_for_transfer on this decode (see protocol.Register).
    cp_all_ranks: bool = False


@dataclass
class AuxSlots:
    """This rank's aux buffers (host memory): pointers, item and buffer sizes, per buffer."""

    ptrs: list
    item_lens: list
    buffer_lens: list


@dataclass
class DecodeParts:
    config: MoriConfig
    engine: object  # engine.TransferEngine
    local: LocalBuffers
    layout: object  # planning.KVLayout
    identity: DecodeIdentity
    aux: AuxSlots
    messenger: Messenger
    metrics: object
    sglang: object  # sglang_adapter.SGLangAdapter or a fake
    control_socket: object = None
    rooms: DecodeRoomRegistry = field(default_factory=DecodeRoomRegistry)
    clock: Callable[[], float] = time.monotonic


def _host_view(ptr: int, nbytes: int) -> memoryview:
    """A writable byte view of `nbytes` of host memory at `ptr` (an aux buffer SGLang owns and
    keeps for the process's life); nothing is read or written until it is used."""
    return memoryview((ctypes.c_ubyte * nbytes).from_address(ptr)).cast("B")


class DecodeService:
    def __init__(self, parts: DecodeParts, reject: Callable[[protocol.ProtocolError, str], None]):
        self.p = parts
        self.reject = reject
        self.effects = DecodeEffects(parts)  # every write to SGLang's room tables
        # (bytes view, item length, buffer length) of each aux buffer, made once, not per Success:
        # a Success's aux item is one slice assignment into the view (a ctypes.memmove call cost
        # about 1 us more per item)
        self._aux_slots = [(_host_view(ptr, buf_len), item_len, buf_len)
                           for ptr, item_len, buf_len in zip(parts.aux.ptrs, parts.aux.item_lens, parts.aux.buffer_lens)]
        self.deadline_s = parts.config.transfer_timeout_ms / 1000.0 + DEADLINE_GRACE_S
        self.stopped = threading.Event()
        self.thread: Optional[threading.Thread] = None
        # Statuses naming a receiver attempt that is not the room's current one (counted, dropped).
        self.stale_statuses = 0
        # prefill's messages: read by the status thread, and by SGLang's scheduler when it polls a
        # room not concluded yet (poll_inbox; inbox.py says why)
        # While SGLang polls (it polls every room until it concludes, and the poll reads every
        # message), the status thread stays off the socket for its deadline sweep's interval.
        # SGLANG_MORI_DECODE_ARRIVAL_FLAG: `thread`, it waits in poll(2) on the socket and SGLang's
        # look at an empty socket reads a flag (arrival_flag.py); `process`, a child process waits
        # and the look reads its byte (arrival_watcher.py).
        self.inbox = (Inbox(parts.control_socket, self.handle, "decode status socket",
                            poller_backoff_s=parts.config.wait_poll_ms / 1000.0,
                            watch_arrivals=getattr(parts.config, "decode_arrival_flag", False))
                      if getattr(parts, "control_socket", None) is not None else None)
        if self.inbox is not None:
            # SGLang's poll calls the inbox's look itself: one Python call less per poll, every
            # step (issue 28, session 22: a call costs 1-4 us on the caches a GPU step leaves cold)
            self.poll_inbox = self.inbox.drain_nowait

    def start(self) -> None:
        if self.inbox is not None:
            self.thread = threading.Thread(target=self._run_status_thread, name="mori-decode-status", daemon=True)
            self.thread.start()

    def stop(self) -> None:
        self.stopped.set()
        if self.inbox is not None:
            self.inbox.close()
        if self.thread is not None:
            self.thread.join(timeout=3)

    # --- messages we send -------------------------------------------------------------------
    def registration(self) -> protocol.Register:
        p = self.p
        return protocol.Register(
            engine_desc=p.engine.packed_desc,
            kv_descs=[d.pack() for d in p.local.kv if d is not None],
            aux_descs=[d.pack() for d in p.local.aux if d is not None],
            state_descs=[[d.pack() if d is not None else None for d in comp] for comp in p.local.state],
            decode_ip=p.identity.ip, decode_port=p.identity.port,
            attn_tp_size=p.identity.attn_tp_size, attn_tp_rank=p.identity.attn_tp_rank,
            dcp_size=p.identity.dcp_size, dcp_rank=p.identity.dcp_rank, cp_all_ranks=p.identity.cp_all_ranks,
            layout=encode_layout(p.layout),
        )

    def record_destination(self, *, bootstrap_room, required_dst_info_num, kv_indices, aux_index, state_indices,
                           decode_prefix_len, is_dummy, device_kv_indices=None) -> protocol.RoomMetadata:
        """The receiver publishes its destination: records the room's aux slot (where a Success's
        aux bytes go; the room opens here if no receiver opened it) and returns the RoomMetadata
        for one prefill rank, under the receiver's attempt id (the same for every rank it tells)."""
        p = self.p
        room_id = int(bootstrap_room)
        aux = None if aux_index is None else int(aux_index)
        r = p.rooms.set_aux_index(room_id, aux)
        return protocol.RoomMetadata(
            room=room_id, attempt=r.attempt, engine_key=p.engine.key, decode_ip=p.identity.ip,
            decode_port=p.identity.port, kv_indices=protocol.encode_page_indices(kv_indices),
            aux_index=aux, state_indices=protocol.encode_state_indices(state_indices),
            required_dst_info_num=int(required_dst_info_num or 1),
            decode_prefix_len=None if decode_prefix_len is None else int(decode_prefix_len),
            is_dummy=bool(is_dummy),
        )

    def abort_message(self, room: int, generation: Optional[int], attempt: Optional[int] = None) -> protocol.Abort:
        """The Abort the receiver sends for `attempt` of `room` (its own; the room's bookkeeping
        may be cleared already). Builds the message only: no room state changes."""
        p = self.p
        if attempt is None:
            attempt = p.rooms.attempt_of(int(room)) or 0
        return protocol.Abort(room=int(room), attempt=attempt, decode_ip=p.identity.ip, decode_port=p.identity.port,
                              generation=generation)

    def new_receiver(self, room: int) -> int:
        """A receiver starts on `room`: returns its new attempt id (the applier opens the room and
        drops what an earlier request with this id left)."""
        return self.effects.new_attempt(int(room))

    def arm_abort(self, room: int) -> int:
        """The receiver of `room` is about to send an abort with deferred release: returns the
        generation its ACKs must carry (the applier arms SGLang's hold of the pages)."""
        return self.effects.arm_abort(int(room))

    def forget(self, room: int, attempt: int) -> None:
        """The receiver of `attempt` was cleared (a newer attempt's room is left alone)."""
        self.p.rooms.forget(int(room), attempt)

    # --- the one failure path (effects.py) ----------------------------------------------------
    def fail(self, room: int, reason: str, label: str, attempt: Optional[int] = None) -> bool:
        """Fail `room` (only while `attempt` is its receiver's, when given) for a cause found on
        this rank (the receiver's duplicate room or unreachable bootstrap server, this thread's
        deadlines and aux checks), through the applier; False if the room was over already."""
        return self.effects.fail(room, reason, label, attempt)

    # --- the status thread ------------------------------------------------------------------
    def _run_status_thread(self) -> None:
        try:
            self._run_status_thread_body()
        finally:
            self.inbox.thread_done()

    def _run_status_thread_body(self) -> None:
        # Wakes for a message at once; idle, every SGLANG_MORI_WAIT_POLL_MS for the deadlines.
        wait_ms = self.p.config.wait_poll_ms
        poll_s = wait_ms / 1000.0
        next_sweep = 0.0
        while not self.stopped.is_set():
            try:
                self.inbox.wait_and_drain(wait_ms)
                # The deadline sweep walks every room: once per poll interval, not per message
                # (two messages per request would make it O(rooms) per message under load).
                now = self.p.clock()
                if now >= next_sweep:
                    next_sweep = now + poll_s
                    self.enforce_deadlines(now)
                    self.p.metrics.set_open_rooms(len(self.p.rooms))
            except zmq.ZMQError:
                if self.stopped.is_set():
                    return
                logger.exception("sglang-mori: decode socket error")
            except Exception:
                logger.exception("sglang-mori: decode status handling failed")

    def poll_inbox(self) -> int:
        """SGLang polls a room not concluded yet: apply what prefill sent (Success with its aux,
        Failed), here, instead of waiting for the status thread to wake and take the GIL
        (inbox.py). What SGLang's poll then reads is the room's newest status. Returns the
        messages applied (0: the room's status is as it was)."""
        return self.inbox.drain_nowait() if self.inbox is not None else 0

    def handle(self, frames, polled: bool = False) -> None:
        """One message from prefill, on the status thread or SGLang's (`polled`: decode's handlers
        send nothing, so it changes nothing here). The inbox logs what a bug raises here."""
        try:
            message = protocol.decode(frames)
        except protocol.ProtocolError as err:
            self.reject(err, "decode status socket")
            return
        kind = type(message)  # (exact types: the protocol's messages have no subclasses)
        if kind is protocol.TransferStarted:
            p = self.p
            p.rooms.transfer_started(message.room, message.attempt, p.clock())
        elif kind is protocol.RoomStatus:
            self.on_status(message)
        elif kind is protocol.AbortAck:
            if self.p.sglang.deferred_release and message.generation is not None:
                self.effects.abort_acked(message.room, message.prefill_rank, message.generation)
        else:
            self.reject(protocol.ProtocolError(protocol.REJECT_MALFORMED, f"{kind.__name__} sent to decode"),
                        "decode status socket")

    def on_status(self, msg: protocol.RoomStatus) -> None:
        p = self.p
        # Under the registry lock from the attempt check to the end: a receiver forgets its attempt
        # under it before SGLang drops the room's status (receiver.before_clear), so the status
        # applied here is the named attempt's, never the room id's next receiver's.
        with p.rooms.lock:
            r = p.rooms.current_held(msg.room, msg.attempt)
            if r is None:
                self._stale(msg)
                return
            before = p.sglang.status(msg.room)
            if before is None:
                return  # concluded and cleared already; a late or replayed status changes nothing
            if msg.status == room_status.FAILED:
                self.effects.prefill_failed(msg.room, msg.prefill_rank, msg.reason)
                return
            if msg.status != room_status.SUCCESS:
                self.reject(protocol.ProtocolError(protocol.REJECT_MALFORMED, f"non-terminal status {msg.status}",
                                                   msg.room), "decode status socket")
                return
            error = self._copy_aux(r.aux_index, msg.aux) if msg.aux and r.aux_index is not None else None
            if error:
                self.fail(msg.room, error, OTHER, msg.attempt)
                return
            self.effects.prefill_succeeded(msg.room, msg.prefill_rank, msg.reason, before)

    def _stale(self, msg: protocol.RoomStatus) -> None:
        """A status for a receiver attempt that is over (cleared, or replaced by a new receiver of
        the room id after a retraction): applying it would conclude a request it is not about."""
        self.stale_statuses += 1
        if self.stale_statuses == 1 or self.stale_statuses % 100 == 0:
            logger.info("sglang-mori: stale status #%d dropped: room %s status %s from prefill rank %s names "
                        "attempt %s, the room's receiver is %s", self.stale_statuses, msg.room, msg.status,
                        msg.prefill_rank, msg.attempt, self.p.rooms.attempt_of(msg.room) or "gone")

    def _copy_aux(self, aux_index: int, items: list) -> Optional[str]:
        """Copy the aux items into the room's aux slot; an error string if they do not fit.

        Items pair with our aux buffers by position; when prefill has more or fewer buffers (an
        optional one enabled on one engine only), the leading ones move, as in SGLang, and the
        mismatch was logged at registration."""
        for data, (view, item_len, buf_len) in zip(items, self._aux_slots):
            offset = aux_index * item_len
            # (a negative slot would index the view from its end: refused like one past it)
            if len(data) != item_len or offset < 0 or offset + item_len > buf_len:
                return AUX_DOES_NOT_FIT.format(size=len(data), slot=aux_index, item_len=item_len, buffer=buf_len)
            view[offset:offset + item_len] = data
        return None

    def enforce_deadlines(self, now: float) -> None:
        for r in self.p.rooms.expired(now, self.deadline_s):
            self.fail(r.room, TRANSFER_DEADLINE.format(room=r.room, deadline_s=self.deadline_s), TIMEOUT, r.attempt)

    def debug_snapshot(self) -> dict:
        return {"decode.rooms": len(self.p.rooms)}
