"""KVPlanner.check_destination marks a destination whose KV indices it found within decode's
buffers, and write_batch then skips the per-chunk check of decode's indices (issue 28: the send
path), only while the peer's planner is the one that checked: a peer that registered again (a
new planner, maybe smaller buffers) gets its chunks checked again. The columns are the same with
the mark and without it."""

from types import SimpleNamespace

import numpy as np
import pytest

from sglang_mori.backend.plans import KVPlanner, LocalBuffers, encode_layout
from sglang_mori.backend.prefill.rooms import RoomTarget
from sglang_mori.planning import KVLayout, PlanError

ITEM = 64


def layout(pages: int) -> KVLayout:
    return KVLayout(is_mla=True, tp_size=1, tp_rank=0, page_size=16, kv_cache_dtype="bfloat16",
                    kv_item_lens=(ITEM,) * 3, kv_data_lens=(pages * ITEM,) * 3, kv_head_num=0, total_kv_head_num=0)


def desc(name: str, size: int):
    return SimpleNamespace(id=name, size=size)


def register(plans: KVPlanner, pages: int):
    kv = [desc(f"R{j}", pages * ITEM) for j in range(3)]
    plans.accept_peer("decode-0", encode_layout(layout(pages)), kv, [], [])
    return SimpleNamespace(engine_key="decode-0", kv_descs=kv, state_descs=[])


def target(indices) -> RoomTarget:
    return RoomTarget(engine_key="decode-0", attempt=1, endpoint="127.0.0.1", dst_port=1,
                      kv_indices=np.asarray(indices, dtype=np.int64), aux_index=None, state_indices=None,
                      required_dst_info_num=1, decode_prefix_len=None, is_dummy=False)


def chunk(src, part=slice(None)):
    return SimpleNamespace(kv_indices=np.asarray(src, dtype=np.int64), index_slice=part, is_last=False,
                           state_indices=None)


@pytest.fixture
def plans():
    return KVPlanner(layout(16), LocalBuffers(kv=[desc(f"L{i}", 16 * ITEM) for i in range(3)], aux=[], state=[]))


def columns(batch):
    return [[a.tolist() for a in column] for column in (batch.local_offsets, batch.remote_offsets, batch.sizes)]


def test_a_checked_destination_is_marked_and_plans_the_same(plans):
    peer = register(plans, 16)
    checked, unchecked = target([3, 9, 15, 0]), target([3, 9, 15, 0])
    assert plans.check_destination(peer, checked) is None
    assert checked.kv_checked_by is plans.registered_planner(peer)
    a, b = plans.write_batch(peer, chunk([1, 2, 3, 4]), checked), plans.write_batch(peer, chunk([1, 2, 3, 4]), unchecked)
    assert columns(a) == columns(b) and a.nbytes == b.nbytes == 3 * 4 * ITEM
    # A chunk of it: the slice of a checked destination is within the same bounds.
    part = plans.write_batch(peer, chunk([7, 8], slice(2, 4)), checked)
    assert part.remote_offsets[0].tolist() == [15 * ITEM, 0]


def test_a_rejected_destination_is_not_marked(plans):
    peer = register(plans, 16)
    bad = target([3, 16])
    assert "out of range" in plans.check_destination(peer, bad)
    assert bad.kv_checked_by is None
    with pytest.raises(PlanError, match="decode KV buffer"):
        plans.write_batch(peer, chunk([1, 2]), bad)


def test_a_peer_registered_again_gets_its_chunks_checked_again(plans):
    peer = register(plans, 16)
    t = target([3, 12])
    assert plans.check_destination(peer, t) is None
    smaller = register(plans, 8)  # the same decode, back with 8 pages a buffer: page 12 is gone
    with pytest.raises(PlanError, match="decode KV buffer"):
        plans.write_batch(smaller, chunk([1, 2]), t)
