"""The `mori.cpp` names used next to `mori.io`, taken from softio.

The compiled IOEngine/IOEngineSession classes of real mori.cpp are not provided: their C++-style
API (GetEngineDesc, BatchWrite with output statuses) is not what Python code calls.
"""

from sglang_mori.softio import (BackendType, EngineDesc, FabricBackendConfig, IOEngineConfig,
                                MemoryDesc, MemoryLocationType, PeerFailureEvent,
                                PeerFailureReason, PollCqMode, RdmaBackendConfig, StatusCode,
                                TransferStatus, XgmiBackendConfig, fabric_alloc, fabric_free,
                                set_log_level)
from sglang_mori.softio.config import BackendConfig

__all__ = [
    "BackendConfig", "BackendType", "EngineDesc", "FabricBackendConfig", "IOEngineConfig",
    "MemoryDesc", "MemoryLocationType", "PeerFailureEvent", "PeerFailureReason", "PollCqMode",
    "RdmaBackendConfig", "StatusCode", "TransferStatus", "XgmiBackendConfig", "fabric_alloc",
    "fabric_free", "set_log_level",
]
