"""State components without layer ids under prefill pipeline parallelism (issue 11 item 7).

SGLang registers DSA index buffers (one per layer of the stage) and the DSA compress tail (every
layer's key buffers, then every layer's score buffers) without layer ids; a PP stage holds only
its layers, the decode (PP 1) all of them. The stage's tensors must land at its start layer in
each group. SWA state has no per-model-layer layout KVArgs could tell us, so a PP stage's SWA
state stays refused, naming both sides' tensor counts.
"""

from harness.plan_ranges import ranges
import numpy as np
import pytest

from sglang_mori.planning import (
    KVLayout,
    LayoutMismatchError,
    StateLayout,
    TransferPlanner,
    UnsupportedLayoutError,
)

LATENT = 16 * 576


def mla_stage(states, layers: int, start_layer: int = 0) -> KVLayout:
    return KVLayout(
        is_mla=True, tp_size=1, tp_rank=0, page_size=16, kv_cache_dtype="bfloat16",
        kv_item_lens=(LATENT,) * layers, kv_data_lens=(LATENT * 8,) * layers,
        start_layer=start_layer, states=tuple(states),
    )


def state(state_type, item_lens, capacity=10):
    return StateLayout(state_type=state_type, item_lens=tuple(item_lens),
                       data_lens=tuple(i * capacity for i in item_lens))


def pairs(planner, component, src, dst):
    return [(t.local_index, t.remote_index) for t in planner.plan_state(component, src, dst)]


def test_a_later_stage_dsa_index_and_tail_land_at_its_start_layer():
    prefill = mla_stage([state("dsa", [40, 40]), state("dsa_tail", [16] * 4)], layers=2, start_layer=2)
    decode = mla_stage([state("dsa", [40] * 4), state("dsa_tail", [16] * 8)], layers=4)
    planner = TransferPlanner(prefill, decode)
    assert pairs(planner, 0, [3, 5], [7, 9]) == [(0, 2), (1, 3)]
    # Tail groups: prefill [key2, key3, score2, score3] -> decode [key0..3, score0..3].
    assert pairs(planner, 1, [1, 0, 2, 0, 0, 4], [2, 0, 2, 0, 0, 4]) == [(0, 2), (1, 3), (2, 6), (3, 7)]


def test_stage_dsa_bytes_land_in_the_decode_layers_of_the_stage():
    prefill = mla_stage([state("dsa", [8, 8], capacity=4)], layers=2, start_layer=2)
    decode = mla_stage([state("dsa", [8] * 4, capacity=4)], layers=4)
    src = [np.arange(32, dtype=np.uint8) + 100 * k for k in range(2)]
    dst = [np.zeros(32, dtype=np.uint8) for _ in range(4)]
    for t in TransferPlanner(prefill, decode).plan_state(0, [1, 2], [3, 0]):
        for lo, ro, size in zip(*ranges(t)):
            dst[t.remote_index][ro : ro + size] = src[t.local_index][lo : lo + size]
    assert not dst[0].any() and not dst[1].any()
    for k in range(2):
        assert dst[2 + k][24:32].tolist() == src[k][8:16].tolist()
        assert dst[2 + k][0:8].tolist() == src[k][16:24].tolist()


def test_the_first_stage_needs_no_offset_and_a_stage_past_the_decode_layers_is_refused():
    first = mla_stage([state("dsa", [40, 40])], layers=2, start_layer=0)
    decode = mla_stage([state("dsa", [40] * 4)], layers=4)
    assert pairs(TransferPlanner(first, decode), 0, [1, 2], [3, 4]) == [(0, 0), (1, 1)]
    too_far = mla_stage([state("dsa", [40, 40])], layers=2, start_layer=3)
    with pytest.raises(LayoutMismatchError, match=r"state 'dsa' layers: prefill=\[3, 5\) decode=4 layers"):
        TransferPlanner(too_far, mla_stage([state("dsa", [40] * 4)], layers=5))


def test_swa_state_of_a_pp_stage_is_refused_naming_both_counts():
    prefill = mla_stage([state("swa", [32, 32])], layers=2, start_layer=2)
    decode = mla_stage([state("swa", [32] * 4)], layers=4)
    with pytest.raises(UnsupportedLayoutError, match="state 'swa': prefill has 2 tensors and decode 4"):
        TransferPlanner(prefill, decode)
