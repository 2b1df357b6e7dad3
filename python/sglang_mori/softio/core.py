"""EngineCore: what MORI's C++ IOEngine does, for the software backend.

It owns the descriptor, the memory pool, the uid counter and the backends, picks the route of each
(local, remote) pair, and runs the engine-level loops with MORI's quirks: `batch_*` stops at the
first pair without a route, leaving the remaining statuses INIT.
"""

from __future__ import annotations

import collections
import functools
import ipaddress
import itertools
import logging
import os
import socket
import threading

from .backend import SoftRdmaBackend
from .config import IOEngineConfig, RdmaBackendConfig
from .descriptors import EngineDesc, MemoryDesc
from .device_path import DeviceBatch, DeviceSession
from .device_routes import DeviceRoutes
from .enums import BackendType, StatusCode
from .faults import FaultPlan, apply_env_faults
from .memory import LocalMemory
from .notifications import InboundNotifications
from .status import TransferStatus, wait_all
from .write_log import WriteLog

logger = logging.getLogger("sglang_mori.softio")

ALLOW_WILDCARD_ENV = "SGLANG_MORI_SOFTIO_ALLOW_WILDCARD"
DEFAULT_HOST = "127.0.0.1"
_NO_BACKEND = "No available backend found, create backend first"
_UID_MASK = (1 << 64) - 1


def _node_id(hostname: str) -> str:
    node = os.environ.get("MORI_NODE_ID", "").strip()
    if node:
        return node
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or hostname
    except OSError:
        return hostname


def _check_host(host: str) -> None:
    """MORI dials descriptors with inet_addr(): only IPv4 literals work; 0.0.0.0 is a trap."""
    try:
        addr = ipaddress.IPv4Address(host)
    except ValueError:
        raise RuntimeError(f"softio: host {host!r} is not an IPv4 address literal") from None
    if addr.is_unspecified and os.environ.get(ALLOW_WILDCARD_ENV, "") != "1":
        raise RuntimeError(
            f"softio: refusing to bind the wildcard address {host}: peers would dial their own "
            f"loopback. Configure a reachable IPv4 address, or set {ALLOW_WILDCARD_ENV}=1.")


class EngineCore:
    def __init__(self, key: str, config: IOEngineConfig):
        if not isinstance(key, str):
            raise TypeError("IOEngine key must be a str")
        host = config.host or DEFAULT_HOST
        hostname = socket.gethostname()
        self.key = key
        self.host = host
        self.port = int(config.port)
        self.desc = EngineDesc(key, _node_id(hostname), hostname, host, self.port, os.getpid())
        self.memory = LocalMemory(key)
        self.write_log = WriteLog()
        self.notifications = InboundNotifications()
        self.peer_failures: collections.deque = collections.deque()
        self.faults = FaultPlan()
        # MORI's AllocateTransferUniqueId is one atomic increment in C++; a C iterator here (no
        # Python frame per uid) keeps softio's cost per call near that, since callers take one
        # uid per (local, remote) pair, 61 per chunk of a 61-layer model.
        self.allocate_transfer_uid = functools.partial(next, map(_UID_MASK.__and__, itertools.count()))
        self.backends: dict = {}
        self._device_engines: dict = {}
        self._device_lock = threading.Lock()
        self._device_routes = DeviceRoutes(self)
        apply_env_faults(self)
        logger.info("softio: created engine %s (host %s)", key, host)

    # ---- backends ------------------------------------------------------------------------------
    def create_backend(self, backend_type, config) -> None:
        backend_type = BackendType(backend_type)
        if backend_type in self.backends:
            logger.warning("softio: backend %s already exists, skip duplicate creation",
                           backend_type.name)
            return
        if backend_type is BackendType.RDMA:
            if not isinstance(config, RdmaBackendConfig):
                raise TypeError("create_backend(RDMA) needs an RdmaBackendConfig")
            _check_host(self.host)
            backend = SoftRdmaBackend(self, self.host, self.port, config)
            self.port = backend.port
            d = self.desc
            self.desc = EngineDesc(d.key, d.node_id, d.hostname, d.host, backend.port, d.pid)
            self.backends[backend_type] = backend
            logger.info("softio: engine %s listening on %s:%d", self.key, self.host, backend.port)
            return
        if backend_type in (BackendType.XGMI, BackendType.FABRIC):
            raise RuntimeError(f"softio: the {backend_type.name} backend needs AMD GPUs; "
                               f"this software engine only provides RDMA semantics over TCP")
        raise NotImplementedError("backend not implemented yet")

    def remove_backend(self, backend_type) -> None:
        backend = self.backends.pop(BackendType(backend_type), None)
        if backend is not None:
            backend.shutdown("backend removed")

    def _select(self, local, remote):
        if not isinstance(local, MemoryDesc) or not isinstance(remote, MemoryDesc):
            raise TypeError("transfers take MemoryDesc objects for the local and remote side")
        backend = self.backends.get(BackendType.RDMA)
        if backend is not None and backend.can_handle(remote):
            return backend
        return None

    def device_engine(self, device: int):
        """The copy stream and completion thread of this engine on `device` (device_path.py)."""
        with self._device_lock:
            engine = self._device_engines.get(device)
            if engine is None:
                from . import cuda_runtime
                from .device_path import DeviceEngine

                engine = self._device_engines[device] = DeviceEngine(cuda_runtime.load(), device, self.key)
            return engine

    # ---- peers and memory ----------------------------------------------------------------------
    def register_remote_engine(self, desc: EngineDesc) -> None:
        if not isinstance(desc, EngineDesc):
            raise TypeError("register_remote_engine takes an EngineDesc")
        for backend in self.backends.values():
            backend.peers.register(desc)

    def deregister_remote_engine(self, desc: EngineDesc) -> None:
        if not isinstance(desc, EngineDesc):
            raise TypeError("deregister_remote_engine takes an EngineDesc")
        for backend in self.backends.values():
            backend.peers.deregister(desc)
            backend.forget_peer(desc.key)  # unlike MORI's XGMI, which keeps them to its end

    def register_memory(self, ptr, size, device_id, mem_loc) -> MemoryDesc:
        return self.memory.register(ptr, size, device_id, mem_loc)

    def deregister_memory(self, desc: MemoryDesc) -> None:
        if not isinstance(desc, MemoryDesc):
            raise TypeError("deregister_memory takes a MemoryDesc")
        self.memory.deregister(desc)
        for backend in self.backends.values():
            backend.forget_memory(desc.id)

    # ---- transfers -----------------------------------------------------------------------------
    def transfer(self, local, local_offset, remote, remote_offset, size, uid, is_read):
        status = TransferStatus()
        backend = self._select(local, remote)
        if backend is None:
            status.Update(StatusCode.ERR_BAD_STATE, _NO_BACKEND)
            logger.error("softio: %s", _NO_BACKEND)
            return status
        backend.session(local, remote).transfer(
            [local_offset], [remote_offset], [size], status, uid, is_read)
        return status

    def batch_transfer(self, locals_, local_offsets, remotes, remote_offsets, sizes, uids,
                       is_read):
        count = len(sizes)
        if not (len(locals_) == len(local_offsets) == len(remotes) == len(remote_offsets)
                == len(uids) == count):
            # MORI only asserts this in debug builds; fail the whole call, nothing is sent.
            statuses = [TransferStatus() for _ in range(count)]
            for status in statuses:
                status.Update(StatusCode.ERR_INVALID_ARGS,
                              "batch lists (descs, offsets, sizes, uids) differ in length")
            return statuses
        if count and self._device_engines:
            # Every pair an open device session with shared arrays (device_routes.py): the route
            # makes the call's statuses, already IN_PROGRESS, once it posts; None when it does not.
            statuses = self._device_routes.post(locals_, local_offsets, remotes, remote_offsets, sizes, is_read)
            if statuses is not None:
                return statuses
        statuses = [TransferStatus() for _ in range(count)]
        device = DeviceBatch()  # device pairs of this call: one copy call and one event for all
        try:
            for i in range(count):
                backend = self._select(locals_[i], remotes[i])
                if backend is None:
                    statuses[i].Update(StatusCode.ERR_BAD_STATE, _NO_BACKEND)
                    logger.error("softio: %s", _NO_BACKEND)
                    return statuses  # like MORI: the remaining pairs stay INIT
                if len(sizes[i]) == 0:
                    statuses[i].SetCode(StatusCode.SUCCESS)
                    continue
                session = backend.session(locals_[i], remotes[i])
                if isinstance(session, DeviceSession):
                    session.add_to(device, local_offsets[i], remote_offsets[i], sizes[i], statuses[i], is_read)
                else:
                    session.transfer(local_offsets[i], remote_offsets[i], sizes[i], statuses[i], uids[i], is_read)
        finally:
            device.submit()  # what was accepted is posted, also when a later pair raised
        return statuses

    def create_session(self, local, remote):
        backend = self._select(local, remote)
        if backend is None:
            return None
        return backend.session(local, remote)

    def wait_all(self, statuses, timeout_ms: int) -> StatusCode:
        return wait_all(statuses, timeout_ms)

    def pop_inbound_transfer_status(self, remote_key: str, uid: int):
        if not self.notifications.completed(remote_key, uid):
            return None
        status = TransferStatus()
        status.SetCode(StatusCode.SUCCESS)
        return status

    def pop_peer_failure(self):
        try:
            return self.peer_failures.popleft()
        except IndexError:
            return None

    # ---- faults and teardown -------------------------------------------------------------------
    def abort_peer(self, remote_key: str, reason: str) -> None:
        for backend in self.backends.values():
            backend.abort_peer(remote_key, reason)

    def fence_peer(self, remote_key: str, reason: str) -> bool:
        return all([backend.fence_peer(remote_key, reason) for backend in self.backends.values()])

    def abort_all(self, reason: str) -> None:
        for backend in self.backends.values():
            backend.shutdown(reason)

    def shutdown(self) -> None:
        backends, self.backends = list(self.backends.values()), {}
        for backend in backends:
            backend.shutdown("engine destroyed")
        for engine in list(self._device_engines.values()):
            engine.close()
