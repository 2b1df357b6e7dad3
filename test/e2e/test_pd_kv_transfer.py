"""The KV cache really travels through our backend, and exactly the prompt's KV.

Reads the backend's own byte counter on the prefill server (sglang_mori_transfer_bytes_total on
/metrics) around single requests: each must add prompt_tokens x (layers x K,V x kv_heads x head_dim
x 4 bytes). This catches a silent fallback to another backend (no counter), pages sent twice or
missed across prefill chunks (wrong total), and a prefix-cache hit on prefill that skips sending
the cached pages to decode (decode has no copy of them).
"""

from __future__ import annotations

import pytest

from harness import client
from harness.tiny_model import kv_bytes_per_token
from harness.transfer_stats import TransferProbe

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.needs_backend("mori"),  # the counters are ours; other backends have none
]

PROMPTS = {
    "one-chunk": "Count the bytes of this short prompt.",
    "several-chunks": "Every page of every layer crosses from prefill to decode exactly once. " * 12,
}


@pytest.mark.parametrize("prompt", PROMPTS.values(), ids=PROMPTS.keys())
def test_kv_bytes_moved_equal_prompt_kv(pd, prompt):
    probe = TransferProbe(pd.prefill_url)
    for attempt in ("cold", "prefix-cached on prefill"):
        probe.before()
        gen = client.generate(pd.router_url, prompt, 8)
        moved = probe.after()
        assert gen.ok, gen.error
        assert moved is not None, "prefill exposes no sglang_mori transfer counters: is the backend ours?"
        expected = gen.meta["prompt_tokens"] * kv_bytes_per_token()
        assert moved.nbytes == expected, f"{attempt}: moved {moved.nbytes} B, prompt KV is {expected} B"
        assert moved.seconds > 0
