"""Initiator-side lanes: the softio counterpart of the QPs MORI opens to a peer.

Each lane is one TCP connection with a sender thread (posts frames straight from local memory with
sendmsg) and a receiver thread (ACKs and read responses, received straight into local memory).
Lanes of one peer run in parallel and complete out of order. A post-batch whose last frame is
SIGNALED completes when the target ACKs that frame; because a lane is an ordered stream, that ACK
proves every earlier frame on the lane has landed, exactly like a signaled RDMA work request.

A lane that breaks stays broken (a QP in error state is not rebuilt): everything queued or in
flight on it fails with ERR_RDMA_OP, and the peer is marked degraded.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import queue
import threading
import time

from . import wire
from .enums import PeerFailureReason, StatusCode
from .wire import (FLAG_SIGNALED, HEADER, OP_ACK, OP_NOTIFY, OP_READ, OP_READ_RESP, OP_WRITE,
                   FrameReader, ProtocolError)

logger = logging.getLogger("sglang_mori.softio")

_SUCCESS = StatusCode.SUCCESS
_ERR_RDMA_OP = StatusCode.ERR_RDMA_OP
_PACE_CHUNK = 64 * 1024
_NOTHING_TO_HOLD = contextlib.nullcontext()


class Completion:
    """Outstanding signaled post-batches of one transfer; the status succeeds at zero."""

    __slots__ = ("status", "left", "lock")

    def __init__(self, status, left: int):
        self.status = status
        self.left = left
        self.lock = threading.Lock()

    def done_one(self) -> None:
        with self.lock:
            self.left -= 1
            last = self.left == 0
        if last:
            self.status.Update(_SUCCESS, "")

    def fail(self, message: str) -> None:
        self.status.Update(_ERR_RDMA_OP, message)


class PostBatch:
    """Frames posted together on one lane (the softio form of one ibv_post_send chain)."""

    __slots__ = ("op", "frames", "local_view", "local_ptr", "remote_id", "signaled", "release",
                 "completion", "not_before")

    def __init__(self, op, frames, local_view, remote_id, signaled, release, completion,
                 not_before=0.0, local_ptr=0):
        self.op = op
        self.frames = frames  # [(remote_offset, total, local)] or (uid, lanes) for OP_NOTIFY
        self.local_view = local_view
        self.local_ptr = local_ptr  # address of local_view (intra-host lanes name addresses)
        self.remote_id = remote_id
        self.signaled = signaled
        self.release = release  # SQ slots freed when the signaled frame is ACKed
        self.completion = completion  # None for fences and notifications
        self.not_before = not_before


class Lane:
    def __init__(self, peer, index: int, sock, sq_depth: int, faults):
        self.peer = peer
        self.index = index
        self.sock = sock
        self.sq_depth = sq_depth
        self.sq_used = 0
        self.broken: str | None = None
        self._faults = faults
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._expect: collections.deque = collections.deque()
        self._state = threading.Lock()
        self._sq = threading.Condition()
        self._tag = 0
        name = f"softio-lane{index}-{peer.key[:24]}"
        self._sender = threading.Thread(target=self._send_loop, daemon=True, name=name + "-tx")
        self._receiver = threading.Thread(target=self._recv_loop, daemon=True, name=name + "-rx")
        self._sender.start()
        self._receiver.start()

    # ---- submission side (caller threads) ------------------------------------------------------
    def reserve(self, count: int, backoff_s: float) -> str | None:
        """Take `count` SQ slots, blocking up to the backoff; an error message if that fails."""
        faults = self._faults
        deadline = None
        with self._sq:
            while True:
                if self.broken is not None:
                    return f"EP is degraded, rejecting new submissions ({self.broken})"
                blocked_until = faults.sq_full_until() if faults.active else None
                if blocked_until is None and self.sq_used + count <= self.sq_depth:
                    self.sq_used += count
                    return None
                now = time.monotonic()
                if deadline is None:
                    if blocked_until is not None and faults.sq_backoff_override_s is not None:
                        backoff_s = faults.sq_backoff_override_s
                    deadline = now + backoff_s
                if now >= deadline:
                    used = self.sq_depth if blocked_until is not None else self.sq_used
                    return (f"SQ full (batch): ep={self.index} depth={used} requested={count} "
                            f"max={self.sq_depth} after {int(backoff_s * 1e6)} us")
                wait = deadline - now
                if blocked_until is not None:
                    wait = min(wait, max(blocked_until - now, 0.001))
                self._sq.wait(wait)

    def _release(self, count: int) -> None:
        if count:
            with self._sq:
                self.sq_used -= count
                self._sq.notify_all()

    def post(self, batch: PostBatch) -> None:
        with self._state:
            if self.broken is None:
                self._queue.put(batch)
                return
            reason = self.broken
        if batch.completion is not None:
            batch.completion.fail(f"lane {self.index} to {self.peer.key} is broken: {reason}")

    # ---- failure -------------------------------------------------------------------------------
    def break_lane(self, reason: str, failure: PeerFailureReason, batch: PostBatch | None = None,
                   report: bool = True) -> None:
        with self._state:
            first = self.broken is None
            if first:
                self.broken = reason
            pending = []
            while True:
                try:
                    pending.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            pending.extend(e[2] for e in self._expect)
            self._expect.clear()
        if batch is not None:
            pending.append(batch)
        # Wake the sender so it exits, on every call: the drain above may have taken the sentinel
        # an earlier call left (the receiver breaking the lane again after shutdown did), and a
        # sender left waiting on an empty queue lives, with its network namespace, as long as the
        # process. Extra sentinels are never read: the sender returns at the first.
        self._queue.put(None)
        if first:
            wire.abort_socket(self.sock)
            with self._sq:
                self._sq.notify_all()
        message = f"lane {self.index} to {self.peer.key} failed: {reason}"
        for item in pending:
            if item is not None and item.completion is not None:
                item.completion.fail(message)
        if first:
            self.peer.lane_broken(self, reason, failure, report)

    def join_sender(self, timeout_s: float) -> None:
        """Wait for a broken lane's sender thread to end: by then it has failed the batch it held
        (a stalled or paced one) as well as the queued ones."""
        if self._sender is not threading.current_thread():
            self._sender.join(timeout_s)

    # ---- sender thread -------------------------------------------------------------------------
    def _send_loop(self) -> None:
        faults = self._faults
        peer_key = self.peer.key
        while True:
            batch = self._queue.get()
            if batch is None or self.broken is not None:
                if batch is not None and batch.completion is not None:
                    batch.completion.fail(f"lane {self.index} to {peer_key} is broken: "
                                          f"{self.broken}")
                if batch is None:
                    return
                continue
            if faults.active:
                faults.wait_while_stalled(peer_key, self.index, lambda: self.broken is not None)
                if faults.take_lane_failure(peer_key, self.index):
                    self.break_lane("injected lane failure (fault injection: fail_lane)",
                                    PeerFailureReason.LOCAL_QP_ERROR, batch)
                    return
                if batch.op != OP_NOTIFY:
                    dying = faults.kill_budget(len(batch.frames))
                    if dying is not None:
                        self._die_after(batch, dying)
                        return
            if batch.not_before:
                delay = batch.not_before - time.monotonic()
                if delay > 0:
                    time.sleep(delay)  # simulated wire latency (fault injection)
            try:
                with self._sending():
                    buffers = self._frame(batch)
                    if buffers is None:
                        continue  # the lane broke while framing; the batch has been failed
                    if faults.active and faults.bandwidth > 0:
                        self._send_paced(buffers)
                    else:
                        wire.send_buffers(self.sock, buffers)
            except OSError as exc:
                self.break_lane(f"send failed: {exc}", PeerFailureReason.PEER_UNREACHABLE)
                return

    def _sending(self):
        """Held while the sender thread frames and sends one queued batch (a lane that also
        sends from the submitting thread orders the two with it)."""
        return _NOTHING_TO_HOLD

    def _die_after(self, batch: PostBatch, frames: int) -> None:
        """kill_engine_after: send only the first `frames` frames of the batch, then die."""
        if frames:
            head = PostBatch(batch.op, batch.frames[:frames], batch.local_view, batch.remote_id,
                             False, 0, None, local_ptr=batch.local_ptr)
            buffers = self._frame(head)
            try:
                if buffers is not None:
                    wire.send_buffers(self.sock, buffers)
            except OSError:
                pass
        reason = "fault injection: kill_engine_after"
        self.break_lane(reason, PeerFailureReason.LOCAL_DEVICE_FATAL, batch, report=False)
        self.peer.backend.core.abort_all(reason)

    def _frame(self, batch: PostBatch) -> list | None:
        """Buffers to send for a batch, after registering what the receiver must expect; None
        (and the batch failed) when the lane broke meanwhile."""
        if batch.op == OP_NOTIFY:
            uid, lanes = batch.frames
            return [HEADER.pack(OP_NOTIFY, 0, 0, self.index, uid, lanes, 0)]
        buffers, expect = self._build(batch)
        with self._state:
            if self.broken is not None:
                reason = self.broken
            else:
                self._expect.extend(expect)
                return buffers
        if batch.completion is not None:
            batch.completion.fail(f"lane {self.index} to {self.peer.key} is broken: {reason}")
        return None

    def _next_tag(self) -> int:
        self._tag += 1
        return self._tag

    def _build(self, batch: PostBatch) -> tuple[list, list]:
        """TCP framing: (header and payload buffers, [(tag, read destination, batch)])."""
        pack = HEADER.pack
        op = batch.op
        view = batch.local_view
        remote_id = batch.remote_id
        frames = batch.frames
        buffers = []
        append = buffers.append
        expect = []
        if op == OP_WRITE:
            header_at = 0
            for remote, total, local in frames:
                header_at = len(buffers)
                append(pack(OP_WRITE, 0, 0, remote_id, remote, total, 0))
                if type(local) is int:
                    if total:
                        append(view[local:local + total])
                else:
                    for lo, length in local:
                        append(view[lo:lo + length])
            if batch.signaled:
                # Re-issue the last frame's header with the signal: its ACK completes the batch.
                tag = self._next_tag()
                remote, total, _ = frames[-1]
                buffers[header_at] = pack(OP_WRITE, FLAG_SIGNALED, 0, remote_id, remote,
                                          total, tag)
                expect.append((tag, None, batch))
        else:  # OP_READ: every frame is answered; only the last of a signaled batch completes it
            last = len(frames) - 1
            for k, (remote, total, local) in enumerate(frames):
                tag = self._next_tag()
                done = batch if (k == last and batch.signaled) else None
                expect.append((tag, (total, local, view), done))
                append(pack(OP_READ, 0, 0, remote_id, remote, total, tag))
        return buffers, expect

    def _send_paced(self, buffers: list) -> None:
        pace = self._faults.pace
        sock = self.sock
        for buf in buffers:
            view = memoryview(buf)
            for start in range(0, max(len(view), 1), _PACE_CHUNK):
                piece = view[start:start + _PACE_CHUNK]
                pace(len(piece))
                sock.sendall(piece)

    # ---- receiver thread -----------------------------------------------------------------------
    def _recv_loop(self) -> None:
        reader = FrameReader(self.sock, staging_bytes=256 * 1024)
        expect = self._expect
        try:
            while True:
                op, _, _, _, _, size, tag = reader.read_header()
                try:
                    want_tag, read_dest, batch = expect.popleft()
                except IndexError:
                    raise ProtocolError(f"unexpected frame op {op} tag {tag}") from None
                if tag != want_tag:
                    raise ProtocolError(f"reply for tag {tag}, expected {want_tag}")
                if op == OP_READ_RESP:
                    total, local, view = read_dest
                    if size != total:
                        raise ProtocolError(f"read response of {size} bytes, expected {total}")
                    if type(local) is int:
                        if total:
                            reader.read_into(view[local:local + total])
                    else:
                        for lo, length in local:
                            reader.read_into(view[lo:lo + length])
                elif op != OP_ACK:
                    raise ProtocolError(f"unknown reply op {op}")
                if batch is not None:
                    self._release(batch.release)
                    if batch.completion is not None:
                        batch.completion.done_one()
        except EOFError:
            self.break_lane("connection closed by peer (peer unreachable)",
                            PeerFailureReason.PEER_UNREACHABLE)
        except ProtocolError as exc:
            logger.warning("softio: lane %d to %s: protocol error: %s", self.index,
                           self.peer.key, exc)
            self.break_lane(f"protocol error: {exc}", PeerFailureReason.UNKNOWN)
        except OSError as exc:
            self.break_lane(f"receive failed: {exc}", PeerFailureReason.PEER_UNREACHABLE)
