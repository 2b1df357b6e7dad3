"""SGLang-facing classes for `--disaggregation-transfer-backend mori`."""

from sglang_mori.backend.bootstrap import MoriKVBootstrapServer
from sglang_mori.backend.manager import MoriKVManager
from sglang_mori.backend.receiver import MoriKVReceiver
from sglang_mori.backend.sender import MoriKVSender

__all__ = ["MoriKVBootstrapServer", "MoriKVManager", "MoriKVReceiver", "MoriKVSender"]
