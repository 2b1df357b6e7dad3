"""Remote engines: the address book, and the connections built to each peer on first contact.

`register_remote_engine` only records where a peer lives. The first transfer (or create_session)
to that peer dials it: a control connection (used to look up remote regions, like MORI's TCP
control plane fetching an MR) and one lane per `qp_per_transfer`: intra-host lanes when the peer
is on this host and accepts them (intrahost.py), TCP lanes otherwise. Any failure there raises
RuntimeError, as MORI does. Connections outlive deregistration of the peer (MORI does not destroy
QPs either) and are never rebuilt once broken.
"""

from __future__ import annotations

import logging
import socket
import threading

from . import intrahost, wire, xmem
from .descriptors import EngineDesc, PeerFailureEvent
from .enums import PeerFailureReason
from .lanes import Lane
from .wire import HEADER, OP_ASK_MR, OP_MR_INFO

logger = logging.getLogger("sglang_mori.softio")


class RemotePeer:
    def __init__(self, backend, key: str, host: str, port: int, node_id: str = ""):
        self.backend = backend
        self.key = key
        self.host = host
        self.port = port
        self.node_id = node_id
        self.path: str | None = None  # intrahost.PATH_INTRA_HOST or PATH_TCP once dialed
        self.shape_frames = None  # how this peer's lanes want a transfer's frames cut, if at all
        self.lanes: list[Lane] = []
        self.broken: str | None = None
        self._build_lock = threading.Lock()
        self._control: socket.socket | None = None
        self._control_lock = threading.Lock()
        self._region_sizes: dict[int, int] = {}

    # ---- first contact -------------------------------------------------------------------------
    def ensure_lanes(self) -> None:
        if self.lanes:
            return
        with self._build_lock:
            if self.lanes:
                return
            intra = intrahost.wanted(self.backend, self.node_id)
            socks = self._dial_lanes(wire.KIND_INTRA_LANE if intra else wire.KIND_LANE)
            if socks is None:  # the target cannot reach our memory: TCP lanes for this peer
                intra = False
                socks = self._dial_lanes(wire.KIND_LANE)
            lane_type = intrahost.IntraHostLane if intra else Lane
            self.path = intrahost.PATH_INTRA_HOST if intra else intrahost.PATH_TCP
            self.shape_frames = intrahost.split_large if intra else None
            depth, faults = self.backend.settings.sq_depth, self.backend.core.faults
            self.lanes = [lane_type(self, i, s, depth, faults) for i, s in enumerate(socks)]

    def _dial_lanes(self, kind: int) -> list | None:
        """One connection per lane; None when the target refused intra-host lanes."""
        socks = []
        try:
            for index in range(self.backend.settings.lanes):
                sock = self._dial(kind, index)
                if sock is None:
                    for done in socks:
                        wire.abort_socket(done)
                    return None
                socks.append(sock)
        except BaseException:
            for sock in socks:
                wire.abort_socket(sock)
            raise
        return socks

    def _dial(self, kind: int, lane: int) -> socket.socket | None:
        settings = self.backend.settings
        where = f"{self.host}:{self.port}"
        try:
            sock = socket.create_connection((self.host, self.port), timeout=settings.cp_timeout_s)
        except socket.timeout:
            raise RuntimeError(f"connect({where}): timed out (MORI_IO_CP_TIMEOUT_MS)") from None
        except OSError as exc:
            raise RuntimeError(f"connect({where}): {exc.strerror or exc}") from None
        try:
            own = self.backend.core.key.encode()
            target = self.key.encode()
            hello = wire.HELLO.pack(wire.MAGIC, kind, lane & 0xFF, 0, len(own), len(target))
            if kind == wire.KIND_INTRA_LANE:
                target += wire.INTRA_HELLO.pack(*xmem.identity())
            sock.sendall(hello + own + target)
            magic, status, key_len = wire.HELLO_REPLY.unpack(
                wire.recv_exact(sock, wire.HELLO_REPLY.size))
            if magic != wire.MAGIC or key_len > wire.MAX_KEY_BYTES:
                raise RuntimeError(f"{where} is not a softio engine")
            actual = wire.recv_exact(sock, key_len).decode(errors="replace")
            if status == wire.HELLO_NO_INTRA and kind == wire.KIND_INTRA_LANE:
                sock.close()
                return None
            if status != wire.HELLO_OK:
                raise RuntimeError(f"{where} is engine {actual!r}, not {self.key!r}")
        except socket.timeout:
            wire.abort_socket(sock)
            raise RuntimeError(f"control plane timeout talking to {where} "
                               f"(MORI_IO_CP_TIMEOUT_MS)") from None
        except (OSError, EOFError) as exc:
            wire.abort_socket(sock)
            raise RuntimeError(f"handshake with {where} failed: {exc}") from None
        except RuntimeError:
            wire.abort_socket(sock)
            raise
        if kind != wire.KIND_CONTROL:
            # A lane's receiver waits for ACKs as long as writes are outstanding (a stalled lane
            # is the engine's deadline to judge, not a socket timeout); only control calls time out.
            sock.settimeout(None)
        wire.tune_socket(sock, self.backend.socket_buffer, self.backend.rto_max_ms)
        return sock

    def region_size(self, mem_id: int) -> int:
        """Registered length of the peer's region `mem_id` (0 if it is not registered)."""
        size = self._region_sizes.get(mem_id)
        if size is not None:
            return size
        with self._control_lock:
            for attempt in (0, 1):
                try:
                    if self._control is None:
                        self._control = self._dial(wire.KIND_CONTROL, 0)
                    self._control.sendall(HEADER.pack(OP_ASK_MR, 0, 0, mem_id, 0, 0, 0))
                    op, _, _, region, _, size, found = HEADER.unpack(
                        wire.recv_exact(self._control, HEADER.size))
                    if op != OP_MR_INFO or region != mem_id:
                        raise EOFError("unexpected control reply")
                    break
                except (OSError, EOFError) as exc:
                    if self._control is not None:
                        wire.abort_socket(self._control)
                        self._control = None
                    if attempt or isinstance(exc, socket.timeout):
                        raise RuntimeError(
                            f"AskRemoteMemoryRegion: control plane to {self.key} at "
                            f"{self.host}:{self.port} failed: {exc}") from None
        if found:
            self._region_sizes[mem_id] = size
            return size
        return 0

    # ---- failure -------------------------------------------------------------------------------
    def lane_broken(self, lane: Lane, reason: str, failure: PeerFailureReason,
                    report: bool) -> None:
        first = self.broken is None
        if first:
            self.broken = f"lane {lane.index}: {reason}"
        if first and report and not self.backend.closing:
            logger.warning("softio %s: peer %s failed on lane %d: %s", self.backend.core.key,
                           self.key, lane.index, reason)
            self.backend.core.peer_failures.append(PeerFailureEvent(
                self.key, failure, lane.index, self.port, "softio", reason))

    def abort(self, reason: str, report: bool = True) -> None:
        """Reset every connection to this peer (fault injection or shutdown)."""
        with self._control_lock:
            if self._control is not None:
                wire.abort_socket(self._control)
                self._control = None
        for lane in list(self.lanes):
            lane.break_lane(reason, PeerFailureReason.PEER_UNREACHABLE, report=report)
        if not self.lanes and self.broken is None:
            self.broken = reason


class PeerBook:
    """Registered remote engines (address book) and the peers contacted so far."""

    def __init__(self, backend):
        self._backend = backend
        self._lock = threading.Lock()
        self._addresses: dict[str, tuple[str, int, str]] = {}
        self._peers: dict[str, RemotePeer] = {}

    def register(self, desc: EngineDesc) -> None:
        with self._lock:
            self._addresses[desc.key] = (desc.host, desc.port, desc.node_id)

    def deregister(self, desc: EngineDesc) -> None:
        with self._lock:
            self._addresses.pop(desc.key, None)

    def is_registered(self, key: str) -> bool:
        return key in self._addresses

    def peer(self, key: str) -> RemotePeer:
        """The peer object for a registered key (created, not yet dialed, on first use)."""
        peer = self._peers.get(key)
        if peer is not None:
            return peer
        with self._lock:
            peer = self._peers.get(key)
            if peer is None:
                address = self._addresses.get(key)
                if address is None:
                    raise RuntimeError(f"BuildRdmaConn: remote engine {key} is not registered")
                peer = RemotePeer(self._backend, key, *address)
                self._peers[key] = peer
            return peer

    def forget(self, key: str) -> RemotePeer | None:
        """Drop the connections built to `key` (the address stays): the next contact dials anew."""
        with self._lock:
            return self._peers.pop(key, None)

    def contacted(self, key: str) -> RemotePeer | None:
        return self._peers.get(key)

    def all_peers(self) -> list:
        with self._lock:
            return list(self._peers.values())
