"""The bootstrap server is SGLang's own (HTTP, runs in the prefill launcher process)."""

from sglang.srt.disaggregation.common.conn import CommonKVBootstrapServer


class MoriKVBootstrapServer(CommonKVBootstrapServer):
    pass
