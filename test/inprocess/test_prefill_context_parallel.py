"""Prefill context parallel (CP) and KV sharding, in one process on softio: two or three prefill
ranks, each a real PrefillService fed by SGLang's own `_prepare_send_indices`, into one decode.

Every test checks the bytes that landed in decode's memory and counts, from decode's softio write
log, how often each byte was written: every page, state item and aux slot must arrive once, from
the rank that holds it, and every rank decode waits for must report Success.
"""

import numpy as np
import pytest

from sglang_mori.backend import room_status as S
from sglang_mori.backend.prefill.context_parallel import PrefillCP

from cp_rig import STATE_ITEM, ContextParallelRig
from rig import AUX_BYTES, BUFFERS, PAGE_BYTES


def _pages(buf: np.ndarray, pages) -> bytes:
    return b"".join(buf[p * PAGE_BYTES:(p + 1) * PAGE_BYTES].tobytes() for p in pages)


def _items(buf: np.ndarray, items) -> bytes:
    return b"".join(buf[i * STATE_ITEM:(i + 1) * STATE_ITEM].tobytes() for i in items)


def _written_once(counts: np.ndarray, item: int, items) -> None:
    """Each byte of `items` written exactly once, no other byte written."""
    expected = np.zeros_like(counts)
    for i in items:
        expected[i * item:(i + 1) * item] = 1
    np.testing.assert_array_equal(counts, expected)


def _finish(rig: ContextParallelRig, room: int) -> list:
    rig.wait_concluded(room)
    statuses = rig.statuses(room)
    for status in statuses:
        rig.decode_service.on_status(status)  # what decode's status thread does with each
    return statuses


def test_all_cp_ranks_send_each_page_once_and_state_and_aux_from_rank_0():
    """SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER on both sides, CP 2, a mamba-like replicated
    state: rank 0 sends pages 0-2 of 5, rank 1 pages 3-4 (one chunk of rank 1's range is empty),
    the state and aux go from rank 0 only, and both ranks report Success."""
    ranks = [PrefillCP(cp_size=2, cp_rank=r, all_ranks_send=True) for r in (0, 1)]
    with ContextParallelRig(ranks, decode_all_cp_ranks=True, state_type="mamba") as rig:
        rig.register()
        assert all(rig.peer(r).rejected is None for r in rig.ranks)
        src, dst = [4, 9, 2, 30, 31], [10, 11, 12, 40, 41]
        rig.request(1, chunks=[src[:2], src[2:]], dst=dst, aux_index=5, src_aux=3, src_state=[7], dst_state=[2])
        statuses = _finish(rig, 1)
        assert sorted((m.prefill_rank, m.status) for m in statuses) == [(0, S.SUCCESS), (1, S.SUCCESS)]
        assert [m.prefill_rank for m in statuses if m.aux] == [0]
        for b in range(BUFFERS):
            assert _pages(rig.decode_kv[b], dst) == _pages(rig.pool["kv"][b], src)
            _written_once(rig.kv_write_counts(b), PAGE_BYTES, dst)
        assert _items(rig.decode_state, [2]) == _items(rig.pool["state"], [7])
        _written_once(rig.state_write_counts(), STATE_ITEM, [2])
        assert rig.decode_aux[5 * AUX_BYTES:6 * AUX_BYTES].tobytes() == rig.pool["aux"][3 * AUX_BYTES:4 * AUX_BYTES].tobytes()
        assert rig.decode_sglang.status(1) == S.SUCCESS


def test_a_cp_rank_with_no_pages_of_the_request_still_reports_success():
    """One page over CP 3: ranks 1 and 2 own no page, send no byte, and report Success."""
    ranks = [PrefillCP(cp_size=3, cp_rank=r, all_ranks_send=True) for r in range(3)]
    with ContextParallelRig(ranks, decode_all_cp_ranks=True) as rig:
        rig.register()
        rig.request(2, chunks=[[6]], dst=[20])
        statuses = _finish(rig, 2)
        assert sorted(m.prefill_rank for m in statuses if m.status == S.SUCCESS) == [0, 1, 2]
        assert _pages(rig.decode_kv[0], [20]) == _pages(rig.pool["kv"][0], [6])
        _written_once(rig.kv_write_counts(0), PAGE_BYTES, [20])


def test_only_cp_rank_0_sends_when_decode_pulls_from_rank_0():
    """SGLang's default: CP ranks other than 0 are dummies. Decode registers with and waits for
    rank 0 only, which sends every page, the state and aux; the dummy's room ends locally."""
    ranks = [PrefillCP(cp_size=2, cp_rank=r) for r in (0, 1)]
    with ContextParallelRig(ranks, decode_all_cp_ranks=False, state_type="mamba") as rig:
        rig.register()
        src, dst = [1, 2, 3], [7, 8, 9]
        rig.request(3, chunks=[src[:2], src[2:]], dst=dst, src_state=[4], dst_state=[5])
        statuses = _finish(rig, 3)
        assert [(m.prefill_rank, m.status, bool(m.aux)) for m in statuses] == [(0, S.SUCCESS, True)]
        assert rig.ranks[1].sglang.status(3) == S.SUCCESS  # SGLang's dummy path, no message
        for b in range(BUFFERS):
            assert _pages(rig.decode_kv[b], dst) == _pages(rig.pool["kv"][b], src)
            _written_once(rig.kv_write_counts(b), PAGE_BYTES, dst)
        _written_once(rig.state_write_counts(), STATE_ITEM, [5])
        for rank in rig.ranks:
            rank.sglang.clear(3)
            rank.service.release(3)
        rig.wait(lambda: all(not any(v for k, v in r.service.debug_snapshot().items()
                                     if k != "prefill.unclaimed_rooms") for r in rig.ranks),
                 "both ranks idle after the room was cleared")


@pytest.mark.parametrize("prefill_all, decode_all", [(True, False), (False, True)])
def test_cp_rank_sets_that_differ_are_refused_at_registration_naming_both_sides(prefill_all, decode_all):
    """SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER on one side only: decode would miss the pages
    of ranks it never asked, or wait for Successes dummies never send. Refused, and the room
    fails at once with the reason instead of transferring part of the request."""
    ranks = [PrefillCP(cp_size=2, cp_rank=r, all_ranks_send=prefill_all) for r in (0, 1)]
    with ContextParallelRig(ranks, decode_all_cp_ranks=decode_all) as rig:
        rig.register()
        rank0 = rig.ranks[0]
        reason = rig.peer(rank0).rejected
        assert reason is not None
        assert f"all_cp_ranks_transfer={prefill_all}" in reason and f"all_cp_ranks_transfer={decode_all}" in reason
        assert "prefill attn_cp_size=2 cp_rank=0" in reason and "SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER" in reason
        rig.request(4, chunks=[[1, 2]], dst=[3, 4])
        rig.wait(lambda: rank0.sglang.status(4) == S.FAILED, "room 4 failed on CP rank 0")
        assert "refused at registration" in rank0.sglang.failure_records[4]
        assert not rig.kv_write_counts(0).any()


def test_kv_sharded_dsa_pages_go_once_from_the_rank_that_stores_them():
    """KV sharding over 2 ranks (logical page l on rank l % 2 as local page l // 2), DSA index
    state striped the same way: SGLang narrows the KV pages, we narrow the DSA pages; every page
    lands once, from its owner, and aux once, from shard rank 0."""
    ranks = [PrefillCP(cp_size=2, cp_rank=r, kv_shard_size=2, kv_shard_rank=r, all_ranks_send=True)
             for r in (0, 1)]
    with ContextParallelRig(ranks, decode_all_cp_ranks=False, state_type="dsa") as rig:
        rig.register()  # decode pulls from every rank because the prefill is sharded
        assert all(rig.peer(r).rejected is None for r in rig.ranks)
        src, dst = [0, 1, 2, 3, 4, 5, 6], [30, 31, 32, 33, 34, 35, 36]
        src_state, dst_state = [8, 9, 10, 11, 12], [20, 21, 22, 23, 24]
        rig.request(5, chunks=[src[:4], src[4:]], dst=dst, aux_index=1, src_aux=2,
                    src_state=src_state, dst_state=dst_state)
        statuses = _finish(rig, 5)
        assert sorted((m.prefill_rank, m.status) for m in statuses) == [(0, S.SUCCESS), (1, S.SUCCESS)]
        assert [m.prefill_rank for m in statuses if m.aux] == [0]
        for b in range(BUFFERS):
            assert _pages(rig.decode_kv[b], dst) == _pages(rig.pool["kv"][b], src)
            _written_once(rig.kv_write_counts(b), PAGE_BYTES, dst)
        assert _items(rig.decode_state, dst_state) == _items(rig.pool["state"], src_state)
        _written_once(rig.state_write_counts(), STATE_ITEM, dst_state)


def test_kv_sharding_with_state_not_striped_like_pages_is_refused():
    ranks = [PrefillCP(cp_size=2, cp_rank=r, kv_shard_size=2, kv_shard_rank=r, all_ranks_send=True)
             for r in (0, 1)]
    with ContextParallelRig(ranks, state_type="mamba") as rig:
        rig.register()
        reason = rig.peer(rig.ranks[1]).rejected
        assert "prefill kv_shard_size=2 kv_shard_rank=1 with state types ['mamba'], decode attn_tp_size=1" in reason
