"""Start-up decisions of layer-wise streaming: the knob, the plugin's hook registration, and which
deployments can stream (`on` refuses the others with the reason, `auto` stays chunk-wise)."""

from types import SimpleNamespace

import pytest

from sglang_mori.backend.prefill.layerwise.assembly import build_session, unsupported_reason
from sglang_mori.backend.sglang_fields import Deployment
from sglang_mori.config import ConfigError, MoriConfig
from sglang_mori.plugin import layerwise_requested


class Metrics:
    def __init__(self):
        self.fallbacks = []

    def layerwise_fallback(self, reason, n=1):
        self.fallbacks.append(reason)


def test_knobs_parse_and_validate():
    cfg = MoriConfig.from_env({"SGLANG_MORI_LAYERWISE": "AUTO", "SGLANG_MORI_LAYERWISE_MIN_TOKENS": "0",
                               "SGLANG_MORI_LAYERWISE_GROUP": "4"})
    assert (cfg.layerwise, cfg.layerwise_min_tokens, cfg.layerwise_group) == ("auto", 0, 4)
    assert MoriConfig.from_env({}).layerwise == "off"
    for name, bad in (("SGLANG_MORI_LAYERWISE", "yes"), ("SGLANG_MORI_LAYERWISE_MIN_TOKENS", "-1"),
                      ("SGLANG_MORI_LAYERWISE_GROUP", "-1")):
        with pytest.raises(ConfigError, match=name):
            MoriConfig.from_env({name: bad})


def test_plugin_registers_hooks_only_when_requested():
    assert layerwise_requested({"SGLANG_MORI_LAYERWISE": "on"})
    assert layerwise_requested({"SGLANG_MORI_LAYERWISE": "auto"})
    assert not layerwise_requested({})
    assert not layerwise_requested({"SGLANG_MORI_LAYERWISE": "bogus"})  # the manager refuses it


LAYOUT = SimpleNamespace(states=(), num_draft_entries=0, is_mla=False)


@pytest.mark.parametrize("deployment, layout, expected", [
    (Deployment(), LAYOUT, None),
    (Deployment(pp_size=2), LAYOUT, "pipeline parallelism"),
    (Deployment(attn_cp_size=2), LAYOUT, "context parallelism"),
    (Deployment(staging=True), LAYOUT, "staging"),
    (Deployment(kv_shard_size=2), LAYOUT, "KV sharding"),
    (Deployment(), SimpleNamespace(states=("mamba",)), "hybrid state"),
    (Deployment(two_batch_overlap=True), LAYOUT, "two-batch overlap"),
])
def test_unsupported_deployments(deployment, layout, expected):
    reason = unsupported_reason(deployment, layout)
    assert (reason is None) if expected is None else (expected in reason)


UNSUPPORTED = [Deployment(pp_size=2), Deployment(attn_cp_size=2), Deployment(staging=True),
               Deployment(kv_shard_size=2), Deployment(two_batch_overlap=True)]


@pytest.mark.parametrize("deployment, layout", [(d, LAYOUT) for d in UNSUPPORTED]
                         + [(Deployment(), SimpleNamespace(states=("mamba",)))])
def test_on_refuses_an_unsupported_deployment_and_auto_serves_it_chunk_wise(deployment, layout):
    # Each start-up refusal of `on` is, under `auto`, what `off` does: no session (send() moves
    # everything chunk-wise), counted once as a `deployment` fallback.
    parts = SimpleNamespace(config=MoriConfig(layerwise="on"), metrics=Metrics())
    with pytest.raises(ConfigError, match="SGLANG_MORI_LAYERWISE=auto"):
        build_session(deployment, [1, 2], parts, None, layout)
    parts = SimpleNamespace(config=MoriConfig(layerwise="auto"), metrics=Metrics())
    assert build_session(deployment, [1, 2], parts, None, layout) is None
    assert parts.metrics.fallbacks == ["deployment"]
    assert build_session(deployment, [1, 2], SimpleNamespace(config=MoriConfig()), None, layout) is None  # off


def test_halving_group_ends():
    from sglang_mori.backend.prefill.layerwise.session import group_ends

    assert group_ends(61) == {15, 38, 49, 55, 58, 59, 60, 61}  # groups of 15, 23, 11, 6, 3, 1, 1, 1
    assert group_ends(32) == {8, 20, 26, 29, 30, 31, 32}
    assert group_ends(4) == {1, 2, 3, 4} and group_ends(2) == {1, 2} and group_ends(1) == {1}
