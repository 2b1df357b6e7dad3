"""The software "RDMA" backend of an engine: listener, peers, sessions.

Created by `IOEngine.create_backend(BackendType.RDMA, ...)`: it binds the configured host and port
(port 0 picks an ephemeral port that is written back into the engine's descriptor), and from then
on both serves this engine's memory to peers and carries this engine's transfers to them.
"""

from __future__ import annotations

import os
import threading

from . import cuda_runtime
from .config import RdmaBackendConfig, resolve_lane_settings
from .descriptors import IPC_HANDLE_SIZE
from .device_path import DeviceSession
from .memory import _LocalRegionError
from .peers import PeerBook
from .session import SoftSession
from .target import TargetServer

_NO_HANDLE = bytes(IPC_HANDLE_SIZE)
SOCKET_BUFFER_ENV = "SGLANG_MORI_SOFTIO_SOCKET_BUFFER"
DEFAULT_SOCKET_BUFFER = 4 * 1024 * 1024
# The most a TCP connection of this engine waits between retransmissions (wire.tune_socket).
RTO_MAX_ENV = "SGLANG_MORI_SOFTIO_RTO_MAX_MS"
DEFAULT_RTO_MAX_MS = 1000


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
        self._sessions: dict = {}
        self._sessions_lock = threading.Lock()
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
            sess = self._device_session(peer, local, remote_desc, remote_on_device)
            with self._sessions_lock:
                return self._sessions.setdefault(key, sess)
        peer.ensure_lanes()
        size = _remote_size(peer, remote_desc)
        sess = SoftSession(self, peer, local, remote_desc._id, size)
        with self._sessions_lock:
            return self._sessions.setdefault(key, sess)

    def _device_session(self, peer, local, remote_desc, remote_on_device: bool) -> DeviceSession:
        """A pair of device regions: the remote registration is checked over the control plane
        (as for host memory), then the peer's IPC handle is opened once in this process."""
        if local.device is None or not remote_on_device:
            side = "local" if local.device is None else "remote"
            raise RuntimeError(
                f"softio: a transfer between host and device memory is not supported (the {side} region of "
                f"engine {remote_desc._engine_key if side == 'remote' else self.core.key} is host memory)")
        size = _remote_size(peer, remote_desc)
        runtime = cuda_runtime.load()
        base = runtime.open(remote_desc._ipc_handle, local.device)
        remote_device = runtime.device_of(base)  # in this process's numbering, wherever it was registered
        return DeviceSession(self, self.core.device_engine(local.device), local, base + remote_desc._ipc_offset, size,
                             to_peer=remote_device is not None and remote_device != local.device)

    def forget_memory(self, mem_id: int) -> None:
        """Drop cached sessions that use a deregistered local region (as MORI does)."""
        with self._sessions_lock:
            for key in [k for k in self._sessions if k[1] == mem_id or k[2] == mem_id]:
                del self._sessions[key]

    # ---- faults and teardown -------------------------------------------------------------------
    def abort_peer(self, remote_key: str, reason: str) -> None:
        peer = self.peers.contacted(remote_key)
        if peer is not None:
            peer.abort(reason)
        self.server.abort_initiator(remote_key)

    def shutdown(self, reason: str) -> None:
        """Stop serving and reset every connection; no peer-failure events for our own end."""
        self.closing = True
        self.dead = reason
        self.server.close()
        for peer in self.peers.all_peers():
            peer.abort(reason, report=False)


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
