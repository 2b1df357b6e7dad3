"""The only code that touches a MORI-IO module (real `mori.io` or `sglang_mori.softio`)."""

from sglang_mori.engine.loader import EngineUnavailable, load_io_module
from sglang_mori.engine.transfer_engine import SubmitError, TransferEngine, TransferHandle

__all__ = [
    "EngineUnavailable",
    "load_io_module",
    "SubmitError",
    "TransferEngine",
    "TransferHandle",
]
