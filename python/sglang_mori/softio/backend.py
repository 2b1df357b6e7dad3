"""The software "RDMA" backend of an engine: listener, peers, sessions.

Created by `IOEngine.create_backend(BackendType.RDMA, ...)`: it binds the configured host and port
(port 0 picks an ephemeral port that is written back into the engine's descriptor), and from then
on both serves this engine's memory to peers and carries this engine's transfers to them.
"""

from __future__ import annotations

import logging
import os
import threading

from . import cuda_runtime
from .config import RdmaBackendConfig, resolve_lane_settings
from .descriptors import IPC_HANDLE_SIZE
from .device_path import DeviceSession
from .memory import _LocalRegionError
from .descriptors import PeerFailureEvent
from .enums import PeerFailureReason
from .peer_watch import DevicePeerWatch
from .peers import PeerBook
from .remote_mapping import RemoteMapping
from .session import SoftSession
from .target import TargetServer

logger = logging.getLogger("sglang_mori.softio")
_NO_HANDLE = bytes(IPC_HANDLE_SIZE)
SOCKET_BUFFER_ENV = "SGLANG_MORI_SOFTIO_SOCKET_BUFFER"
DEFAULT_SOCKET_BUFFER = 4 * 1024 * 1024
# The most a TCP connection of this engine waits between retransmissions (wire.tune_socket).
RTO_MAX_ENV = "SGLANG_MORI_SOFTIO_RTO_MAX_MS"
DEFAULT_RTO_MAX_MS = 1000
# How long fence_peer waits for a lane's sender to fail the batch it holds (a stalled sender looks
# every 0.2 s); the lane is reset either way, so nothing it holds can be sent.
FENCE_JOIN_S = 5.0


class SoftRdmaBackend:
    def __init__(self, core, host: str, port: int, config: RdmaBackendConfig):
        self.core = core
        self.settings = resolve_lane_settings(config)
        self.chunking = bool(config.enable_transfer_chunking)
        self.socket_buffer = int(os.environ.get(SOCKET_BUFFER_ENV, DEFAULT_SOCKET_BUFFER))
        self.rto_max_ms = int(os.environ.get(RTO_MAX_ENV, DEFAULT_RTO_MAX_MS))
        self.closing = False
        self.dead: str | None = None
        self.peers = PeerBook(self)
        self.device_watch = DevicePeerWatch(self)
        self._sessions: dict = {}
        self._sessions_lock = threading.Lock()
        # Bumped whenever a cached session is dropped or released: routes resolved from the
        # sessions (device_routes.py) are stale from then on.
        self.sessions_generation = 0
        self.server = TargetServer(core, host, port, self.socket_buffer, self.rto_max_ms,
                                   self.settings.cp_timeout_s,
                                   accept_intra_host=not self.settings.force_tcp)
        self.port = self.server.port

    # ---- routing -------------------------------------------------------------------------------
    def can_handle(self, remote_desc) -> bool:
        return self.peers.is_registered(remote_desc._engine_key)

    def session(self, local_desc, remote_desc) -> SoftSession:
        """The cached session for a pair; on first use dials the peer and fetches the region.

        Raises RuntimeError when the peer cannot be reached or the remote region is not
        registered there with the size the descriptor claims.
        """
        key = (remote_desc._engine_key, local_desc._id, remote_desc._id)
        sess = self._sessions.get(key)
        if sess is not None:
            return sess
        if self.dead is not None:
            raise RuntimeError(f"softio engine {self.core.key} is down: {self.dead}")
        try:
            local = self.core.memory.require(local_desc)
        except _LocalRegionError as exc:
            raise RuntimeError(str(exc)) from None
        peer = self.peers.peer(remote_desc._engine_key)
        remote_on_device = remote_desc._ipc_handle != _NO_HANDLE
        if local.device is not None or remote_on_device:
            return self._keep(key, self._device_session(peer, local, remote_desc, remote_on_device))
        peer.ensure_lanes()
        size = _remote_size(peer, remote_desc)
        return self._keep(key, SoftSession(self, peer, local, remote_desc._id, size))

    def _keep(self, key: tuple, sess):
        """Cache a new session, unless another thread cached one first or, while it was built, the
        peer was deregistered or the engine shut down: then it is dropped (its mapping closed)."""
        with self._sessions_lock:
            gone = self.dead or (None if self.peers.is_registered(key[0]) else f"engine {key[0]} was deregistered")
            kept = None if gone else self._sessions.setdefault(key, sess)
        if kept is not sess:
            _release([sess])
        if gone:
            raise RuntimeError(f"softio: no session to {key[0]}: {gone}")
        return kept

    def _device_session(self, peer, local, remote_desc, remote_on_device: bool) -> DeviceSession:
        """A pair of device regions: the remote registration is checked over the control plane
        (as for host memory), then the peer's IPC handle is opened once in this process."""
        if local.device is None or not remote_on_device:
            side = "local" if local.device is None else "remote"
            raise RuntimeError(
                f"softio: a transfer between host and device memory is not supported (the {side} region of "
                f"engine {remote_desc._engine_key if side == 'remote' else self.core.key} is host memory)")
        if peer.broken is not None:
            # As for lanes, a peer seen to fail is not served again: a restart brings a new key.
            raise RuntimeError(f"softio: engine {peer.key} is down: {peer.broken}")
        size = _remote_size(peer, remote_desc)
        self.device_watch.watch(peer)  # no lane tells of its end: its control connection does
        runtime = cuda_runtime.load()
        engine = self.core.device_engine(local.device)
        handle = remote_desc._ipc_handle
        base = runtime.open(handle, local.device)  # one hold on the mapping, given back by release()
        mapping = RemoteMapping(runtime, handle, local.device,
                                f"memory {remote_desc._id} of engine {remote_desc._engine_key}")
        remote_device = runtime.device_of(base)  # in this process's numbering, wherever it was registered
        return DeviceSession(self, engine, local, base + remote_desc._ipc_offset, size,
                             to_peer=remote_device is not None and remote_device != local.device, mapping=mapping)

    def forget_memory(self, mem_id: int) -> None:
        """Drop cached sessions that use a deregistered local region (as MORI does)."""
        self._drop_sessions(lambda k, s: k[1] == mem_id or k[2] == mem_id)

    def forget_peer(self, remote_key: str) -> None:
        """Drop the sessions to a deregistered engine: its mapped memory is unmapped once the copies
        into it are done, so a dead or replaced peer's pool does not stay allocated on its GPU."""
        self._drop_sessions(lambda k, s: k[0] == remote_key)

    def device_peer_gone(self, peer, reason: str) -> None:
        """The control connection of a peer reached only through device memory ended (peer_watch.py):
        report it like a broken lane and unmap its memory once the copies in flight are done."""
        first = peer.broken is None
        peer.abort(reason, report=False)
        if first and not self.closing:
            logger.warning("softio %s: device peer %s is gone: %s", self.core.key, peer.key, reason)
            self.core.peer_failures.append(PeerFailureEvent(
                peer.key, PeerFailureReason.PEER_UNREACHABLE, 0, peer.port, "softio", reason))
        self._release_sessions(lambda k, s: k[0] == peer.key)

    def _release_sessions(self, which) -> None:
        """Unmap the memory of the chosen device sessions but keep them cached, so that a later
        transfer on the pair fails with a status (as on a broken lane) instead of raising."""
        with self._sessions_lock:
            chosen = [s for k, s in self._sessions.items() if which(k, s)]
            self.sessions_generation += 1
        _release(chosen)

    def _drop_sessions(self, which) -> None:
        with self._sessions_lock:
            dropped = [self._sessions.pop(k) for k, s in list(self._sessions.items()) if which(k, s)]
            self.sessions_generation += 1
        _release(dropped)

    def fence_peer(self, remote_key: str, reason: str) -> bool:
        """Stop every write to `remote_key` that has not landed yet, for good: its connections are
        reset (a post-batch queued, held or half sent fails with ERR_RDMA_OP; RST drops what the
        kernel still held, and the target reads nothing more of it), and the peer is forgotten, so
        the next transfer dials fresh lanes. The counterpart of moving the peer's QPs to the error
        state, which flushes their work requests, and rebuilding them (MORI-IO has no call for it).
        No peer failure is reported: the peer is not at fault. Bytes the target had already read
        off its socket still land, within its copy time (like packets already on the fabric).
        Returns once the lanes' senders have ended, so every write posted before has failed; True.
        False, and nothing is done, for a peer reached through device memory: a copy queued on a
        GPU stream cannot be withdrawn."""
        with self._sessions_lock:
            device = any(k[0] == remote_key and isinstance(s, DeviceSession) for k, s in self._sessions.items())
        if device:
            return False
        self._drop_sessions(lambda k, s: k[0] == remote_key)
        peer = self.peers.forget(remote_key)
        if peer is not None:
            peer.abort(f"fenced: {reason}", report=False)
            for lane in list(peer.lanes):
                lane.join_sender(FENCE_JOIN_S)
        return True

    # ---- faults and teardown -------------------------------------------------------------------
    def abort_peer(self, remote_key: str, reason: str) -> None:
        peer = self.peers.contacted(remote_key)
        if peer is not None:
            peer.abort(reason)
        self.server.abort_initiator(remote_key)

    def shutdown(self, reason: str) -> None:
        """Stop serving and reset every connection; no peer-failure events for our own end."""
        self.closing = True
        with self._sessions_lock:
            self.dead = reason
        self.server.close()
        for peer in self.peers.all_peers():
            peer.abort(reason, report=False)
        self.device_watch.stop()
        self._release_sessions(lambda k, s: True)


def _release(sessions: list) -> None:
    for sess in sessions:
        if isinstance(sess, DeviceSession):
            sess.release()


def _remote_size(peer, remote_desc) -> int:
    """The remote region's registered size, asked over the control plane; it must be the size the
    descriptor claims (MORI's CreateSession checks the same)."""
    size = peer.region_size(remote_desc._id)
    if size != remote_desc._size:
        raise RuntimeError(
            f"RdmaBackend::CreateSession: remote MR size mismatch for engine "
            f"{remote_desc._engine_key} memId={remote_desc._id} "
            f"expected={remote_desc._size} got={size}")
    return size
