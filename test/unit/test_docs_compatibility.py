"""docs/compatibility.md tells the truth about ours: every test it names exists, and where a row's
verdict is a registration check, the planner gives that verdict on two layouts of that shape.

A row reads "served", "refused at registration: `message`" or "not yet tested" in its "Ours"
column. For the rows in CHECKS we build the prefill and decode layouts of the configuration and run
the registration check: "served" must pass it, "refused at registration" must fail it with the
quoted message. Renaming or deleting a named test, or changing the planner's verdict, fails here.
"""

import ast
import re
from functools import lru_cache
from pathlib import Path

import pytest

from sglang_mori.planning import KVLayout, PlanningError, StateLayout, check_compatible

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "compatibility.md"
TEST_REF = re.compile(r"`(test/[\w/]+\.py)::(\w+)(?:\[[^\]`]*\])?`")
STATUSES = ("served", "refused at registration: ", "not yet tested")
COLUMNS = ["Configuration", "Ours", "SGLang built-in mori", "Mooncake", "Tests (ours)"]


def rows():
    """{configuration: {column: cell}} from the table of the doc."""
    lines = [line.strip() for line in DOC.read_text().splitlines() if line.strip().startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header == COLUMNS
    table = {}
    for line in lines[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert len(cells) == len(COLUMNS), line
        assert cells[0] not in table, f"row {cells[0]!r} appears twice"
        table[cells[0]] = dict(zip(COLUMNS, cells))
    return table


@lru_cache(maxsize=None)
def functions(path: str) -> frozenset:
    tree = ast.parse((REPO / path).read_text())
    return frozenset(n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))


def test_every_named_test_exists():
    missing = []
    for name, row in rows().items():
        for path, function in TEST_REF.findall(row["Tests (ours)"]):
            if not (REPO / path).is_file() or function not in functions(path):
                missing.append(f"{name}: {path}::{function}")
    assert not missing, "docs/compatibility.md names tests that do not exist:\n" + "\n".join(missing)


def test_every_row_has_a_verdict_and_served_rows_name_their_tests():
    for name, row in rows().items():
        ours = row["Ours"]
        assert ours.startswith(STATUSES), f"{name}: 'Ours' must start with one of {STATUSES}"
        assert "then wrong" not in ours.lower(), name
        if ours.startswith(("served", "refused")):
            assert TEST_REF.search(row["Tests (ours)"]), f"{name}: no test named for {ours.split(' ')[0]!r}"


# --- the registration verdicts ------------------------------------------------------------

def mha(tp=1, rank=0, heads=4, page=16, **fields):
    per_rank = max(1, heads // tp)
    item = page * per_rank * 16
    values = dict(is_mla=False, tp_size=tp, tp_rank=rank, page_size=page, kv_cache_dtype="bfloat16",
                  kv_item_lens=(item,) * 4, kv_data_lens=(item * 64,) * 4, kv_head_num=per_rank,
                  total_kv_head_num=heads)
    values.update(fields)
    return KVLayout(**values)


def mla(tp=1, rank=0, **fields):
    values = dict(is_mla=True, tp_size=tp, tp_rank=rank, page_size=16, kv_cache_dtype="bfloat16",
                  kv_item_lens=(16 * 576,) * 3, kv_data_lens=(16 * 576 * 64,) * 3)
    values.update(fields)
    return KVLayout(**values)


def states(*specs):
    return tuple(StateLayout(state_type=t, item_lens=tuple(items), data_lens=tuple(i * 32 for i in items), **extra)
                 for t, items, extra in specs)


def mamba(tp):
    # Qwen3-Next-like layer: conv [q | k | v] and temporal state, sharded over TP.
    conv, temporal = 32 // tp, 8 // tp
    return states(("mamba", [conv * 6, temporal * 64],
                   dict(slice_dims=(conv, temporal), outer_counts=(1, 1), conv_groups=((8, 8, 16), ()))))


def swa_state(tp):
    item = 16 * (4 // tp) * 16
    return states(("swa", [item] * 4, {}))


CHECKS = {
    "DeepSeek-V3/R1 MLA, equal TP": lambda: (mla(), mla()),
    "MLA, prefill TP ≠ decode TP": lambda: (mla(4, 3), mla(2, 1)),
    "MTP/EAGLE draft KV": lambda: (
        mla(kv_item_lens=(9216,) * 4, kv_data_lens=(9216 * 64,) * 4, num_draft_entries=1),
        mla(kv_item_lens=(9216,) * 4, kv_data_lens=(9216 * 64,) * 4, num_draft_entries=1)),
    "MTP/EAGLE draft aux (hidden states, top-k)": lambda: (
        mla(aux_item_lens=(8, 4096), aux_data_lens=(800, 409600)),
        mla(aux_item_lens=(8, 4096, 64), aux_data_lens=(800, 409600, 6400))),
    "DeepSeek-V4 state types (`swa` on MLA, `swa_ring`, `c128_state`, `request_row`; `kv_layout`)": lambda: (
        mla(2, 1, kv_layout="dsv4", states=states(("swa", [64], {}), ("swa_ring", [32], {}),
                                                     ("c128_state", [128], {}), ("request_row", [4], {}))),
        mla(1, 0, kv_layout="dsv4", states=states(("swa", [64], {}), ("swa_ring", [32], {}),
                                                     ("c128_state", [128], {}), ("request_row", [4], {})))),
    "DeepSeek-V3.2 DSA index cache and tail (`dsa`, `dsa_tail`)": lambda: (
        mla(4, 2, states=states(("dsa", [132, 0], {}), ("dsa_tail", [96, 0], {}))),
        mla(2, 1, states=states(("dsa", [132, 0], {}), ("dsa_tail", [128, 0], {})))),
    "Qwen3 dense/MoE (GQA), equal TP": lambda: (mha(2, 1), mha(2, 1)),
    "MHA/GQA, prefill TP ≠ decode TP": lambda: (mha(1, 0), mha(2, 1)),
    "Qwen3-Next hybrid mamba, equal TP": lambda: (mha(2, 0, states=mamba(2)), mha(2, 0, states=mamba(2))),
    "Qwen3-Next hybrid mamba, prefill TP ≠ decode TP": lambda: (mha(1, 0, states=mamba(1)),
                                                                mha(2, 1, states=mamba(2))),
    "SWA models, equal TP": lambda: (mha(states=swa_state(1)), mha(states=swa_state(1))),
    "SWA (non-MLA), prefill TP ≠ decode TP": lambda: (mha(2, 1, states=swa_state(2), swa_physical_layout="nhd"),
                                                      mha(1, 0, states=swa_state(1), swa_physical_layout="nhd")),
    "QSA state (`qsa_pending`, `qsa_compressed`)": lambda: (
        mha(4, 1, states=states(("qsa_pending", [256], {}), ("qsa_compressed", [64], {}))),
        mha(2, 0, states=states(("qsa_pending", [256], {}), ("qsa_compressed", [64], {})))),
    "MiniMax sparse state (`minimax_index_k`, `minimax_dense_kv`), equal TP": lambda: (
        mha(2, 1, states=states(("minimax_index_k", [64], {}), ("minimax_dense_kv", [512], {}))),
        mha(2, 1, states=states(("minimax_index_k", [64], {}), ("minimax_dense_kv", [512], {})))),
    "MiniMax sparse state, prefill TP ≠ decode TP": lambda: (
        mha(1, 0, states=states(("minimax_index_k", [64], {}))),
        mha(2, 1, states=states(("minimax_index_k", [64], {})))),
    "MXFP8 KV block scales (`block_scale`, `block_scale_swa`), equal TP": lambda: (
        mha(kv_cache_dtype="mxfp8", states=states(("block_scale", [64] * 4, {}))),
        mha(kv_cache_dtype="mxfp8", states=states(("block_scale", [64] * 4, {})))),
    "MXFP8 KV block scales, prefill TP ≠ decode TP": lambda: (
        mha(1, 0, states=states(("block_scale", [64] * 4, {}))),
        mha(2, 1, states=states(("block_scale", [32] * 4, {})))),
    "Physical KV layout, equal on both sides (nhd, vectorized_5d)": lambda: (
        mha(1, 0, kv_physical_layout="vectorized_5d"), mha(2, 1, kv_physical_layout="vectorized_5d")),
    "Physical KV layout differs between the sides": lambda: (
        mha(kv_physical_layout="vectorized_5d"), mha(kv_physical_layout="nhd")),
    "KV layout a head slice cannot cut, prefill TP ≠ decode TP": lambda: (
        mha(1, 0, kv_physical_layout="page_major"), mha(2, 1, kv_physical_layout="page_major")),
    "Page sizes 1, 16, 64": lambda: (mha(page=64), mha(page=64)),
    "Page size differs between the sides": lambda: (mha(page=16), mha(page=64)),
    "Decode context parallel (`--dcp-size > 1`), MLA and hybrid MLA (prefill DCP 1 into decode DCP N)":
        lambda: (mla(), mla(dcp_size=2, dcp_rank=1)),
    "Decode context parallel with MHA KV": lambda: (mha(), mha(dcp_size=2, dcp_rank=1)),
    "Prefill DCP > 1 into a decode of another DCP size": lambda: (mla(dcp_size=2, dcp_rank=1),
                                                                 mla(dcp_size=4, dcp_rank=3)),
    "Equal DCP sizes, different DCP ranks": lambda: (mla(dcp_size=2, dcp_rank=0), mla(dcp_size=2, dcp_rank=1)),
}


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_the_planner_gives_the_verdict_the_row_states(name):
    table = rows()
    assert name in table, f"docs/compatibility.md lost the row {name!r}"
    ours = table[name]["Ours"]
    prefill, decode = CHECKS[name]()
    if ours.startswith("served"):
        check_compatible(prefill, decode)
    elif ours.startswith("refused at registration"):
        quoted = re.search(r"`([^`]+)`", ours)
        assert quoted, f"{name}: quote the refusal message"
        with pytest.raises(PlanningError) as refusal:
            check_compatible(prefill, decode)
        assert quoted.group(1) in str(refusal.value), (quoted.group(1), str(refusal.value))
    else:
        pytest.fail(f"{name}: a row with a planner check must read 'served' or 'refused at registration'")
