"""PrefillCP (backend/prefill/context_parallel.py) and the shard page filter (planning/kv_shard.py)
against SGLang 0.5.23's own rules: which CP rank sends replicated state, which CP ranks a decode
waits for, and which pages a shard rank stores."""

from __future__ import annotations

import itertools
import re
from types import SimpleNamespace
from unittest import mock

import numpy as np
import pytest

from sglang_mori import protocol
from sglang_mori.backend.prefill.context_parallel import PrefillCP
from sglang_mori.planning import PlanError, UnsupportedLayoutError
from sglang_mori.planning.kv_shard import owned_pages


def _sglang_conn():
    from sglang.srt.disaggregation.common import conn

    return conn


def test_replicated_state_rule_is_sglangs():
    """Our rule gives SGLang's `_should_skip_cp_replicated_state_transfer` verdict on every
    combination of CP size/rank, DSA layer split, CP-TP group sharing and KV sharding."""
    conn = _sglang_conn()
    for cp_size, split, sharing, shard in itertools.product((1, 2, 4), (False, True), (False, True), (1, 2)):
        for cp_rank in range(cp_size):
            mgr = SimpleNamespace(attn_cp_size=cp_size, attn_cp_rank=cp_rank, kv_shard_size=shard)
            parallel = SimpleNamespace(enable_dsa_cache_layer_split=split, enable_cp_tp_group_sharing=sharing)
            with mock.patch.object(conn, "get_parallel", lambda: parallel):
                theirs = conn.CommonKVManager._should_skip_cp_replicated_state_transfer(mgr)
            ours = PrefillCP(cp_size=cp_size, cp_rank=cp_rank, dsa_layer_split=split, tp_group_sharing=sharing,
                             kv_shard_size=shard, kv_shard_rank=cp_rank % shard).skips_replicated_state
            assert ours == theirs, (cp_size, cp_rank, split, sharing, shard)


def _decode_targets(cp_size: int, decode_all: bool, prefill_sharded: bool):
    """(CP ranks SGLang's decode sends metadata to, Successes it waits for): its real
    `_resolve_rank_mapping` for a TP 1 decode and a TP 1, PP 1 prefill of CP `cp_size`."""
    conn = _sglang_conn()
    decode = SimpleNamespace(is_mla_backend=False, is_hybrid_mla_backend=False, attn_tp_size=1,
                             kv_args=SimpleNamespace(engine_rank=0), attn_cp_size=1, attn_cp_rank=0,
                             enable_all_cp_ranks_for_transfer=decode_all, pp_size=1, pp_rank=0)
    info = conn.PrefillServerInfo(attn_tp_size=1, attn_cp_size=cp_size, dp_size=1, pp_size=1, page_size=1,
                                  kv_cache_dtype="bfloat16", follow_bootstrap_room=True,
                                  enable_kv_cache_sharding=prefill_sharded)
    conn.CommonKVManager._resolve_rank_mapping(decode, info)
    return info.target_cp_ranks, info.required_prefill_response_num


@pytest.mark.parametrize("cp_size", [2, 3])
def test_accepted_decodes_wait_for_exactly_the_cp_ranks_that_send(cp_size):
    """For every combination of the two sides' flags (SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER
    on prefill / decode, a hybrid-MLA pool, KV sharding): when no CP rank decode registers with
    refuses it, decode sends metadata to and waits for a Success from exactly the CP ranks that
    send one (every rank, or rank 0 only: dummies send none); and a decode is refused only when
    those two sets differ."""
    for prefill_env, decode_env, hybrid, sharded in itertools.product((False, True), repeat=4):
        # CommonKVManager.__init__: a hybrid-MLA pool makes both sides use every CP rank.
        prefill_all = prefill_env or hybrid or sharded
        decode_all = decode_env or hybrid
        ranks = [PrefillCP(cp_size=cp_size, cp_rank=r, all_ranks_send=prefill_all,
                           kv_shard_size=cp_size if sharded else 1, kv_shard_rank=r if sharded else 0)
                 for r in range(cp_size)]
        targets, required = _decode_targets(cp_size, decode_all, sharded)
        senders = list(range(cp_size)) if prefill_all else [0]
        refused = []
        for r in targets:
            try:
                ranks[r].check_decode(decode_all_cp_ranks=decode_all, decode_tp_size=1,
                                      state_types=[])
            except UnsupportedLayoutError as exc:
                refused.append(str(exc))
        case = dict(prefill_env=prefill_env, decode_env=decode_env, hybrid=hybrid, sharded=sharded)
        assert bool(refused) == (sorted(targets) != senders or required != len(senders)), case
        if refused:  # every rank decode reaches refuses it, so none sends part of the request
            assert len(refused) == len(targets), case


def test_refusals_name_both_sides():
    def refusal(cp, **kw):
        args = dict(decode_all_cp_ranks=False, decode_tp_size=2, state_types=[])
        args.update(kw)
        with pytest.raises(UnsupportedLayoutError) as info:
            cp.check_decode(**args)
        return str(info.value)

    assert "prefill attn_cp_size=2 cp_rank=1 with CP-TP group sharing (registered as attention TP 2), decode " \
           "attn_tp_size=2" in refusal(PrefillCP(cp_size=2, cp_rank=1, tp_group_sharing=True))
    assert "prefill attn_cp_size=2 cp_rank=0 with --enable-dsa-cache-layer-split, decode attn_tp_size=2" in \
        refusal(PrefillCP(cp_size=2, dsa_layer_split=True, all_ranks_send=True), decode_all_cp_ranks=True)


def test_aux_has_one_owner_per_decode_rank():
    """CP and shard ranks all hold the request's aux; one of them sends it. Under CP-TP group
    sharing each CP rank is the only prefill rank of its decode rank, so each sends it."""
    assert [PrefillCP(cp_size=3, cp_rank=r, all_ranks_send=True).owns_aux for r in range(3)] == [True, False, False]
    assert [PrefillCP(cp_size=2, cp_rank=r, kv_shard_size=2, kv_shard_rank=r).owns_aux for r in range(2)] == \
        [True, False]
    # MLA sharded over attention TP (CP 1): shard rank 0 only.
    assert [PrefillCP(kv_shard_size=4, kv_shard_rank=r).owns_aux for r in range(4)] == [True, False, False, False]
    assert all(PrefillCP(cp_size=2, cp_rank=r, tp_group_sharing=True).owns_aux for r in range(2))


def test_from_manager_reads_sglangs_values():
    mgr = SimpleNamespace(attn_cp_size=4, attn_cp_rank=3, enable_all_cp_ranks_for_transfer=True,
                          kv_shard_size=4, kv_shard_rank=3)
    parallel = SimpleNamespace(enable_cp_tp_group_sharing=False, enable_dsa_cache_layer_split=True)
    from sglang_mori.backend.sglang_fields import prefill_cp

    assert prefill_cp(mgr, parallel) == PrefillCP(
        cp_size=4, cp_rank=3, all_ranks_send=True, dsa_layer_split=True, kv_shard_size=4, kv_shard_rank=3)


@pytest.mark.parametrize("shard_size", [2, 3, 4])
def test_owned_pages_are_sglangs_shard_filter_and_cover_every_page_once(shard_size):
    from sglang.srt.disaggregation.utils import filter_kv_indices_for_shard_rank

    rng = np.random.default_rng(shard_size)
    src = rng.permutation(40)[:17]
    dst = rng.permutation(100)[:17]
    seen = []
    for rank in range(shard_size):
        local, to = owned_pages(src, dst, rank, shard_size)
        theirs, positions = filter_kv_indices_for_shard_rank(
            kv_indices=src.astype(np.int32), index_slice=slice(0, len(src)), shard_rank=rank, shard_size=shard_size)
        np.testing.assert_array_equal(local, theirs)
        np.testing.assert_array_equal(to, dst[positions])
        seen += [(int(lo) * shard_size + rank, int(d)) for lo, d in zip(local, to)]
    assert sorted(seen) == sorted(zip(src.tolist(), dst.tolist()))


def test_owned_pages_refuse_unpaired_lists():
    with pytest.raises(PlanError, match="prefill=3 decode=2"):
        owned_pages([1, 2, 3], [4, 5], 0, 2)
    with pytest.raises(PlanError, match="kv_shard_rank=2 with kv_shard_size=2"):
        owned_pages([1], [1], 2, 2)


def test_register_carries_decodes_cp_flag():
    message = protocol.Register(engine_desc=b"e", kv_descs=[], aux_descs=[], decode_ip="127.0.0.1", decode_port=1,
                                layout=b"l", cp_all_ranks=True)
    assert protocol.decode(protocol.encode(message)).cp_all_ranks is True
    assert protocol.Register(engine_desc=b"e", kv_descs=[], aux_descs=[], decode_ip="h", decode_port=1,
                             layout=b"l").cp_all_ranks is False


def test_manager_builds_its_cp_place_from_sglang_and_applies_it():
    """MoriKVManager's wiring: PrefillCP from the manager and get_parallel(), aux from the last
    PP stage's owner only, replicated state dropped on CP ranks other than 0."""
    from sglang_mori.backend.manager import MoriKVManager
    from sglang_mori.backend.sglang_fields import prefill_cp

    mgr = SimpleNamespace(attn_cp_size=2, attn_cp_rank=1, enable_all_cp_ranks_for_transfer=True, kv_shard_size=1,
                          kv_shard_rank=0, pp_rank=0, pp_size=1)
    parallel = SimpleNamespace(enable_cp_tp_group_sharing=False, enable_dsa_cache_layer_split=False)
    mgr.cp = prefill_cp(mgr, parallel)
    assert mgr.cp == PrefillCP(cp_size=2, cp_rank=1, all_ranks_send=True)
    state = [np.arange(3)]
    assert MoriKVManager.prepare_send_state_indices(mgr, state) is None
    assert MoriKVManager._owns_aux(mgr, mgr.cp) is False
    rank0 = SimpleNamespace(cp=PrefillCP(cp_size=2, cp_rank=0, all_ranks_send=True), pp_rank=1, pp_size=2)
    assert MoriKVManager.prepare_send_state_indices(rank0, state) is state
    assert MoriKVManager._owns_aux(rank0, rank0.cp) is True
    rank0.pp_rank = 0  # not the last stage: no aux
    assert MoriKVManager._owns_aux(rank0, rank0.cp) is False


# docs/compatibility.md's CP rows: the verdict each states is the one PrefillCP gives.
_CP2 = dict(cp_size=2)
DOC_ROWS = {
    "Prefill CP (`--enable-prefill-cp`), CP rank 0 sends (SGLang's default)": [
        (PrefillCP(**_CP2), dict(decode_all_cp_ranks=False))],
    "Prefill CP, every CP rank sends (`SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER=1` on both servers, or a "
    "hybrid-MLA pool)": [(PrefillCP(**_CP2, cp_rank=r, all_ranks_send=True), dict(decode_all_cp_ranks=True))
                         for r in (0, 1)],
    "Prefill CP, `SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER` set on one server only": [
        (PrefillCP(**_CP2, all_ranks_send=True), dict(decode_all_cp_ranks=False))],
    "KV sharding (`--enable-kv-cache-sharding`), DSA index state": [
        (PrefillCP(**_CP2, cp_rank=1, all_ranks_send=True, kv_shard_size=2, kv_shard_rank=1),
         dict(state_types=["dsa"]))],
    "KV sharding with state other than DSA": [
        (PrefillCP(**_CP2, all_ranks_send=True, kv_shard_size=2), dict(state_types=["dsa", "swa"]))],
    "Prefill CP with CP-TP group sharing (Qwen4Exp prefill CP)": [
        (PrefillCP(**_CP2, tp_group_sharing=True), dict())],
    "DSA cache layer split (`--enable-dsa-cache-layer-split`)": [
        (PrefillCP(**_CP2, all_ranks_send=True, dsa_layer_split=True), dict(decode_all_cp_ranks=True))],
}


@pytest.mark.parametrize("name", sorted(DOC_ROWS))
def test_compatibility_doc_rows_state_prefill_cps_verdict(name):
    from test_docs_compatibility import rows

    table = rows()
    assert name in table, f"docs/compatibility.md lost the row {name!r}"
    ours = table[name]["Ours"]
    for cp, overrides in DOC_ROWS[name]:
        args = dict(decode_all_cp_ranks=False, decode_tp_size=2, state_types=[])
        args.update(overrides)
        if ours.startswith("served"):
            cp.check_decode(**args)
        else:
            quoted = re.search(r"`([^`]+)`", ours).group(1)
            with pytest.raises(UnsupportedLayoutError) as refusal:
                cp.check_decode(**args)
            assert quoted in str(refusal.value), (quoted, str(refusal.value))
