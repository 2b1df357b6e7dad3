"""Decode side: register our buffers with prefill ranks, publish room destinations, apply statuses.

One thread reads the manager's ZMQ socket: RoomStatus (Success carries the aux bytes, copied here
before Success is recorded), TransferStarted (starts the room's transfer deadline) and AbortAck.
The same thread enforces that deadline (restarted by every chunk's TransferStarted), so a prefill
that dies mid-transfer fails its rooms within SGLANG_MORI_TRANSFER_TIMEOUT_MS plus a grace, not after
SGLang's 300 s waiting timeout.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np
import zmq
from sglang.srt.disaggregation.base.conn import KVPoll

from sglang_mori import protocol
from sglang_mori.backend.plans import encode_layout

logger = logging.getLogger(__name__)

# Margin over the prefill's own per-chunk deadline, so prefill reports a timeout with its reason
# before decode gives up on its own.
DEADLINE_GRACE_S = 5.0


@dataclass
class DecodeRoom:
    aux_index: Optional[int]
    started_at: Optional[float] = None  # latest TransferStarted (one per chunk) from any prefill rank


class DecodeService:
    def __init__(self, mgr):
        self.mgr = mgr
        self.cfg = mgr.mori_config
        self.rooms: dict[int, DecodeRoom] = {}
        self.rooms_lock = threading.Lock()
        self.thread: Optional[threading.Thread] = None
        self.deadline_s = self.cfg.transfer_timeout_ms / 1000.0 + DEADLINE_GRACE_S

    def start(self) -> None:
        self.thread = threading.Thread(target=self._loop, name="mori-decode-status", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        if self.thread is not None:
            self.thread.join(timeout=3)

    # --- messages we send ---------------------------------------------------------------
    def registration_message(self) -> list:
        mgr = self.mgr
        return protocol.encode(
            protocol.Register(
                engine_desc=mgr.engine.packed_desc,
                kv_descs=[d.pack() for d in mgr.kv_descs if d is not None],
                aux_descs=[d.pack() for d in mgr.aux_descs if d is not None],
                state_descs=[[d.pack() if d is not None else None for d in comp] for comp in mgr.state_descs],
                decode_ip=mgr.local_ip,
                decode_port=mgr.rank_port,
                attn_tp_size=mgr.attn_tp_size,
                attn_tp_rank=mgr.attn_tp_rank,
                layout=encode_layout(mgr.layout),
            )
        )

    def metadata_message(self, *, bootstrap_room, required_dst_info_num, kv_indices, aux_index,
                         state_indices, decode_prefix_len, is_dummy, device_kv_indices=None) -> list:
        mgr = self.mgr
        with self.rooms_lock:
            self.rooms[int(bootstrap_room)] = DecodeRoom(aux_index=aux_index)
        states = None
        if state_indices is not None:
            states = [None if comp is None else np.asarray(comp).astype(np.int64).tolist() for comp in state_indices]
        return protocol.encode(
            protocol.RoomMetadata(
                room=int(bootstrap_room),
                engine_key=mgr.engine.key,
                decode_ip=mgr.local_ip,
                decode_port=mgr.rank_port,
                kv_indices=np.asarray(kv_indices, dtype="<i4").tobytes(),
                aux_index=None if aux_index is None else int(aux_index),
                state_indices=states,
                required_dst_info_num=int(required_dst_info_num or 1),
                decode_prefix_len=None if decode_prefix_len is None else int(decode_prefix_len),
                is_dummy=bool(is_dummy),
            )
        )

    def abort_message(self, room: int, generation: Optional[int]) -> list:
        mgr = self.mgr
        return protocol.encode(
            protocol.Abort(room=int(room), decode_ip=mgr.local_ip, decode_port=mgr.rank_port, generation=generation)
        )

    def forget(self, room: int) -> None:
        with self.rooms_lock:
            self.rooms.pop(room, None)

    # --- the status thread --------------------------------------------------------------
    def _loop(self) -> None:
        sock = self.mgr.server_socket
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        while not self.mgr._stopped:
            try:
                if poller.poll(100):
                    self._dispatch(sock.recv_multipart())
                self._enforce_deadlines(time.monotonic())
            except zmq.ZMQError:
                if self.mgr._stopped:
                    return
                logger.exception("sglang-mori: decode socket error")
            except Exception:
                logger.exception("sglang-mori: decode status handling failed")

    def _dispatch(self, frames) -> None:
        mgr = self.mgr
        try:
            message = protocol.decode(frames)
        except protocol.ProtocolError as err:
            mgr.reject_message(err, "decode status socket")
            return
        if isinstance(message, protocol.RoomStatus):
            self._on_status(message)
        elif isinstance(message, protocol.TransferStarted):
            with self.rooms_lock:
                room = self.rooms.get(message.room)
                if room is not None:
                    room.started_at = time.monotonic()  # progress: restart the deadline
        elif isinstance(message, protocol.AbortAck):
            if mgr.enable_deferred_decode_kv_release and message.generation is not None:
                mgr.note_abort_ack(message.room, message.prefill_rank, message.generation)
        else:
            mgr.reject_message(
                protocol.ProtocolError(protocol.REJECT_MALFORMED, f"{type(message).__name__} sent to decode"),
                "decode status socket",
            )

    def _on_status(self, msg: protocol.RoomStatus) -> None:
        mgr = self.mgr
        if msg.room not in mgr.request_status:
            return  # concluded and cleared already; a late or replayed status changes nothing
        if msg.status == int(KVPoll.Success):
            error = self._copy_aux(msg)
            if error:
                mgr.record_failure(msg.room, error)
                mgr.update_status(msg.room, KVPoll.Failed)
                mgr.metrics.request_finished(ok=False, reason="other")
                return
        elif msg.status != int(KVPoll.Failed):
            mgr.reject_message(
                protocol.ProtocolError(protocol.REJECT_MALFORMED, f"non-terminal status {msg.status}", msg.room),
                "decode status socket",
            )
            return
        before = mgr.request_status.get(msg.room)
        mgr.apply_prefill_status(
            bootstrap_room=msg.room, status=msg.status, prefill_rank=msg.prefill_rank, failure_reason=msg.reason
        )
        # Count the room once, when this message made it terminal (with several prefill ranks,
        # the last Success does; a Failed from any rank does).
        after = mgr.request_status.get(msg.room)
        if after != before and after in (KVPoll.Success, KVPoll.Failed):
            mgr.metrics.request_finished(ok=after == KVPoll.Success, reason=None if after == KVPoll.Success else "other")

    def _copy_aux(self, msg: protocol.RoomStatus) -> Optional[str]:
        """Copy the aux items into this room's aux slot; an error string if they do not fit.

        Items pair with our aux buffers by position; when prefill has more or fewer buffers (an
        optional one enabled on one engine only), the leading ones move, as in SGLang, and the
        mismatch was logged at registration.
        """
        with self.rooms_lock:
            room = self.rooms.get(msg.room)
        if room is None or room.aux_index is None or not msg.aux:
            return None
        args = self.mgr.kv_args
        for data, ptr, item_len, buf_len in zip(msg.aux, args.aux_data_ptrs, args.aux_item_lens, args.aux_data_lens):
            offset = room.aux_index * item_len
            if len(data) != item_len or offset + item_len > buf_len:
                return (f"aux item of {len(data)} bytes for slot {room.aux_index} does not fit "
                        f"(item_len {item_len}, buffer {buf_len} bytes)")
            ctypes.memmove(ptr + offset, data, item_len)
        return None

    def _enforce_deadlines(self, now: float) -> None:
        mgr = self.mgr
        expired = []
        with self.rooms_lock:
            for room_id, room in self.rooms.items():
                if room.started_at is not None and now - room.started_at > self.deadline_s:
                    expired.append(room_id)
            for room_id in expired:
                self.rooms[room_id].started_at = None  # report once
        for room_id in expired:
            status = mgr.request_status.get(room_id)
            if status is None or status in (KVPoll.Success, KVPoll.Failed):
                continue
            reason = (f"KV transfer for room {room_id} not complete {self.deadline_s:.1f} s after it started "
                      "(SGLANG_MORI_TRANSFER_TIMEOUT_MS + grace); the prefill may be dead")
            logger.warning("sglang-mori: %s", reason)
            mgr.record_failure(room_id, reason)
            mgr.update_status(room_id, KVPoll.Failed)
            mgr.metrics.failure("timeout")
            mgr.metrics.request_finished(ok=False)
