"""SGLang plugin entry point (entry-point group `sglang.srt.plugins`).

SGLang calls `register()` in every one of its processes (launcher, scheduler, detokenizer) before it
builds its server arguments. We hook `get_kv_class` so that `TransferBackend.MORI` resolves to our
classes everywhere; every other backend goes to SGLang's own implementation unchanged.
"""

from __future__ import annotations

import logging

from sglang_mori import call_meter
from sglang_mori.backend.sglang_manifest import GET_KV_CLASS_TARGET, LAYERWISE_HOOKS, SUPPORTED_SGLANG_VERSION

logger = logging.getLogger(__name__)


class UnsupportedSGLangVersion(RuntimeError):
    pass


def check_sglang_version(version: str | None = None) -> str:
    """Fail early and clearly: the Common* classes we subclass change between SGLang releases."""
    if version is None:
        import sglang

        version = getattr(sglang, "__version__", "unknown")
    if version != SUPPORTED_SGLANG_VERSION:
        raise UnsupportedSGLangVersion(
            f"sglang-mori supports SGLang {SUPPORTED_SGLANG_VERSION} exactly, but SGLang {version} "
            f"is installed. Install sglang=={SUPPORTED_SGLANG_VERSION}, or uninstall sglang-mori "
            "to use SGLang's built-in mori backend."
        )
    return version


def mori_kv_classes() -> dict:
    """Our class for each KVClassType except KVARGS (SGLang's KVArgs container is shared)."""
    from sglang.srt.disaggregation.utils import KVClassType

    from sglang_mori.backend import (
        MoriKVBootstrapServer,
        MoriKVManager,
        MoriKVReceiver,
        MoriKVSender,
    )

    metered = call_meter.meter()
    if metered is not None:  # SGLANG_MORI_CALL_METER: SGLang's calls into these timed (off: untouched)
        for cls in (MoriKVManager, MoriKVSender, MoriKVReceiver):
            metered.wrap_class(cls)
    return {
        KVClassType.MANAGER: MoriKVManager,
        KVClassType.SENDER: MoriKVSender,
        KVClassType.RECEIVER: MoriKVReceiver,
        KVClassType.BOOTSTRAP_SERVER: MoriKVBootstrapServer,
    }


def around_get_kv_class(original, transfer_backend, class_type, *args, **kwargs):
    from sglang.srt.disaggregation.utils import TransferBackend

    if transfer_backend == TransferBackend.MORI:
        ours = mori_kv_classes().get(class_type)
        if ours is not None:
            return ours
    return original(transfer_backend, class_type, *args, **kwargs)


def layerwise_requested(environ=None) -> bool:
    """SGLANG_MORI_LAYERWISE is on or auto. An unusable value registers nothing here; the manager
    stops start-up on it with the reason (config.py)."""
    import os

    from sglang_mori.config import ConfigError, MoriConfig

    try:
        return MoriConfig.from_env(os.environ if environ is None else environ).layerwise != "off"
    except ConfigError:
        return False


def _lazy_hook(name: str):
    """An AROUND hook that imports the layer-wise hooks module on its first call, so that the
    processes that never run a hooked function (launcher, detokenizer) never import it."""

    def hook(original, *args, **kwargs):
        from sglang_mori.backend.prefill.layerwise import hooks

        metered = call_meter.meter()
        if metered is not None:  # its own CPU, the wrapped SGLang function's left out
            return metered.hook(f"hooks.{name}", getattr(hooks, name), original, *args, **kwargs)
        return getattr(hooks, name)(original, *args, **kwargs)

    hook.__name__ = hook.__qualname__ = f"sglang_mori_layerwise_{name}"
    return hook


def register() -> None:
    check_sglang_version()
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(GET_KV_CLASS_TARGET, around_get_kv_class, HookType.AROUND)
    if layerwise_requested():
        for target, name in LAYERWISE_HOOKS:
            HookRegistry.register(target, _lazy_hook(name), HookType.AROUND)
    logger.info("sglang-mori: --disaggregation-transfer-backend mori is served by sglang_mori")
