"""The bootstrap server is SGLang's own (HTTP, runs in the prefill launcher process)."""

from sglang_mori.backend.sglang_compat import CommonKVBootstrapServer


class MoriKVBootstrapServer(CommonKVBootstrapServer):
    pass
