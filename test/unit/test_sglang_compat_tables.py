"""sglang_compat's readers of SGLang's per-room tables work on every shape SGLang gives them."""

from __future__ import annotations

import pytest

from sglang_mori.backend import sglang_compat as compat


class _OneStageGroup:
    """A PP group of which this process is stage 0 (PPConsensusStore broadcasts its address)."""

    def broadcast_object(self, obj=None, src=0):
        return obj


def test_room_count_reads_a_plain_table_and_sglangs_pp_consensus_store(monkeypatch):
    # With prefill PP > 1, CommonKVManager.request_status is a PPConsensusStore, which has no
    # len(): debug_snapshot() raised TypeError on every PP prefill rank before room_count.
    monkeypatch.setenv("SGLANG_HOST_IP", "127.0.0.1")
    from sglang.srt.disaggregation.pp_consensus_store import PPConsensusStore

    assert compat.room_count({1: 2, 3: 4}) == 2
    store = PPConsensusStore(2, 0, _OneStageGroup())
    try:
        store[11] = 1
        store[12] = 2
        with pytest.raises(TypeError):
            len(store)
        assert compat.room_count(store) == 2
        store.pop(11)
        assert compat.room_count(store) == 1
    finally:
        store.close()
