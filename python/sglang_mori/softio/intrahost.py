"""The intra-host path: softio's counterpart of MORI's XGMI route for engines on one host.

Chosen per peer at first contact, as MORI picks XGMI for a pair on one node: when the peer's
EngineDesc has this engine's node id (MORI_NODE_ID, else the kernel boot id) and both engines
leave SGLANG_MORI_SOFTIO_FORCE_TCP unset (or 0), the lanes to that peer are dialed as intra-host lanes. Each
lane's hello carries the initiator's pid and the address and value of a random token; the target
reads the token back with process_vm_readv and writes it again with process_vm_writev. Only when
both work (same uid and no ptrace restriction, the same pid namespace) does it accept; otherwise
it answers "no" and the peer gets ordinary TCP lanes. Nothing falls back silently after that: an
accepted lane that later fails breaks like any lane.

Who copies, and why. A write moves its bytes straight from the initiator's registered memory into
the target's registered memory in one cross-memory-attach call, with no socket in between. The
call is made by the TARGET's lane thread (process_vm_readv from the initiator), not by the
initiator: the lane's TCP connection carries only small PULL frames naming the source addresses,
and the target lands them in order, exactly where a TCP lane would land the payload. So:

- Landing stays the target's act, as with RDMA, where the target's NIC lands the bytes. A region
  the target deregistered can never be written (the frame is refused and the connection dropped,
  which is how a real QP breaks); an initiator writing with process_vm_writev would instead
  scribble into freed memory of the target.
- The write log stays exact and complete: the target records each write the moment its last byte
  landed, in the same loop as for TCP. With an initiator-side copy the target would only learn of
  a write from a later notice, and a write whose notice was lost (a connection reset between the
  copy and the notice) would have landed unlogged; "no write landed after release" could then no
  longer be checked.
- Once the target resets a connection (kill_peer, kill_engine, shutdown), no further byte from
  that initiator can land, as on TCP.
- Completion is ordered like the TCP path: the target ACKs a signaled frame after the copy (and
  its log record), so a status turns SUCCESS only once every byte is in the target's memory;
  notifications count per lane as on TCP (unlike MORI's XGMI, which has none: softio keeps the
  RDMA API's behaviour and only swaps the wire).
- Frames are a few dozen bytes, so while a lane is idle and no fault is armed the submitting
  thread sends them itself (one thread handoff less per transfer, which is what a loaded host
  charges for); otherwise they queue for the lane's sender thread as on TCP, in order.
- Faults act on the initiator's sender exactly as on TCP lanes (stall, fail lane, SQ full,
  partial post, latency, kill after N frames); a bandwidth cap paces the bytes a frame names and
  cuts frames into 64 KiB pulls so that bytes land gradually.

Large ranges are cut into SPLIT_BYTES frames before they are spread over the lanes (as XGMI
spreads a copy over streams), so that one big entry is copied by several target threads at once
instead of by one; the write log then shows one record per cut.

Reads are the mirror image: PUSH frames, which the target serves with process_vm_writev into the
initiator's memory before it ACKs.
"""

from __future__ import annotations

import threading

from . import wire, xmem
from .enums import PeerFailureReason
from .lanes import _PACE_CHUNK, Lane, PostBatch
from .wire import (FLAG_SIGNALED, HEADER, MAX_PIECES, OP_PULL, OP_PUSH, OP_WRITE, PIECE,
                   ProtocolError)

PATH_INTRA_HOST = "intra-host"
PATH_TCP = "tcp"
SPLIT_BYTES = 4 * 1024 * 1024


class IntraHostLane(Lane):
    """A lane whose frames name the initiator's memory instead of carrying it."""

    def __init__(self, *args):
        # Set before Lane starts the sender thread, which uses them.
        self._send_lock = threading.Lock()
        self._backlog = 0  # batches handed to the sender thread and not yet sent
        self._queued_send = _QueuedSend(self)
        super().__init__(*args)

    def post(self, batch: PostBatch) -> None:
        with self._send_lock:
            if self._backlog == 0 and not self._faults.active:
                self._send_now(batch)
                return
            self._backlog += 1
        super().post(batch)

    def _send_now(self, batch: PostBatch) -> None:
        buffers = self._frame(batch)  # None: the lane is broken and the batch has been failed
        if buffers is None:
            return
        try:
            wire.send_buffers(self.sock, buffers)
        except OSError as exc:
            self.break_lane(f"send failed: {exc}", PeerFailureReason.PEER_UNREACHABLE)

    def _sending(self):
        return self._queued_send

    def _build(self, batch: PostBatch) -> tuple[list, list]:
        op = OP_PULL if batch.op == OP_WRITE else OP_PUSH
        base = batch.local_ptr
        frames = batch.frames
        faults = self._faults
        if faults.active and faults.bandwidth > 0:
            frames = _chunked(frames)
        pack, piece = HEADER.pack, PIECE.pack
        remote_id = batch.remote_id
        buffers = []
        for remote, total, local in frames:
            if type(local) is int:
                buffers.append(pack(op, 0, 1, remote_id, remote, total, 0) + piece(base + local,
                                                                                   total))
            else:
                pieces = b"".join(piece(base + lo, length) for lo, length in local)
                buffers.append(pack(op, 0, len(local), remote_id, remote, total, 0) + pieces)
        if not batch.signaled:
            return buffers, []
        # The last frame carries the signal; its ACK proves every earlier frame of the lane landed.
        tag = self._next_tag()
        last = buffers[-1]
        _, _, count, _, remote, total, _ = HEADER.unpack_from(last)
        buffers[-1] = pack(op, FLAG_SIGNALED, count, remote_id, remote, total, tag) + \
            last[HEADER.size:]
        return buffers, [(tag, None, batch)]

    def _send_paced(self, buffers: list) -> None:
        """Bandwidth cap: each frame waits for the slot of the bytes it makes the target copy."""
        pace = self._faults.pace
        sock = self.sock
        for buf in buffers:
            pace(HEADER.unpack_from(buf)[5])
            sock.sendall(buf)


class _QueuedSend:
    """The sender thread's turn: no inline send may overtake a queued batch."""

    __slots__ = ("_lane",)

    def __init__(self, lane: IntraHostLane):
        self._lane = lane

    def __enter__(self):
        self._lane._send_lock.acquire()

    def __exit__(self, *exc):
        self._lane._backlog -= 1
        self._lane._send_lock.release()
        return False


def _chunked(frames: list) -> list:
    """The same bytes as frames of at most one pacing chunk each, in order."""
    out = []
    for remote, total, local in frames:
        pieces = [(local, total)] if type(local) is int else local
        for lo, length in pieces:
            for done in range(0, length, _PACE_CHUNK):
                step = min(_PACE_CHUNK, length - done)
                out.append((remote, step, lo + done))
                remote += step
        if total == 0:
            out.append((remote, 0, local if type(local) is int else 0))
    return out


def split_large(frames: list) -> list:
    """Cut single-range frames above SPLIT_BYTES into SPLIT_BYTES pieces (same bytes, in order)."""
    if all(total <= SPLIT_BYTES for _, total, _ in frames):
        return frames
    out = []
    for remote, total, local in frames:
        if total <= SPLIT_BYTES or type(local) is not int:
            out.append((remote, total, local))
            continue
        for done in range(0, total, SPLIT_BYTES):
            step = min(SPLIT_BYTES, total - done)
            out.append((remote + done, step, local + done))
    return out


def land(reader, region, op: int, offset: int, size: int, count: int, pid: int) -> None:
    """Target side of PULL/PUSH: read the frame's pieces and copy; ProtocolError if it cannot."""
    if not 1 <= count <= MAX_PIECES:
        raise ProtocolError(f"intra-host frame with {count} pieces")
    raw = bytearray(count * PIECE.size)
    reader.read_into(memoryview(raw))
    pieces = list(PIECE.iter_unpack(raw))
    if sum(length for _, length in pieces) != size:
        raise ProtocolError("intra-host frame pieces do not add up to its size")
    try:
        if op == OP_PULL:
            xmem.pull(pid, region.ptr + offset, pieces)
        else:
            xmem.push(pid, region.ptr + offset, pieces)
    except OSError as exc:
        # The initiator died, or named memory it does not have: drop it like a broken QP.
        raise ProtocolError(f"cross-memory copy with pid {pid} failed: {exc}") from None


def wanted(backend, remote_node_id: str) -> bool:
    """Whether to offer intra-host lanes to a peer (the target still has to accept)."""
    return (not backend.settings.force_tcp and xmem.available()
            and remote_node_id == backend.core.desc.node_id)


def peer_path(engine, remote_key: str) -> str | None:
    """Which path this engine's transfers to `remote_key` use: "intra-host", "tcp", or None when
    it has not contacted that peer yet (for tests and benchmarks)."""
    core = getattr(engine, "_core", engine)
    for backend in core.backends.values():
        peer = backend.peers.contacted(remote_key)
        if peer is not None and peer.lanes:
            return peer.path
    return None
