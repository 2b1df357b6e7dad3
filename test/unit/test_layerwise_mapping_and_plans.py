"""Layer -> registered buffer mapping (MHA, MLA, by data pointer) and the per-layer filtering of a
plan: the layer groups of a pass joined together are exactly the full chunk-wise plan."""

from types import SimpleNamespace

import numpy as np
import pytest

from sglang_mori.backend.prefill.layerwise.mapping import LayerBufferMap
from sglang_mori.backend.prefill.layerwise.planner import select_buffers, selected_chunk
from sglang_mori.planning import KVLayout, TransferPlanner


def arrays(n, size=64):
    return [np.zeros(size, np.uint8) for _ in range(n)]


def test_mha_layer_maps_to_its_k_and_v_buffers():
    k, v = arrays(3), arrays(3)
    ptrs = [a.ctypes.data for a in k + v]
    pool = SimpleNamespace(k_buffer=k, v_buffer=v, start_layer=0)
    m = LayerBufferMap(ptrs, num_draft_entries=0, is_mla=False)
    assert [m.buffers_for(pool, layer) for layer in range(3)] == [(0, 3), (1, 4), (2, 5)]
    assert m.buffers_for(pool, 3) is None  # not a layer of this pool


def test_mla_layer_maps_to_its_latent_buffer_with_a_pp_start_layer():
    kv = arrays(2)
    pool = SimpleNamespace(kv_buffer=kv, start_layer=10)
    m = LayerBufferMap([a.ctypes.data for a in kv], num_draft_entries=0, is_mla=True)
    assert m.buffers_for(pool, 10) == (0,) and m.buffers_for(pool, 11) == (1,)
    assert m.buffers_for(pool, 0) is None


def test_unregistered_tensors_and_draft_buffers_are_unmapped():
    k, v = arrays(2), arrays(2)
    draft_k, draft_v = arrays(1), arrays(1)
    ptrs = [a.ctypes.data for a in k + v + draft_k + draft_v]
    m = LayerBufferMap(ptrs, num_draft_entries=2, is_mla=False)
    assert m.buffers_for(SimpleNamespace(k_buffer=k, v_buffer=v, start_layer=0), 1) == (1, 3)
    # the draft model's pool: registered, but draft layers go with send()
    assert m.buffers_for(SimpleNamespace(k_buffer=draft_k, v_buffer=draft_v, start_layer=0), 0) is None
    # a quantized copy or any other tensor: not registered memory
    assert m.buffers_for(SimpleNamespace(k_buffer=arrays(2), v_buffer=v, start_layer=0), 0) is None
    # a pool without per-layer K/V lists (hybrid, unknown)
    assert m.buffers_for(SimpleNamespace(), 0) is None


def layout(is_mla, layers, item, tp=1, rank=0, heads=0, page_size=1, pages=32):
    n = layers if is_mla else 2 * layers
    return KVLayout(is_mla=is_mla, tp_size=tp, tp_rank=rank, page_size=page_size, kv_cache_dtype="bf16",
                    kv_item_lens=(item,) * n, kv_data_lens=(item * pages,) * n, kv_head_num=heads,
                    total_kv_head_num=heads * tp if heads else 0)


def as_tuples(plan):
    return sorted((t.local_index, t.remote_index, tuple(t.local_offsets), tuple(t.remote_offsets), tuple(t.sizes))
                  for t in plan.transfers)


@pytest.mark.parametrize("is_mla", [False, True])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("group", [1, 2, 3])
def test_layer_groups_joined_equal_the_full_plan(is_mla, page_size, group):
    layers = 5
    planner = TransferPlanner(layout(is_mla, layers, 128 * page_size, page_size=page_size),
                              layout(is_mla, layers, 128 * page_size, page_size=page_size))
    src, dst = np.array([3, 4, 5, 9, 10]), np.array([20, 21, 22, 1, 2])
    full = planner.plan_kv(src, dst)
    per_layer = [(layer,) if is_mla else (layer, layers + layer) for layer in range(layers)]
    groups = [sum(per_layer[i:i + group], ()) for i in range(0, layers, group)]
    joined = [t for g in groups for t in select_buffers(full, g).transfers]
    assert sorted(as_tuples(full)) == sorted(
        (t.local_index, t.remote_index, tuple(t.local_offsets), tuple(t.remote_offsets), tuple(t.sizes)) for t in joined)
    assert sum(select_buffers(full, g).total_bytes for g in groups) == full.total_bytes


def test_filtering_a_tp_mismatch_plan_keeps_head_slices():
    # prefill TP 1 (4 heads) -> decode TP 2 rank 1 (heads 2..3)
    p = layout(False, 2, 4 * 8, tp=1, heads=4)
    d = layout(False, 2, 2 * 8, tp=2, rank=1, heads=2)
    planner = TransferPlanner(p, d)
    full = planner.plan_kv(np.array([0, 1]), np.array([5, 6]))
    layer1 = select_buffers(full, (1, 3))
    assert {t.local_index for t in layer1.transfers} == {1, 3}
    assert as_tuples(layer1) == [x for x in as_tuples(full) if x[0] in (1, 3)]
    assert select_buffers(full, None) is full


@pytest.mark.parametrize("state, writes_nothing", [
    (None, True),
    ([], True),  # SGLang's last send() for a model without state types (a plain Llama)
    ([None, None], True),  # components SGLang has no payload for
    ([np.arange(2)], False),
    ([None, np.arange(0)], False),  # a component with a payload, even empty, goes to the planner
])
def test_a_fully_streamed_last_chunk_writes_nothing_unless_it_carries_state(state, writes_nothing):
    chunk = selected_chunk(3, np.arange(4), slice(0, 4), True, [], aux_index=0, state_indices=state)
    assert chunk.writes_nothing is writes_nothing
    assert selected_chunk(3, np.arange(4), slice(0, 4), True, [(0, 1, None)], aux_index=0,
                          state_indices=state).writes_nothing is False  # a page still to write
