"""Enumerations of the mori.io API, with the numeric values of amd-mori 1.2.4.

The real module exposes pybind11 enums. IntEnum gives the same member names, `.name`, `.value`,
`int()` and identity comparisons; it is slightly more permissive (it also compares equal to a
plain int), which code written against real MORI never relies on.
"""

from __future__ import annotations

from enum import IntEnum


class _BoundEnum(IntEnum):
    """IntEnum that prints like a pybind11 enum member (`StatusCode.SUCCESS`)."""

    def __str__(self) -> str:
        return f"{type(self).__name__}.{self.name}"


class BackendType(_BoundEnum):
    Unknown = 0
    XGMI = 1
    RDMA = 2
    TCP = 3
    FABRIC = 4


class MemoryLocationType(_BoundEnum):
    Unknown = 0
    CPU = 1
    GPU = 2


class StatusCode(_BoundEnum):
    SUCCESS = 0
    INIT = 1
    IN_PROGRESS = 2
    ERR_INVALID_ARGS = 11
    ERR_NOT_FOUND = 12
    ERR_RDMA_OP = 13
    ERR_BAD_STATE = 14
    ERR_GPU_OP = 15


# Codes above this value are failures (TransferStatus.Failed()); mori calls it ERR_BEGIN.
ERR_BEGIN = 10


class PollCqMode(_BoundEnum):
    POLLING = 0
    EVENT = 1


class PeerFailureReason(_BoundEnum):
    # Order as registered by the 1.2.4 bindings; the numeric values are not documented upstream.
    UNKNOWN = 0
    PEER_UNREACHABLE = 1
    LOCAL_QP_ERROR = 2
    LOCAL_PORT_DOWN = 3
    LOCAL_DEVICE_FATAL = 4
    LOCAL_CQ_ERROR = 5
