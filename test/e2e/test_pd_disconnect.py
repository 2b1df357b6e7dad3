"""A client that hangs up mid-request leaves prefill and decode healthy and serving.

The abort travels router -> decode (and prefill); the request's room must be released on both sides
without wedging the transfer threads, so the next request through the same servers succeeds.
"""

from __future__ import annotations

import pytest

from harness import client
from harness.deployment import http_ok
from harness.procs import wait_until

pytestmark = pytest.mark.e2e

LONG_PROMPT = "The worker opens a lane and sends the packet across the network; " * 12
# An abandoned request asks for this many tokens (ignore_eos): left to run, it would decode for
# far longer than the drain deadline below, so draining in time proves the abort reached decode.
HANG_UP_TOKENS = 3000  # + the longest prompt here (LONG_PROMPT x 3, ~650 tokens) < 4096 positions


@pytest.fixture(scope="module")
def drain_deadline_s(pd):
    """Half of what an un-aborted request would take, measured on this host, capped at 10 s."""
    probe = client.generate_stream(pd.router_url, LONG_PROMPT, 200, ignore_eos=True)
    assert probe.ok and probe.itl_s, probe.error
    natural_s = HANG_UP_TOKENS * sum(probe.itl_s) / len(probe.itl_s)
    deadline = min(10.0, natural_s / 2)
    assert deadline >= 1.0, f"decode too fast ({natural_s:.1f} s for {HANG_UP_TOKENS} tokens) to tell an abort"
    return deadline


def _assert_drained_and_serving(standalone, pd, deadline_s):
    # Both servers drop the abandoned request within the deadline (running + queued == 0) ...
    for name, url in (("decode", pd.decode_url), ("prefill", pd.prefill_url)):
        wait_until(lambda u=url: client.requests_in_server(u) == 0, deadline_s, f"{name} drains the request",
                   interval_s=0.1)
    # ... answer a real generation on their own health endpoint ...
    assert http_ok(f"{pd.decode_url}/health_generate", timeout_s=30)
    assert http_ok(f"{pd.prefill_url}/health_generate", timeout_s=30)
    # ... and serve the next request through the router, with the right tokens.
    prompt = "After the hang-up, the next request"
    ours = client.generate(pd.router_url, prompt, 16)
    ref = client.generate(standalone.url, prompt, 16)
    assert ours.ok, f"{ours.status} {ours.error}"
    assert ours.output_ids == ref.output_ids


def _first_chunk(received: bytes) -> bool:
    return b"data:" in received


def _in_servers(pd):
    """True once prefill or decode holds the request: hang up before its first token."""
    def check(received: bytes) -> bool:
        assert not _first_chunk(received), "first token arrived before the request was seen queued"
        return client.requests_in_server(pd.prefill_url) + client.requests_in_server(pd.decode_url) > 0
    return check


def test_disconnect_after_first_chunk(standalone, pd, drain_deadline_s):
    received = client.open_stream_and_hang_up(pd.router_url, LONG_PROMPT, HANG_UP_TOKENS, _first_chunk)
    assert b"data:" in received
    _assert_drained_and_serving(standalone, pd, drain_deadline_s)


def test_disconnect_before_first_token(standalone, pd, drain_deadline_s):
    # Hang up while the request is in prefill, bootstrap or KV transfer (a multi-chunk prompt).
    client.open_stream_and_hang_up(pd.router_url, LONG_PROMPT * 3, HANG_UP_TOKENS, _in_servers(pd))
    _assert_drained_and_serving(standalone, pd, drain_deadline_s)


def test_many_hang_ups_then_concurrent_traffic(standalone, pd, drain_deadline_s):
    for i in range(6):
        when = _first_chunk if i % 2 else _in_servers(pd)
        client.open_stream_and_hang_up(pd.router_url, f"[{i}] " + LONG_PROMPT * (1 + i % 3),
                                       HANG_UP_TOKENS, when)
    prompts = [f"after hang-ups {i}: " + LONG_PROMPT[: 20 + 40 * i] for i in range(8)]
    ours = client.generate_many(pd.router_url, prompts, 12, concurrency=8)
    refs = client.generate_many(standalone.url, prompts, 12, concurrency=8)
    assert [r.ok for r in ours] == [True] * 8, [(r.status, r.error[:200]) for r in ours]
    assert [r.output_ids for r in ours] == [r.output_ids for r in refs]
    _assert_drained_and_serving(standalone, pd, drain_deadline_s)
