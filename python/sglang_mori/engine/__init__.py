"""The only code that touches a MORI-IO module (real `mori.io` or `sglang_mori.softio`)."""

from sglang_mori.engine.loader import EngineUnavailable, load_io_module
from sglang_mori.engine.outcomes import FailureKind, PeerFailure, WriteState
from sglang_mori.engine.settings import EngineSettings
from sglang_mori.engine.transfer_engine import SubmitError, TransferEngine, TransferHandle, WriteBatch, WritePair

__all__ = [
    "EngineSettings",
    "EngineUnavailable",
    "FailureKind",
    "PeerFailure",
    "WriteState",
    "WriteBatch",
    "WritePair",
    "load_io_module",
    "SubmitError",
    "TransferEngine",
    "TransferHandle",
]
