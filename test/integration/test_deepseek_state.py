"""DeepSeek-V4 state (`swa` on MLA, `swa_ring`, `c128_state`, `request_row`) and DeepSeek-V3.2
DSA state (`dsa`, `dsa_tail`) end to end, one process per rank.

Every rank of an MLA model registers these state components after its KV as SGLang's
`setup_state_kv_args` does for DeepSeekV4TokenToKVPool / DSATokenToKVPool, and sends the indices
prefill.py / decode.py compute for each request (harness/pd/ds_state.py): SWA pages of the window,
DSA index pages after decode's cached prefix, ring rows of the last window positions, the c128
ring page holding the pending block (none at a block boundary), the request row, and the DSA
tail's 6-tuple (none when no token is live, rings of different sizes on the two sides). The state
is whole on every TP rank, so with different TP sizes one prefill rank per decode rank writes it
and the others (MLA dummy ranks) touch no decode engine. Decode checks every unit of every room
against the prefill bytes of the same position, and that nothing else was written.

The first tests are the checker's own: it accepts a copy made by the planner and catches damage.
"""

from __future__ import annotations

import numpy as np
import pytest
from integration_support import config

from harness.pd import ds_state
from harness.pd.config import HarnessConfig
from harness.pd.plan import build_plan
from harness.pd.pool import RankPool
from harness.pd.run import KVLayout, RoomShape
from harness.plan_ranges import ranges

PAGE = 4
V4_STATE = ds_state.deepseek_v4_state(PAGE)
DSA_STATE = ds_state.DEEPSEEK_V32_DSA_STATE
MODELS = {
    "deepseek_v4": KVLayout(num_layers=2, mla=True, head_dim=72, page_size=PAGE, deepseek_state=V4_STATE),
    "deepseek_v32_dsa": KVLayout(num_layers=2, mla=True, head_dim=72, page_size=PAGE, deepseek_state=DSA_STATE),
}
SHAPE = RoomShape(min_tokens=1, max_tokens=4 * PAGE + 3, chunks=2)


# -- the checker's own tests (no processes) ---------------------------------------------------


def _planner_copy(cfg: HarnessConfig, prefill_rank: int = 0, decode_rank: int = 0):
    """Decode rank `decode_rank`'s state after every room was copied by our planner from
    prefill rank `prefill_rank` (what the backend writes), and the plan."""
    from sglang.srt.disaggregation.base.conn import KVArgs

    from sglang_mori.planning import KVLayout as Layout
    from sglang_mori.planning import TransferPlanner

    plan = build_plan(cfg)
    src = RankPool(cfg, plan, "prefill", prefill_rank)
    src.fill_prefill()
    dst = RankPool(cfg, plan, "decode", decode_rank)
    planner = TransferPlanner(
        Layout.from_kv_args(src.kv_args(KVArgs), cfg.prefill_tp, prefill_rank, True),
        Layout.from_kv_args(dst.kv_args(KVArgs), cfg.decode_tp, decode_rank, True),
    )
    for room in plan.rooms:
        sent = src.state_indices(room.prefill_state)
        wanted = dst.state_indices(room.decode_state)
        for c, (s, d) in enumerate(zip(sent, wanted)):
            for t in planner.plan_state(c, s, d):
                a = src.deepseek_state.tensors[c][t.local_index].numpy().reshape(-1)
                b = dst.deepseek_state.tensors[c][t.remote_index].numpy().reshape(-1)
                for lo, ro, size in zip(*ranges(t)):
                    b[ro : ro + size] = a[lo : lo + size]
    return plan, src, dst


def _check(plan, dst) -> list:
    bad = []
    for room in plan.rooms:
        ds_state.check_room(dst, room, bad.append)
    ds_state.check_untouched(dst, plan.rooms, bad.append)
    return bad


def _cfg(model: str, **kw) -> HarnessConfig:
    return HarnessConfig(layout=MODELS[model], rooms=12, shape=SHAPE, decode_prefix=((2, 1), (5, 2)), **kw)


@pytest.mark.parametrize("model", list(MODELS))
def test_checker_accepts_what_the_planner_moves(model):
    plan, _, dst = _planner_copy(_cfg(model))
    assert _check(plan, dst) == []
    # Every type moved bytes somewhere, and the rooms cover the empty index forms too: a c128 block
    # boundary and a tail with nothing live send [].
    for tensors in dst.deepseek_state.tensors:
        assert all(t.numpy().any() for t in tensors)
    tokens = [r.tokens for r in plan.rooms]
    assert any(t % 4 == 0 for t in tokens) and any(t % 4 for t in tokens), tokens


def test_checker_catches_a_flipped_byte_a_wrong_row_and_a_stray_write():
    plan, src, dst = _planner_copy(_cfg("deepseek_v4"))
    state = dst.deepseek_state
    room = next(r for r in plan.rooms if r.tokens % 4)
    ring = state.geometry[1].units(room)
    state.tensors[1][1].numpy()[ring[-1], 5] ^= 0x10  # swa_ring: one byte of the last position
    c128 = state.geometry[2]
    row = int(c128.units(room)[0])
    other = next(r for r in plan.rooms if r is not room and r.tokens % 4)
    # c128_state: the pending page of another request
    state.tensors[2][0].numpy()[row] = src.deepseek_state.tensors[2][0].numpy()[
        int(ds_state.ComponentGeometry(V4_STATE[2], src.cfg, plan, "prefill").units(other)[0])
    ]
    used = {int(u) for r in plan.rooms for u in state.geometry[3].units(r)}
    spare = next(u for u in range(state.geometry[3].num_units) if u not in used)
    state.tensors[3][0].numpy()[spare, 0] = 1  # request_row: a row no request holds
    text = "\n".join(_check(plan, dst))
    assert f"room#{room.index} swa_ring (state component 1) tensor 1: 1 of" in text, text
    assert f"room#{room.index} c128_state (state component 2) tensor 0" in text, text
    assert "request_row (state component 3) tensor 0: 1 unassigned units written" in text, text


def test_checker_catches_a_tail_copied_by_slot_instead_of_by_position():
    # dsa_tail rings differ (4 vs 6 slots): copying ring slot s to ring slot s puts a wrapped token
    # in the wrong place; only a copy by position is right.
    plan, src, dst = _planner_copy(_cfg("deepseek_v32_dsa"))
    assert _check(plan, dst) == []
    tail = dst.deepseek_state
    wrapped = [r for r in plan.rooms if r.tokens % 4 and (r.tokens - r.tokens % 4) % 6 + r.tokens % 4 > 6]
    room = wrapped[0] if wrapped else next(r for r in plan.rooms if r.tokens % 4)
    src_units = ds_state.ComponentGeometry(DSA_STATE[1], src.cfg, plan, "prefill").units(room)
    slot_for_slot = room.decode_state * 6 + src_units % 4
    tail.tensors[1][0].numpy()[tail.geometry[1].units(room)] = 0
    tail.tensors[1][0].numpy()[slot_for_slot] = src.deepseek_state.tensors[1][0].numpy()[src_units]
    assert any(f"room#{room.index} dsa_tail" in m for m in _check(plan, dst))


def test_checker_catches_state_from_the_other_prefill_dp_rank():
    cfg = _cfg("deepseek_v32_dsa", prefill_dp=2, prefill_dp_routing="explicit")
    plan, _, dst = _planner_copy(cfg, prefill_rank=0)
    rooms_of_dp1 = [r.index for r in plan.rooms if r.prefill_dp == 1]
    bad = _check(plan, dst)
    assert rooms_of_dp1 and all(any(f"room#{i} dsa " in m for m in bad) for i in rooms_of_dp1), bad


# -- end to end ---------------------------------------------------------------------------------


def _senders(result) -> dict:
    """prefill rank -> the decode engines it opened a session to."""
    return {r.rank: r.engine_contacts["sessions"] for r in result.side("prefill")}


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("prefill_tp,decode_tp", [(1, 1), (2, 1), (1, 2)], ids=["tp1to1", "tp2to1", "tp1to2"])
def test_deepseek_state_end_to_end(run_clean, model, prefill_tp, decode_tp):
    cfg = config(
        rooms=12,
        prefill_tp=prefill_tp,
        decode_tp=decode_tp,
        layout=MODELS[model],
        shape=SHAPE,
        decode_prefix=((2, 1), (5, 2)),  # DSA pages after decode's cached prefix only
    )
    result = run_clean(cfg)
    decode = {r.rank: r.engine_contacts for r in result.side("decode")}
    prefill = {r.rank: r.engine_contacts for r in result.side("prefill")}
    # Prefill rank 0 writes every decode rank's copy (for TP 2 -> 1 the decode rank's real
    # sender); prefill rank 1 is an MLA dummy: no session, no connection to decode.
    assert _senders(result)[0] == sorted(c["key"] for c in decode.values()), result.summary()
    for rank, contacts in prefill.items():
        if rank:
            assert contacts["sessions"] == [], (rank, contacts)
    for contacts in decode.values():
        assert contacts["inbound"] == [prefill[0]["key"]], (contacts, prefill)
