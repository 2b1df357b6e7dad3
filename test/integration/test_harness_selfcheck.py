"""The harness's own machinery, without processes: the plan is sound and the byte checker catches
every kind of damage the integration tests rely on it to catch (so a green integration test means
the bytes really arrived, not that the checker looked away)."""

from __future__ import annotations

import numpy as np
import pytest

from harness.pd.config import HarnessConfig, KVLayout, RoomShape
from harness.pd.plan import build_plan
from harness.pd.pool import RankPool
from harness.pd.results import FAILED, SUCCESS, RankReport, RoomOutcome
from harness.pd.verify import verify_decode


def _cfg(**kw) -> HarnessConfig:
    layout = kw.pop("layout", KVLayout(page_size=4, state_item_bytes=(24,)))
    return HarnessConfig(rooms=kw.pop("rooms", 12), layout=layout, shape=RoomShape(1, 40, chunks=3), **kw)


def test_plan_is_deterministic_and_disjoint():
    cfg = _cfg(rooms=64)
    a, b = build_plan(cfg), build_plan(cfg)
    assert [r.room for r in a.rooms] == [r.room for r in b.rooms]
    assert all(np.array_equal(x.decode_pages, y.decode_pages) for x, y in zip(a.rooms, b.rooms))
    for side in ("prefill_pages", "decode_pages"):
        pages = np.concatenate([getattr(r, side) for r in a.rooms])
        assert len(pages) == len(set(pages.tolist())), f"{side} shared between rooms"
        assert 0 not in pages, "page 0 is SGLang's padding page"
    for attr in ("prefill_aux", "decode_aux", "prefill_state", "decode_state", "room"):
        values = [getattr(r, attr) for r in a.rooms]
        assert len(set(values)) == len(values)
    for r in a.rooms:
        assert r.num_pages == -(-r.tokens // cfg.layout.page_size)
        assert r.chunks[0][0] == 0 and r.chunks[-1][1] == r.num_pages
        assert all(x[1] == y[0] for x, y in zip(r.chunks, r.chunks[1:]))
    assert build_plan(cfg.replace(seed=7)).rooms[0].room != a.rooms[0].room


def _transferred(cfg: HarnessConfig):
    """A decode pool into which every room was copied correctly, by hand (what a backend does)."""
    plan = build_plan(cfg)
    src = RankPool(cfg, plan, "prefill", 0)
    src.fill_prefill()
    dst = RankPool(cfg, plan, "decode", 0)
    ps = cfg.layout.page_size
    for room in plan.rooms:
        for s, d in zip(src.kv, dst.kv):
            for p, q in zip(room.prefill_pages, room.decode_pages):
                d[q * ps : (q + 1) * ps] = s[p * ps : (p + 1) * ps]
        for s, d in zip(src.aux, dst.aux):
            d[room.decode_aux] = s[room.prefill_aux]
        for s, d in zip(src.state, dst.state):
            d[room.decode_state] = s[room.prefill_state]
    outcomes = [RoomOutcome(index=r.index, room=r.room, status=SUCCESS) for r in plan.rooms]
    return plan, src, dst, outcomes


def _verify(plan, dst, outcomes) -> RankReport:
    report = RankReport(side="decode", rank=0, pid=0)
    verify_decode(dst, plan, outcomes, report)
    return report


@pytest.mark.parametrize(
    "layout",
    [KVLayout(page_size=4, state_item_bytes=(24,)), KVLayout(page_size=1, mla=True, head_dim=40)],
    ids=["mha", "mla"],
)
def test_checker_accepts_a_correct_copy(layout):
    plan, _, dst, outcomes = _transferred(_cfg(layout=layout))
    report = _verify(plan, dst, outcomes)
    assert report.verified and report.mismatch_count == 0, report.mismatches
    assert report.checked_bytes > 0


def _damaged(damage) -> RankReport:
    cfg = _cfg()
    plan, src, dst, outcomes = _transferred(cfg)
    damage(cfg, plan, src, dst)
    return _verify(plan, dst, outcomes)


def test_checker_catches_one_flipped_byte():
    def flip(cfg, plan, src, dst):
        room = plan.rooms[3]
        dst.byte_view(dst.kv[3])[room.decode_pages[0] * cfg.layout.page_size, 1, 0] ^= 0x40

    report = _damaged(flip)
    assert report.mismatch_count == 1 and "room#3 kv entry 3" in report.mismatches[0]


def test_checker_catches_a_page_from_the_wrong_place():
    def swap(cfg, plan, src, dst):
        ps, room = cfg.layout.page_size, plan.rooms[0]
        q = room.decode_pages[0]
        wrong = plan.rooms[1].prefill_pages[0]
        dst.kv[0][q * ps : (q + 1) * ps] = src.kv[0][wrong * ps : (wrong + 1) * ps]

    report = _damaged(swap)
    assert report.mismatch_count >= 1 and "room#0 kv entry 0" in report.mismatches[0]


def test_checker_catches_a_layer_mixup_and_a_missing_page():
    def mix(cfg, plan, src, dst):
        ps, room = cfg.layout.page_size, plan.rooms[2]
        p, q = room.prefill_pages[-1], room.decode_pages[-1]
        dst.kv[1][q * ps : (q + 1) * ps] = src.kv[0][p * ps : (p + 1) * ps]  # layer 1 K <- layer 0 K
        q = plan.rooms[4].decode_pages[0]
        dst.kv[2][q * ps : (q + 1) * ps] = 0  # V of layer 0 never arrived

    report = _damaged(mix)
    text = "\n".join(report.mismatches)
    assert "room#2 kv entry 1" in text and "room#4 kv entry 2" in text and "zeros" in text


def test_checker_catches_writes_outside_the_rooms_and_bad_rows():
    def stray(cfg, plan, src, dst):
        used = set(np.concatenate([r.decode_pages for r in plan.rooms]).tolist())
        free = next(p for p in range(plan.decode_pool_pages) if p not in used)
        dst.kv[3][free * cfg.layout.page_size] = 1
        dst.aux[1][plan.rooms[5].decode_aux] = 0
        dst.state[0][plan.rooms[6].decode_state, 3] ^= 1
        spare_aux = next(i for i in range(plan.decode_aux_slots) if i not in {r.decode_aux for r in plan.rooms})
        dst.aux[0][spare_aux] = 9

    text = "\n".join(_damaged(stray).mismatches)
    assert "unassigned pages were written" in text
    assert "room#5 aux buffer 1" in text and "room#6 state tensor 0" in text
    assert "aux buffer 0: unassigned rows" in text


def test_checker_skips_failed_rooms_but_still_guards_free_pages():
    cfg = _cfg()
    plan, _, dst, outcomes = _transferred(cfg)
    ps, room = cfg.layout.page_size, plan.rooms[7]
    dst.kv[0][room.decode_pages[0] * ps] = 0  # partial data in a failed room is allowed
    outcomes[7] = RoomOutcome(index=7, room=room.room, status=FAILED, failure="x")
    report = _verify(plan, dst, outcomes)
    assert report.mismatch_count == 0, report.mismatches


def test_partial_last_page_tail_may_be_zero_or_copied_but_not_foreign():
    cfg = _cfg(layout=KVLayout(page_size=16, state_item_bytes=()), rooms=4)
    plan, src, dst, outcomes = _transferred(cfg)
    room = next(r for r in plan.rooms if r.tokens % 16)
    tail = room.decode_pages[-1] * 16 + room.tokens % 16
    dst.kv[0][tail] = 0  # a backend that copies only valid tokens: fine
    assert _verify(plan, dst, outcomes).mismatch_count == 0
    dst.kv[0][tail] = src.kv[0][tail + 1]  # bytes that belong elsewhere: not fine
    assert "tail" in "\n".join(_verify(plan, dst, outcomes).mismatches)


def test_tp_split_heads_are_distinct_per_rank():
    cfg = HarnessConfig(rooms=2, layout=KVLayout(total_kv_heads=4), prefill_tp=2, decode_tp=1)
    plan = build_plan(cfg)
    r0, r1 = RankPool(cfg, plan, "prefill", 0), RankPool(cfg, plan, "prefill", 1)
    r0.fill_prefill()
    r1.fill_prefill()
    whole = RankPool(cfg.replace(prefill_tp=1), plan, "prefill", 0)
    whole.fill_prefill()
    # Rank r's heads are exactly heads [2r, 2r+2) of the unsplit pool: the checker's notion of a
    # global head matches SGLang's contiguous head split.
    assert np.array_equal(r0.byte_view(r0.kv[0]), whole.byte_view(whole.kv[0])[:, 0:2])
    assert np.array_equal(r1.byte_view(r1.kv[0]), whole.byte_view(whole.kv[0])[:, 2:4])


def test_config_rejects_impossible_layouts():
    with pytest.raises(ValueError):
        HarnessConfig(prefill_tp=3, decode_tp=2).validate()
    with pytest.raises(ValueError):
        HarnessConfig(layout=KVLayout(total_kv_heads=2), decode_tp=4).validate()
    with pytest.raises(ValueError):
        HarnessConfig(layout=KVLayout(state_item_bytes=(8,)), prefill_tp=2).validate()
    with pytest.raises(ValueError):
        HarnessConfig(backend="nixl").validate()


def test_recheck_catches_a_write_after_release():
    from harness.pd.verify import late_writes, snapshot_room

    cfg = _cfg()
    plan, _, dst, _ = _transferred(cfg)
    snaps = {i: snapshot_room(dst, plan.rooms[i]) for i in (2, 3)}
    assert late_writes(dst, plan, snaps) == {}
    dst.kv[1][plan.rooms[3].decode_pages[-1] * cfg.layout.page_size] += 1  # lands after release
    dst.state[0][plan.rooms[2].decode_state] ^= 0xFF
    assert sorted(late_writes(dst, plan, snaps)) == [2, 3]


def test_decode_prefix_pages_must_stay_untouched():
    cfg = _cfg(layout=KVLayout(page_size=4, state_item_bytes=()), rooms=6, decode_prefix=((1, 2), (4, 99)))
    plan = build_plan(cfg)
    assert plan.rooms[1].prefix_pages == 2 and plan.rooms[4].prefix_pages == plan.rooms[4].num_pages - 1
    assert plan.rooms[1].chunks[0][0] == 2, "chunks start after the cached prefix"
    src = RankPool(cfg, plan, "prefill", 0)
    src.fill_prefill()
    dst = RankPool(cfg, plan, "decode", 0)
    for room in plan.rooms:  # a correct backend copies only the pages after the prefix
        for s, d in zip(src.kv, dst.kv):
            for p, q in zip(room.prefill_pages[room.prefix_pages :], room.decode_pages[room.prefix_pages :]):
                d[q * 4 : (q + 1) * 4] = s[p * 4 : (p + 1) * 4]
        for s, d in zip(src.aux, dst.aux):
            d[room.decode_aux] = s[room.prefill_aux]
    outcomes = [RoomOutcome(index=r.index, room=r.room, status=SUCCESS) for r in plan.rooms]
    assert _verify(plan, dst, outcomes).mismatch_count == 0
    q = plan.rooms[1].decode_pages[0]  # ... but one that also overwrites decode's cached prefix
    dst.kv[0][q * 4] = src.kv[0][plan.rooms[1].prefill_pages[0] * 4]
    assert "unassigned pages were written" in "\n".join(_verify(plan, dst, outcomes).mismatches)


def _copy_room(src: RankPool, dst: RankPool, room, ps: int, aux=True, state=True) -> None:
    """Copy one room's bytes from one prefill pool (a DP rank or PP stage) into decode, entry to
    the decode entry of the same (kind, layer)."""
    where = {key: j for j, key in enumerate(dst._entries)}
    for i, key in enumerate(src._entries):
        d = dst.kv[where[key]]
        for p, q in zip(room.prefill_pages, room.decode_pages):
            d[q * ps : (q + 1) * ps] = src.kv[i][p * ps : (p + 1) * ps]
    if aux:
        for s, d in zip(src.aux, dst.aux):
            d[room.decode_aux] = s[room.prefill_aux]
    if state:
        for s, d in zip(src.state, dst.state):
            d[room.decode_state] = s[room.prefill_state]


def test_bytes_from_the_wrong_prefill_dp_rank_are_caught():
    # DP attention: each prefill DP rank's pool holds its own bytes, so a room served from the
    # other DP rank (same pages, same layers) is a mismatch, named as such.
    cfg = _cfg(prefill_dp=2, prefill_dp_routing="explicit", rooms=8)
    plan = build_plan(cfg)
    src = [RankPool(cfg, plan, "prefill", r) for r in range(2)]
    for pool in src:
        pool.fill_prefill()
    dst = RankPool(cfg, plan, "decode", 0)
    for room in plan.rooms:
        _copy_room(src[room.prefill_dp], dst, room, cfg.layout.page_size)
    outcomes = [RoomOutcome(index=r.index, room=r.room, status=SUCCESS) for r in plan.rooms]
    assert _verify(plan, dst, outcomes).mismatch_count == 0
    wrong = plan.rooms[3]
    _copy_room(src[1 - wrong.prefill_dp], dst, wrong, cfg.layout.page_size)
    report = _verify(plan, dst, outcomes)
    assert report.mismatch_count > 0
    assert any("wrong prefill DP rank" in m for m in report.mismatches), report.mismatches


def test_aux_from_a_pp_stage_that_is_not_the_last_is_caught():
    # Prefill PP 2: the stages' layers together fill decode's model; aux must be the last stage's.
    cfg = _cfg(prefill_pp=2, layout=KVLayout(num_layers=4, page_size=4, state_item_bytes=(24, 16)), rooms=6)
    plan = build_plan(cfg)
    stages = [RankPool(cfg, plan, "prefill", 0, pp_rank=p) for p in range(2)]
    for pool in stages:
        pool.fill_prefill()
    assert [p.start_layer for p in stages] == [0, 2] and [p.state_layer_ids for p in stages] == [[0], [1]]
    dst = RankPool(cfg, plan, "decode", 0)
    for room in plan.rooms:
        _copy_room(stages[0], dst, room, cfg.layout.page_size, state=False)
        _copy_room(stages[1], dst, room, cfg.layout.page_size, state=False)
        for pool in stages:  # each stage's state tensors go to decode's tensors of their layer ids
            for k, layer in enumerate(pool.state_layer_ids):
                dst.state[layer][room.decode_state] = pool.state[k][room.prefill_state]
    outcomes = [RoomOutcome(index=r.index, room=r.room, status=SUCCESS) for r in plan.rooms]
    assert _verify(plan, dst, outcomes).mismatch_count == 0
    room = plan.rooms[2]
    for s, d in zip(stages[0].aux, dst.aux):
        d[room.decode_aux] = s[room.prefill_aux]
    report = _verify(plan, dst, outcomes)
    assert report.mismatch_count == len(cfg.layout.aux), report.mismatches
