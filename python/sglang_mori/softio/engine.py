"""The public engine classes, with the method names and parameters of amd-mori 1.2.4's
`mori/io/engine.py`, so code written against `mori.io` runs unchanged on softio.
"""

from __future__ import annotations

import os

from .config import FabricBackendConfig, RdmaBackendConfig, XgmiBackendConfig
from .core import EngineCore
from .enums import BackendType, MemoryLocationType, StatusCode
from .status import TransferStatus

TORCH_DEVICE_TYPE_MAP = {
    "cpu": MemoryLocationType.CPU,
    "cuda": MemoryLocationType.GPU,
}


class IOEngineSession:
    """A (local region, remote region) pair; `batch_*` returns ONE status for the whole batch."""

    def __init__(self, mori_sess):
        self._sess = mori_sess

    def allocate_transfer_uid(self):
        return self._sess.backend.core.allocate_transfer_uid()

    def read(self, local_offset, remote_offset, size, transfer_uid):
        status = TransferStatus()
        self._sess.transfer([local_offset], [remote_offset], [size], status, transfer_uid, True)
        return status

    def write(self, local_offset, remote_offset, size, transfer_uid):
        status = TransferStatus()
        self._sess.transfer([local_offset], [remote_offset], [size], status, transfer_uid, False)
        return status

    def batch_read(self, local_offsets, remote_offsets, sizes, transfer_uid):
        status = TransferStatus()
        self._sess.transfer(local_offsets, remote_offsets, sizes, status, transfer_uid, True)
        return status

    def batch_write(self, local_offsets, remote_offsets, sizes, transfer_uid):
        status = TransferStatus()
        self._sess.transfer(local_offsets, remote_offsets, sizes, status, transfer_uid, False)
        return status

    def alive(self):
        return True  # MORI's RDMA sessions always report alive


# "0": this engine has no fence_peer, as MORI-IO has none: tests of the course real hardware takes.
FENCE_ENV = "SGLANG_MORI_SOFTIO_FENCE"


class IOEngine:
    def __init__(self, key, config):
        self._core = EngineCore(key, config)
        # The core's C-level counter itself, not a method that calls it: one uid per pair.
        self.allocate_transfer_uid = self._core.allocate_transfer_uid
        if os.environ.get(FENCE_ENV, "1").strip() == "0":
            self.fence_peer = None  # what callers feature-detect (TransferEngine.can_fence)

    def __del__(self):
        # Like the C++ destructor: stop serving and close every connection.
        core = getattr(self, "_core", None)
        if core is not None:
            try:
                core.shutdown()
            except Exception:  # noqa: BLE001 - never raise from a finalizer (interpreter exit)
                pass

    def get_engine_desc(self):
        return self._core.desc

    def create_backend(self, type, config=None):
        if config is None:
            if type is BackendType.RDMA:
                config = RdmaBackendConfig()
            elif type is BackendType.XGMI:
                config = XgmiBackendConfig()
            elif type is BackendType.FABRIC:
                config = FabricBackendConfig()
            else:
                raise NotImplementedError("backend not implemented yet")
        return self._core.create_backend(type, config)

    def remove_backend(self, type):
        return self._core.remove_backend(type)

    def register_remote_engine(self, engine_desc):
        return self._core.register_remote_engine(engine_desc)

    def deregister_remote_engine(self, engine_desc):
        return self._core.deregister_remote_engine(engine_desc)

    def register_memory(self, ptr, size, device_id, mem_loc):
        return self._core.register_memory(ptr, size, device_id, mem_loc)

    def register_torch_tensor(self, tensor):
        if not tensor.is_contiguous():
            raise RuntimeError("input tensor must be contiguous")
        total_bytes = tensor.nelement() * tensor.element_size()
        device_id = tensor.device.index
        if device_id is None:
            device_id = -1
        mem_loc = TORCH_DEVICE_TYPE_MAP[tensor.device.type]
        return self.register_memory(tensor.data_ptr(), total_bytes, device_id, mem_loc)

    def deregister_memory(self, mem_desc):
        return self._core.deregister_memory(mem_desc)

    def allocate_transfer_uid(self):
        return self._core.allocate_transfer_uid()

    def read(self, local_dest_mem_desc, local_offset, remote_src_mem_desc, remote_offset, size,
             transfer_uid):
        return self._core.transfer(local_dest_mem_desc, local_offset, remote_src_mem_desc,
                                   remote_offset, size, transfer_uid, True)

    def write(self, local_dest_mem_desc, local_offset, remote_src_mem_desc, remote_offset, size,
              transfer_uid):
        # Parameter names as in MORI's shared helper (for a write, "dest" is the local source).
        return self._core.transfer(local_dest_mem_desc, local_offset, remote_src_mem_desc,
                                   remote_offset, size, transfer_uid, False)

    def batch_read(self, local_dest_mem_desc, local_offsets, remote_src_mem_desc,
                   remote_offsets, sizes, transfer_uid):
        return self._core.batch_transfer(local_dest_mem_desc, local_offsets, remote_src_mem_desc,
                                         remote_offsets, sizes, transfer_uid, True)

    def batch_write(self, local_dest_mem_desc, local_offsets, remote_src_mem_desc,
                    remote_offsets, sizes, transfer_uid):
        return self._core.batch_transfer(local_dest_mem_desc, local_offsets, remote_src_mem_desc,
                                         remote_offsets, sizes, transfer_uid, False)

    def create_session(self, local_mem, remote_mem):
        sess = self._core.create_session(local_mem, remote_mem)
        if sess is None:
            return None
        return IOEngineSession(sess)

    def pop_inbound_transfer_status(self, remote_key, transfer_uid):
        return self._core.pop_inbound_transfer_status(remote_key, transfer_uid)

    def pop_peer_failure(self):
        """Take the oldest pending peer failure, or None if nothing has failed.

        None means nothing has been observed to fail, not that peers are healthy.
        """
        return self._core.pop_peer_failure()

    def fence_peer(self, remote_key: str, reason: str = "") -> bool:
        """softio only (MORI-IO has no such call): True when, as this returns, no write to
        `remote_key` posted before it can still land (they failed with ERR_RDMA_OP; later
        transfers dial the peer again); False for a peer reached through device memory, which
        cannot be fenced (SoftRdmaBackend.fence_peer)."""
        return self._core.fence_peer(remote_key, reason)

    def wait_all(self, statuses, timeout_ms: int = -1) -> StatusCode:
        return self._core.wait_all(statuses, timeout_ms)
