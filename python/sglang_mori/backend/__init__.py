"""SGLang-facing classes for `--disaggregation-transfer-backend mori`.

Exports resolve lazily: importing a helper module of this package (peers, plans, room_status) must not
pull in all of SGLang, which takes seconds.
"""

import importlib

_EXPORTS = {
    "MoriKVBootstrapServer": "sglang_mori.backend.bootstrap",
    "MoriKVManager": "sglang_mori.backend.manager",
    "MoriKVReceiver": "sglang_mori.backend.receiver",
    "MoriKVSender": "sglang_mori.backend.sender",
}

__all__ = list(_EXPORTS)


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
