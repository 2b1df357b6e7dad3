"""KVLayout, registration checks (errors name both sides) and layer mapping."""

import ast
import enum
import importlib.util
import inspect
import textwrap
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest

import sglang_mori.planning.layout as layout_module
from sglang_mori.planning import (
    STATE_KINDS,
    InvalidLayoutError,
    KVLayout,
    LayoutMismatchError,
    PlanError,
    StateLayout,
    TransferPlanner,
    UnsupportedLayoutError,
    check_compatible,
    map_kv_buffers,
)

PAGE = 16
ITEM = PAGE * 2 * 8 * 2  # page_size * heads * head_dim * dtype size


def kv(n_buffers=4, **fields) -> KVLayout:
    values = dict(
        is_mla=False, tp_size=1, tp_rank=0, page_size=PAGE, kv_cache_dtype="bfloat16",
        kv_item_lens=(ITEM,) * n_buffers, kv_data_lens=(ITEM * 32,) * n_buffers,
        kv_head_num=2, total_kv_head_num=2,
    )
    values.update(fields)
    return KVLayout(**values)


def sglang_source(relative_path: str) -> ast.Module:
    root = Path(importlib.util.find_spec("sglang").submodule_search_locations[0])
    return ast.parse((root / relative_path).read_text())


# --- KVLayout -------------------------------------------------------------------------------

def test_layout_round_trips_through_msgspec():
    layout = kv(
        kv_layer_ids=(0, 1, 0, 1), aux_item_lens=(8, 64), aux_data_lens=(800, 6400),
        states=(StateLayout(state_type="swa", item_lens=(32, 32), data_lens=(320, 320)),),
    )
    for codec in (msgspec.msgpack, msgspec.json):
        assert codec.decode(codec.encode(layout), type=KVLayout) == layout


def test_self_contradicting_layouts_are_rejected_on_construction_and_on_decode():
    with pytest.raises(InvalidLayoutError, match="3 KV item lengths for 4 KV buffers"):
        kv(kv_item_lens=(ITEM,) * 3)
    with pytest.raises(InvalidLayoutError, match="tp_rank=2 with tp_size=2"):
        kv(tp_size=2, tp_rank=2)
    with pytest.raises(InvalidLayoutError, match="layer ids"):
        StateLayout(state_type="mamba", item_lens=(4,), data_lens=(40,), layer_ids=(1, 2))
    bad = msgspec.msgpack.encode(msgspec.structs.asdict(kv()) | {"page_size": 0})
    with pytest.raises(msgspec.ValidationError, match="page_size"):
        msgspec.msgpack.decode(bad, type=KVLayout)


class FakeStateType(str, enum.Enum):  # SGLang's StateType is a str enum like this one
    SWA = "swa"


def prefill_kv_args():
    """A KVArgs as prefill.py fills it (only the attributes a layout reads)."""
    return SimpleNamespace(
        engine_rank=5, kv_data_ptrs=[1, 2], kv_data_lens=[ITEM * 8, ITEM * 8],
        kv_item_lens=[ITEM, ITEM], kv_layer_ids=[], kv_cache_dtype_str="bfloat16", kv_layout=None,
        num_draft_entries=0, prefill_start_layer=3, kv_head_num=2, total_kv_head_num=8,
        page_size=PAGE, aux_data_lens=[80], aux_item_lens=[8], state_types=[FakeStateType.SWA],
        state_data_lens=[[640]], state_item_lens=[[64]], state_layer_ids=[[3]],
        is_hybrid_mla_backend=False,
    )


def test_from_kv_args_reads_the_prefill_side():
    layout = KVLayout.from_kv_args(prefill_kv_args(), tp_size=4, tp_rank=5, is_mla=False)
    assert layout.tp_rank == 1  # global rank 5 -> attention-TP rank 1
    assert layout.kv_item_lens == (ITEM, ITEM) and layout.kv_capacities() == (8, 8)
    assert (layout.start_layer, layout.kv_head_num, layout.total_kv_head_num) == (3, 2, 8)
    assert layout.states == (
        StateLayout(state_type="swa", item_lens=(64,), data_lens=(640,), layer_ids=(3,)),
    )
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(layout), type=KVLayout) == layout


def test_from_kv_args_tolerates_what_decode_leaves_unset():
    args = prefill_kv_args()
    for name in ("prefill_start_layer", "kv_head_num", "total_kv_head_num", "state_types",
                 "state_item_lens", "state_data_lens", "state_layer_ids"):
        delattr(args, name)
    args.is_hybrid_mla_backend = True
    layout = KVLayout.from_kv_args(args, tp_size=2, tp_rank=1, is_mla=False)
    assert layout.is_mla  # hybrid MLA pools transfer like MLA
    assert (layout.start_layer, layout.total_heads(), layout.states) == (0, 0, ())


def test_from_kv_args_reads_only_attributes_sglang_kvargs_declares():
    tree = sglang_source("srt/disaggregation/base/conn.py")
    kvargs = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "KVArgs")
    declared = {n.target.id for n in kvargs.body if isinstance(n, ast.AnnAssign)}
    source = ast.parse(textwrap.dedent(inspect.getsource(layout_module.KVLayout.from_kv_args)))
    read = {
        call.args[0].value
        for call in ast.walk(source)
        if isinstance(call, ast.Call) and getattr(call.func, "id", None) == "attr"
    }
    assert "kv_item_lens" in read and len(read) > 10
    assert read <= declared, read - declared


def test_supported_state_types_are_sglang_state_types():
    tree = sglang_source("srt/disaggregation/base/conn.py")
    enum_class = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "StateType")
    values = {n.value.value for n in enum_class.body if isinstance(n, ast.Assign)}
    assert set(STATE_KINDS) == values  # every state type SGLang sends has a rule here


def test_from_kv_args_reads_mamba_slice_metadata():
    args = prefill_kv_args()
    args.state_types = ["mamba"]
    args.state_item_lens, args.state_data_lens, args.state_layer_ids = [[96, 64]], [[960, 640]], [[1, 1]]
    args.state_dim_per_tensor, args.state_slice_outer_counts = [[32, 8]], [[1, 1]]
    args.state_conv_shard_groups = [[[16, 16, 32], None]]
    state = KVLayout.from_kv_args(args, tp_size=2, tp_rank=0, is_mla=False).states[0]
    assert (state.slice_dims, state.outer_counts, state.conv_groups) == ((32, 8), (1, 1), ((16, 16, 32), ()))


# --- registration checks -----------------------------------------------------------------

@pytest.mark.parametrize(
    "field, prefill, decode, message",
    [
        ("page_size", {"page_size": 16}, {"page_size": 64}, "page_size: prefill=16 decode=64"),
        ("dtype", {}, {"kv_cache_dtype": "fp8_e4m3"}, "kv_cache_dtype: prefill=bfloat16 decode=fp8_e4m3"),
        ("mla", {}, {"is_mla": True}, "is_mla: prefill=False decode=True"),
        ("aux", {"aux_item_lens": (8,), "aux_data_lens": (80,)},
         {"aux_item_lens": (16,), "aux_data_lens": (160,)}, r"aux_item_lens: prefill=\[8\] decode=\[16\]"),
        ("heads", {"tp_size": 2, "tp_rank": 0, "kv_head_num": 1},
         {"tp_size": 1, "total_kv_head_num": 4, "kv_head_num": 4}, "total_kv_head_num: prefill=2 decode=4"),
        ("rank", {"tp_size": 2, "tp_rank": 0, "kv_head_num": 1}, {"tp_size": 2, "tp_rank": 1, "kv_head_num": 1},
         "tp_rank: prefill=0/2 decode=1/2"),
        ("item", {}, {"kv_item_lens": (ITEM, ITEM, 2 * ITEM, ITEM)}, f"KV buffer 2->2 item_len: prefill={ITEM} decode={2 * ITEM}"),
        ("states", {"states": (StateLayout(state_type="swa", item_lens=(4,), data_lens=(40,)),)}, {},
         r"state_types: prefill=\['swa'\] decode=\[\]"),
    ],
)
def test_mismatches_name_both_values(field, prefill, decode, message):
    with pytest.raises(LayoutMismatchError, match=message):
        check_compatible(kv(**prefill), kv(**decode))


def test_aux_buffer_counts_may_differ_when_the_leading_buffers_match():
    # SGLang pairs aux buffers by position: an extra optional buffer on one side is not an error.
    base = {"aux_item_lens": (8, 64), "aux_data_lens": (80, 640)}
    extra = {"aux_item_lens": (8, 64, 4), "aux_data_lens": (80, 640, 40)}
    check_compatible(kv(**base), kv(**extra))
    check_compatible(kv(**extra), kv(**base))
    # ...but the buffers both sides have must agree, or fields would mix.
    shifted = {"aux_item_lens": (4, 8, 64), "aux_data_lens": (40, 80, 640)}
    with pytest.raises(LayoutMismatchError, match=r"aux_item_lens: prefill=\[8, 64\] decode=\[4, 8, 64\]"):
        check_compatible(kv(**base), kv(**shifted))


def test_tp_mismatch_item_lengths_must_match_the_head_split():
    # TP 1 -> 2 with 2 heads: decode pages hold 1 head, so half the prefill item length.
    prefill = kv(n_buffers=2)
    decode = kv(n_buffers=2, tp_size=2, tp_rank=1, kv_head_num=1, kv_item_lens=(ITEM, ITEM))
    with pytest.raises(LayoutMismatchError, match=f"KV buffer 0->0 item_len: prefill={ITEM} decode={ITEM}"):
        check_compatible(prefill, decode)
    good = kv(n_buffers=2, tp_size=2, tp_rank=1, kv_head_num=1, kv_item_lens=(ITEM // 2,) * 2,
              kv_data_lens=(ITEM * 16,) * 2)
    assert TransferPlanner(prefill, good).head_slice.num_heads == 1


def test_tp_mismatch_needs_a_head_count_from_some_side():
    prefill = kv(n_buffers=2, kv_head_num=0, total_kv_head_num=0)
    decode = kv(n_buffers=2, tp_size=2, kv_head_num=0, total_kv_head_num=0, kv_item_lens=(ITEM // 2,) * 2)
    with pytest.raises(UnsupportedLayoutError, match="total_kv_head_num"):
        check_compatible(prefill, decode)
    TransferPlanner(kv(n_buffers=2), decode)  # the prefill's count is enough


def test_mla_pairs_any_ranks_without_head_slicing():
    prefill = kv(n_buffers=3, is_mla=True, tp_size=4, tp_rank=3, kv_head_num=0, total_kv_head_num=0)
    decode = kv(n_buffers=3, is_mla=True, tp_size=2, tp_rank=0, kv_head_num=0, total_kv_head_num=0)
    planner = TransferPlanner(prefill, decode)
    assert planner.head_slice is None
    plan = planner.plan_kv([1, 2, 3], [7, 8, 9])
    assert plan.num_ranges == 3 and plan.total_bytes == 3 * 3 * ITEM


# --- layer mapping -----------------------------------------------------------------------

def test_equal_counts_map_directly():
    assert map_kv_buffers(kv(), kv()) == ((0, 0), (1, 1), (2, 2), (3, 3))


def test_decode_with_draft_layers_gets_main_layers_only():
    # decode: [K0 K1, V0 V1, draft K, draft V]; prefill: [K0 K1, V0 V1].
    decode = kv(n_buffers=6, num_draft_entries=2)
    assert map_kv_buffers(kv(), decode) == ((0, 0), (1, 1), (2, 2), (3, 3))
    # 3 main layers + 1 draft layer, where a ratio-based guess would misplace V.
    decode = kv(n_buffers=8, num_draft_entries=2)
    assert map_kv_buffers(kv(n_buffers=6), decode) == ((0, 0), (1, 1), (2, 2), (3, 3), (4, 4), (5, 5))


def test_pp_stage_maps_into_the_full_decode_model():
    prefill = kv(n_buffers=4, start_layer=2)  # layers 2,3 of a 4-layer model: [K2 K3 V2 V3]
    decode = kv(n_buffers=8)  # [K0..K3, V0..V3]
    assert map_kv_buffers(prefill, decode) == ((0, 2), (1, 3), (2, 6), (3, 7))
    mla = dict(is_mla=True, kv_head_num=0, total_kv_head_num=0)
    assert map_kv_buffers(kv(n_buffers=2, start_layer=1, **mla), kv(n_buffers=4, **mla)) == ((0, 1), (1, 2))
    with pytest.raises(LayoutMismatchError, match=r"KV layers: prefill=\[3, 5\) decode=\[0, 4\)"):
        map_kv_buffers(kv(n_buffers=4, start_layer=3), decode)


def test_prefill_and_decode_draft_entries_map_to_each_other():
    prefill = kv(n_buffers=6, start_layer=2, num_draft_entries=2)  # PP last stage + draft
    decode = kv(n_buffers=10, num_draft_entries=2)
    assert map_kv_buffers(prefill, decode) == ((0, 2), (1, 3), (2, 6), (3, 7), (4, 8), (5, 9))
    with pytest.raises(LayoutMismatchError, match="num_draft_entries: prefill=2 decode=0"):
        map_kv_buffers(kv(n_buffers=6, num_draft_entries=2), kv(n_buffers=8))


def test_layer_ids_pair_k_and_v_by_occurrence():
    prefill = kv(n_buffers=4, kv_layer_ids=(3, 7, 3, 7))  # hybrid pool: full-attention layers only
    decode = kv(n_buffers=6, kv_layer_ids=(3, 5, 7, 3, 5, 7))
    assert map_kv_buffers(prefill, decode) == ((0, 0), (1, 2), (2, 3), (3, 5))
    with pytest.raises(LayoutMismatchError, match="KV layer 9"):
        map_kv_buffers(kv(n_buffers=2, kv_layer_ids=(9, 9)), decode)
    with pytest.raises(LayoutMismatchError, match="kv_layer_ids: prefill=4 ids decode=0 ids"):
        map_kv_buffers(prefill, kv(n_buffers=6))


def test_plans_use_the_mapped_decode_buffers():
    plan = TransferPlanner(kv(n_buffers=4, start_layer=2), kv(n_buffers=8)).plan_kv([0], [1])
    assert [(t.local_index, t.remote_index) for t in plan] == [(0, 2), (1, 3), (2, 6), (3, 7)]


# --- per-chunk errors -------------------------------------------------------------------

def test_out_of_range_pages_raise_plan_error_naming_buffer_index_and_limit():
    planner = TransferPlanner(kv(), kv(kv_data_lens=(ITEM * 32,) * 3 + (ITEM * 20,)))
    with pytest.raises(PlanError, match=r"decode KV buffer 3: page index 25 out of range \(limit 20"):
        planner.plan_kv([1, 2], [3, 25])
    with pytest.raises(PlanError, match=r"prefill KV buffer 0: page index 32 out of range \(limit 32"):
        planner.plan_kv([32], [0])
    with pytest.raises(PlanError, match="negative"):
        planner.plan_kv([-1], [0])
    with pytest.raises(PlanError, match="prefill has 2 indices but decode has 1"):
        planner.plan_kv([1, 2], [3])
    assert planner.plan_kv([], []).empty
