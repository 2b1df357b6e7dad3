"""Streaming /generate and the OpenAI-compatible chat endpoint work through the PD router."""

from __future__ import annotations

import pytest

from harness import client

pytestmark = pytest.mark.e2e

PROMPTS = [
    "stream me",
    "The river runs through the city while the engine writes pages into memory " * 6,
]


@pytest.mark.parametrize("prompt", PROMPTS, ids=["short", "multi-chunk"])
def test_generate_stream_matches_standalone(standalone, pd, prompt):
    ref = client.generate(standalone.url, prompt, 20, ignore_eos=True)
    streamed = client.generate_stream(pd.router_url, prompt, 20, ignore_eos=True)
    assert ref.ok, ref.error
    assert streamed.ok, f"{streamed.status} {streamed.error}"
    assert streamed.output_ids == ref.output_ids
    # Tokens arrive incrementally, not as one final blob (a busy server may merge a few per chunk).
    assert streamed.chunks >= 3, streamed.chunks
    assert streamed.ttft_s is not None and len(streamed.itl_s) == len(streamed.output_ids) - 1
    assert streamed.finish_type == "length"


def test_chat_completion_matches_standalone(standalone, pd):
    message = "Tell me about the stone bridge over the river."
    ref = client.chat(standalone.url, message, 16)
    ours = client.chat(pd.router_url, message, 16)
    assert ours["choices"][0]["message"]["content"] == ref["choices"][0]["message"]["content"]
    assert ours["usage"]["completion_tokens"] == ref["usage"]["completion_tokens"] > 0
    # The chat template was applied (role tags add tokens beyond the bare message).
    assert ours["usage"]["prompt_tokens"] == ref["usage"]["prompt_tokens"]


def test_chat_completion_stream(standalone, pd):
    message = "Which lane sends the next packet?"
    ref = client.chat(standalone.url, message, 16)
    streamed = client.chat_stream(pd.router_url, message, 16)
    assert streamed["done"], "stream did not end with [DONE]"
    assert streamed["chunks"] >= 3
    assert streamed["content"] == ref["choices"][0]["message"]["content"]
    assert streamed["finish_reason"] == ref["choices"][0]["finish_reason"]
