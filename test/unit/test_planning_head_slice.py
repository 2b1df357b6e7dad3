"""Head slicing for MHA with different prefill / decode attention-TP sizes."""

import ast
import importlib.util
import itertools
from pathlib import Path

import numpy as np
import pytest

from sglang_mori.planning import (
    UnsupportedLayoutError,
    compute_head_slice,
    decode_ranks_for_prefill_rank,
    head_sliced_ranges,
    rank_heads,
)

TP_SIZES = (1, 2, 4, 8)
HEAD_COUNTS = (1, 2, 4, 8, 16)


def sglang_function(relative_path: str, name: str):
    """Load one pure function from the installed SGLang source without importing SGLang.

    Importing the module pulls in most of SGLang (seconds); the function itself only does
    integer arithmetic, so we compile just its definition.
    """
    root = Path(importlib.util.find_spec("sglang").submodule_search_locations[0])
    tree = ast.parse((root / relative_path).read_text())
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    module = ast.Module(body=[node], type_ignores=[])
    namespace = {"Tuple": tuple, "List": list, "Optional": object}
    exec(compile(module, relative_path, "exec"), namespace)
    return namespace[name]


def splittable(tp, heads):
    return heads % tp == 0 if heads >= tp else tp % heads == 0


def valid_combinations():
    for p_tp, d_tp, heads in itertools.product(TP_SIZES, TP_SIZES, HEAD_COUNTS):
        if splittable(p_tp, heads) and splittable(d_tp, heads):
            yield p_tp, d_tp, heads


def test_same_answer_as_sglang_compute_head_slice_params_for_every_paired_rank():
    sglang = sglang_function(
        "srt/disaggregation/common/staging_buffer.py", "compute_head_slice_params"
    )
    checked = 0
    for p_tp, d_tp, heads in valid_combinations():
        if p_tp == d_tp:
            continue  # SGLang only slices when the sizes differ
        for p_rank in range(p_tp):
            for d_rank in decode_ranks_for_prefill_rank(p_tp, p_rank, d_tp):
                ours = compute_head_slice(p_tp, p_rank, d_tp, d_rank, heads, 128, 2, 16)
                src_start, count, dst_start, _ = sglang(p_tp, d_tp, p_rank, d_rank, heads)
                assert (ours.prefill_head_start, ours.num_heads, ours.decode_head_start) == (
                    src_start, count, dst_start,
                ), (p_tp, p_rank, d_tp, d_rank, heads)
                checked += 1
    assert checked > 100


def test_rank_pairing_matches_sglang_receiver_targets():
    # SGLang's decode side (CommonKVReceiver) targets prefill ranks as follows.
    for p_tp, d_tp in itertools.product(TP_SIZES, TP_SIZES):
        for d_rank in range(d_tp):
            if d_tp >= p_tp:
                targets = [d_rank // (d_tp // p_tp)]
            else:
                ratio = p_tp // d_tp
                targets = list(range(d_rank * ratio, (d_rank + 1) * ratio))
            senders = [p for p in range(p_tp) if d_rank in decode_ranks_for_prefill_rank(p_tp, p, d_tp)]
            assert senders == targets


def test_every_decode_rank_receives_exactly_its_heads():
    """Union over senders of the global heads written equals the decode rank's own heads."""
    for p_tp, d_tp, heads in valid_combinations():
        for d_rank in range(d_tp):
            d_first, d_count = rank_heads(d_tp, d_rank, heads)
            received = set()
            for p_rank in range(p_tp):
                if d_rank not in decode_ranks_for_prefill_rank(p_tp, p_rank, d_tp):
                    continue
                hs = compute_head_slice(p_tp, p_rank, d_tp, d_rank, heads, 4, 1, 1)
                p_first, _ = rank_heads(p_tp, p_rank, heads)
                sent = range(p_first + hs.prefill_head_start, p_first + hs.prefill_head_start + hs.num_heads)
                landed = range(d_first + hs.decode_head_start, d_first + hs.decode_head_start + hs.num_heads)
                assert list(sent) == list(landed)  # a head lands where the decode expects it
                received |= set(sent)
            assert received == set(range(d_first, d_first + d_count)), (p_tp, d_tp, heads, d_rank)


def test_gqa_replication_one_head_per_rank():
    # 2 KV heads, decode TP 4: decode ranks 0,1 hold head 0 and ranks 2,3 hold head 1.
    assert [rank_heads(4, r, 2) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    hs = compute_head_slice(1, 0, 4, 3, 2, head_dim=64, dtype_size=2, page_size=16)
    assert (hs.prefill_head_start, hs.decode_head_start, hs.num_heads) == (1, 0, 1)
    assert (hs.prefill_heads, hs.decode_heads, hs.head_bytes) == (2, 1, 128)
    assert hs.prefill_item_len == 16 * 2 * 128 and hs.decode_item_len == 16 * 128


def test_unpaired_ranks_and_unsplittable_sizes_are_refused():
    with pytest.raises(UnsupportedLayoutError, match="does not send KV to decode rank 1"):
        compute_head_slice(4, 0, 2, 1, 8, 128, 2, 16)
    with pytest.raises(UnsupportedLayoutError, match="one must divide the other"):
        compute_head_slice(2, 0, 3, 0, 6, 128, 2, 16)
    with pytest.raises(UnsupportedLayoutError, match="cannot be split evenly"):
        rank_heads(4, 0, 6)
    with pytest.raises(UnsupportedLayoutError, match="cannot be replicated evenly"):
        rank_heads(4, 0, 3)


def test_partial_heads_give_one_range_per_token_slot():
    hs = compute_head_slice(1, 0, 2, 1, 4, head_dim=2, dtype_size=2, page_size=4)
    lo, ro, sz = head_sliced_ranges(np.array([0, 1]), np.array([5, 6]), hs)
    # prefill token = 4 heads * 4 B = 16 B, decode token = 8 B, slice = heads 2..3 -> 8 B at 8.
    assert sz.tolist() == [8] * 8
    assert lo.tolist() == [8, 24, 40, 56, 72, 88, 104, 120]
    assert ro.tolist() == [5 * 32 + 8 * t for t in range(8)]


def test_whole_token_slices_merge_across_tokens_and_pages():
    # 2 heads, prefill TP 4 -> decode TP 2: one head per rank on both sides (replicated prefill).
    hs = compute_head_slice(4, 2, 2, 1, 2, head_dim=2, dtype_size=2, page_size=4)
    assert hs.whole_tokens
    lo, ro, sz = head_sliced_ranges(np.array([0, 1, 2, 7]), np.array([3, 4, 5, 9]), hs)
    assert sz.tolist() == [3 * 16, 16]
    assert lo.tolist() == [0, 7 * 16] and ro.tolist() == [3 * 16, 9 * 16]
