"""softio: a pure-Python engine with the Python API of `mori.io` (amd-mori 1.2.4).

It moves bytes between registered host memory of different processes over TCP, or, between
engines on one host, by cross-memory attach (softio.intrahost, the counterpart of MORI's XGMI
route; SGLANG_MORI_SOFTIO_FORCE_TCP=1 keeps TCP), with MORI-IO's semantics (one-sided writes and
reads, lanes like QPs, lazy first contact, status lifecycle, wait_all, peer failures), so code
written against `mori.io` runs unchanged on a CPU-only machine.
Test helpers live in `softio.faults` (fault injection) and `softio.write_log` (target write log).
"""

from .config import FabricBackendConfig, IOEngineConfig, RdmaBackendConfig, XgmiBackendConfig
from .descriptors import EngineDesc, MemoryDesc, PeerFailureEvent
from .engine import TORCH_DEVICE_TYPE_MAP, IOEngine, IOEngineSession
from .enums import BackendType, MemoryLocationType, PeerFailureReason, PollCqMode, StatusCode
from .fabric import fabric_alloc, fabric_free
from .logging_level import apply_env_log_level as _apply_env_log_level
from .logging_level import set_log_level
from .status import TransferStatus

_apply_env_log_level()

# Not part of MORI's API: batch_write/batch_read here take numpy int64 arrays for the offsets and
# sizes as well as lists, so the backend can hand its plans over without turning them into lists
# (MORI's bindings take lists; sglang_mori.engine converts for them).
_TAKES_OFFSET_ARRAYS = True

__all__ = [
    "BackendType",
    "EngineDesc",
    "FabricBackendConfig",
    "IOEngine",
    "IOEngineConfig",
    "IOEngineSession",
    "MemoryDesc",
    "MemoryLocationType",
    "PeerFailureEvent",
    "PeerFailureReason",
    "PollCqMode",
    "RdmaBackendConfig",
    "StatusCode",
    "TORCH_DEVICE_TYPE_MAP",
    "TransferStatus",
    "XgmiBackendConfig",
    "fabric_alloc",
    "fabric_free",
    "set_log_level",
]
