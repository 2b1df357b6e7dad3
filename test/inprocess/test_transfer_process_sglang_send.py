"""The transfer process's hand-off under SGLang 0.5.23's send(), as the first GPU run inside real
SGLang servers met it (session 20): send() passes every keyword of add_transfer_request, with
state_indices=[] on the last chunk of a plain model; and nothing may raise out of it (an exception
there ended SGLang's prefill scheduler, and every request with it)."""

import numpy as np
import pytest

from sglang_mori.backend import room_status as S

from transfer_process_rig import TransferProcessRig

# What SGLang 0.5.23's sender.send() adds besides aux_index, for a plain Llama (common/conn.py).
SGLANG_LAST_CHUNK = dict(state_indices=[], num_kv_tokens=1, wait_event=None, indices_event=None, trace_ctx=object())


@pytest.fixture
def tp():
    with TransferProcessRig() as rig:
        yield rig


def ready_room(tp, room: int, pages: list) -> None:
    """A claimed room whose decode sent its pages: what SGLang's send() meets."""
    assert tp.claim(room) is None
    tp.metadata(room, pages=pages)
    tp.wait_status(room, S.WAITING_FOR_INPUT)


def test_a_plain_models_last_chunk_with_an_empty_state_list_reaches_success(tp):
    ready_room(tp, 1, pages=[4, 6])
    tp.send(1, pages=[0], last=False, state_indices=None, num_kv_tokens=1, wait_event=None, indices_event=None)
    tp.send(1, pages=[3], last=True, start=1, **SGLANG_LAST_CHUNK)
    tp.wait_status(1, S.SUCCESS)
    for buffer in range(2):
        assert tp.decode.page(buffer, 4) == tp.pools.page(buffer, 0)
        assert tp.decode.page(buffer, 6) == tp.pools.page(buffer, 3)


def test_state_the_prototype_cannot_carry_fails_the_room_not_the_scheduler(tp):
    ready_room(tp, 2, pages=[1])
    tp.send(2, pages=[0], last=True, **dict(SGLANG_LAST_CHUNK, state_indices=[np.array([5])]))  # no raise
    tp.wait_status(2, S.FAILED)
    assert "carries no state pools" in tp.sglang.failure_reason(2)


def test_a_hand_off_that_raises_fails_its_room_and_the_next_room_still_succeeds(tp, monkeypatch, caplog):
    ready_room(tp, 3, pages=[2])
    real_chunk = tp.process.chunk

    def broken(*args, **kw):
        raise RuntimeError("injected: record too large")
    monkeypatch.setattr(tp.process, "chunk", broken)
    tp.send(3, pages=[0], last=True, **SGLANG_LAST_CHUNK)  # no raise into SGLang's scheduler
    assert tp.sglang.status(3) == S.FAILED
    assert tp.sglang.failure_reason(3) == ("sglang-mori transfer process: chunk not handed over "
                                           "(RuntimeError: injected: record too large)")
    assert "injected: record too large" in caplog.text
    monkeypatch.setattr(tp.process, "chunk", real_chunk)
    ready_room(tp, 4, pages=[7])
    tp.send(4, pages=[1], last=True, **SGLANG_LAST_CHUNK)
    tp.wait_status(4, S.SUCCESS)
    assert tp.decode.page(0, 7) == tp.pools.page(0, 1)


def test_a_claim_that_raises_fails_its_room_with_the_reason(tp, monkeypatch):
    def broken(room):
        raise OverflowError("injected: room id out of range")
    monkeypatch.setattr(tp.process, "claim", broken)
    reason = tp.claim(5)
    assert reason == "sglang-mori transfer process: room not claimed (OverflowError: injected: room id out of range)"
    assert tp.sglang.status(5) == S.FAILED and tp.sglang.failure_reason(5) == reason


def test_int32_pages_as_sglang_hands_them_reach_success_with_the_right_bytes(tp):
    # SGLang 0.5.23's kv_to_page_indices gives numpy int32 (req_to_token is int32): sent as they are
    ready_room(tp, 6, pages=[5, 2])
    tp.send(6, pages=np.array([4, 1], dtype=np.int32), last=True, **SGLANG_LAST_CHUNK)
    tp.wait_status(6, S.SUCCESS)
    for buffer in range(2):
        assert tp.decode.page(buffer, 5) == tp.pools.page(buffer, 4)
        assert tp.decode.page(buffer, 2) == tp.pools.page(buffer, 1)


def test_an_aux_index_outside_the_metadata_buffers_fails_the_room_by_name(tp):
    ready_room(tp, 7, pages=[3])
    tp.send(7, pages=[0], last=True, aux_index=8, **SGLANG_LAST_CHUNK)  # the rig's buffers hold 8 slots
    assert tp.sglang.status(7) == S.FAILED
    assert tp.sglang.failure_reason(7) == ("sglang-mori transfer process: chunk not handed over (IndexError: "
                                           "aux index 8 outside the metadata buffers' 8 slots)")
