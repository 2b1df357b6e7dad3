"""Byte-exact check of one decode rank's buffers after the transfers.

For every room that succeeded: each token of each KV entry (every layer, K and V, this rank's
heads) holds the prefill's bytes from the mapped prefill slot; the aux rows and state rows hold the
prefill's rows. For the whole pool: every page, aux row and state row that no room was given is
still zero (page 0 included). Pages of rooms that did not succeed are not judged: writes may have
landed partially there, which is allowed.

The tail of a partially filled last page carries no token; a backend may copy the whole page or
only the valid tokens, so a tail row must be either the prefill's bytes or untouched zeros.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np

from harness.pd import dcp
from harness.pd import ds_state
from harness.pd import mamba
from harness.pd import pattern as pat
from harness.pd.plan import Plan, RoomPlan
from harness.pd.pool import RankPool
from harness.pd.results import SUCCESS, RankReport, RoomOutcome

MAX_REPORTED = 20


class _Collector:
    def __init__(self, report: RankReport):
        self.report = report

    def bad(self, text: str) -> None:
        self.report.mismatch_count += 1
        if len(self.report.mismatches) < MAX_REPORTED:
            self.report.mismatches.append(text)


def _token_slots(room: RoomPlan, ps: int, pages: np.ndarray, upto: int) -> np.ndarray:
    """Pool slots of the room's tokens [prefix, upto) (decode's cached prefix is not sent)."""
    t = np.arange(room.prefix_pages * ps, upto)
    return pages[t // ps].astype(np.int64) * ps + t % ps


def _check_kv(pool: RankPool, room: RoomPlan, out: _Collector) -> int:
    if pool.dcp_size > 1:
        return dcp.check_kv(pool, room, out.bad)
    ps = pool.cfg.layout.page_size
    full = room.num_pages * ps
    p_slots = _token_slots(room, ps, room.prefill_pages, full)
    d_slots = _token_slots(room, ps, room.decode_pages, full)
    first = room.prefix_pages * ps  # token number of row 0 below
    valid = room.tokens - first
    heads = pool.global_heads()
    checked = 0
    for entry, t in enumerate(pool.kv):
        view = pool.byte_view(t)
        expected = pat.pattern(pool.kv_key(entry, room.prefill_dp), p_slots, heads, view.shape[2])
        if not pool.sent_by_prefill(entry):
            expected = np.zeros_like(expected)
        actual = view[d_slots]
        valid_ok = (actual[:valid] == expected[:valid]).all(axis=(1, 2))
        tail_act, tail_exp = actual[valid:], expected[valid:]
        tail_ok = (tail_act == tail_exp).all(axis=(1, 2)) | (tail_act == 0).all(axis=(1, 2))
        checked += actual.nbytes
        if not valid_ok.all():
            row_i = int(np.flatnonzero(~valid_ok)[0])
            tok = first + row_i
            row = actual[row_i]
            what = "zeros (never written)" if not row.any() else _whose(pool, entry, row, p_slots, heads, room.prefill_dp)
            out.bad(
                f"room#{room.index} kv entry {entry} token {tok}/{room.tokens} "
                f"(decode slot {d_slots[row_i]}, prefill slot {p_slots[row_i]}): {(~valid_ok).sum()} "
                f"bad tokens; first holds {what}"
            )
        if not tail_ok.all():
            out.bad(f"room#{room.index} kv entry {entry}: last-page tail holds foreign bytes")
    return checked


def _whose(pool: RankPool, entry: int, row: np.ndarray, p_slots: np.ndarray, heads, prefill_dp: int) -> str:
    """Best-effort diagnosis of a wrong row: which prefill slot of this room (or which other
    prefill DP rank) it came from."""
    for dp in [prefill_dp] + [d for d in range(pool.cfg.prefill_dp) if d != prefill_dp]:
        cand = pat.pattern(pool.kv_key(entry, dp), p_slots, heads, row.shape[1])
        hits = np.flatnonzero((cand == row).all(axis=(1, 2)))
        if len(hits) and dp != prefill_dp:
            return f"the bytes of prefill DP rank {dp}, slot {p_slots[hits[0]]} (wrong prefill DP rank)"
        if len(hits):
            return f"the bytes of prefill slot {p_slots[hits[0]]} (wrong offset in this room)"
    return "foreign bytes (other room, layer, head or rank)"


def _check_rows(pool: RankPool, room: RoomPlan, out: _Collector) -> int:
    checked = 0
    prefill_aux = pool.cfg.layout.aux
    last_stage = pool.cfg.prefill_pp - 1  # aux is the last PP stage's (it holds the outputs)
    for i, t in enumerate(pool.aux):
        view = pool.byte_view(t)
        exp = pat.row_pattern(pool.aux_key(i, room.prefill_dp, last_stage), room.prefill_aux, view.shape[1])
        if i >= len(prefill_aux):  # prefill has no such buffer: nothing may arrive here
            exp = np.zeros_like(exp)
        checked += view.shape[1]
        if not np.array_equal(view[room.decode_aux], exp):
            out.bad(f"room#{room.index} aux buffer {i} row {room.decode_aux} differs")
    if pool.mamba_specs:
        return checked + _check_mamba(pool, room, out)
    for i, t in enumerate(pool.state):
        view = pool.byte_view(t)
        # Equal TP only (see config): decode rank r holds prefill rank r's state.
        key = pool.state_key(i, pool.attn_rank, room.prefill_dp)
        exp = pat.row_pattern(key, room.prefill_state, view.shape[1])
        checked += view.shape[1]
        if not np.array_equal(view[room.decode_state], exp):
            out.bad(f"room#{room.index} state tensor {i} row {room.decode_state} differs")
    if pool.deepseek_state:
        checked += ds_state.check_room(pool, room, out.bad)
    return checked


def _check_mamba(pool: RankPool, room: RoomPlan, out: _Collector) -> int:
    """Each mamba tensor's decode slot holds, at every position of this rank's shard, the bytes
    the prefill computed for that global position of the room's prefill slot (any TP sizes)."""
    checked = 0
    slot = np.array([room.prefill_state])
    for i, (spec, t) in enumerate(zip(pool.mamba_specs, pool.state)):
        actual = mamba.rows_view(t, spec)[room.decode_state]
        positions = pool.mamba_positions(i)
        expected = spec.content(pool.cfg.seed, room.prefill_dp, slot, positions)[0]
        checked += actual.nbytes
        bad = ~(actual == expected).all(axis=1)
        if bad.any():
            first = int(np.flatnonzero(bad)[0])
            out.bad(
                f"room#{room.index} state tensor {i} (layer {spec.layer}, "
                f"{spec.name}) row {room.decode_state}: {int(bad.sum())} "
                f"of {len(positions)} positions differ, first global position {positions[first]} "
                f"holds {_whose_position(pool, spec, room, actual[first])}"
            )
    return checked


def _whose_position(pool: RankPool, spec, room: RoomPlan, row: np.ndarray) -> str:
    """Best-effort diagnosis of one wrong position: which global position of the room's prefill
    slot it holds (a shard cut in the wrong place), or zeros, or something else."""
    if not row.any():
        return "zeros (never written)"
    every = np.arange(spec.outer * spec.full)
    cand = spec.content(pool.cfg.seed, room.prefill_dp, np.array([room.prefill_state]), every)[0]
    hits = np.flatnonzero((cand == row).all(axis=1))
    if len(hits):
        return f"the bytes of global position {hits[0]} (wrong shard or sub-block)"
    return "foreign bytes (other slot, layer or field)"


def _check_untouched(pool: RankPool, plan: Plan, rooms: Sequence[RoomPlan], out: _Collector) -> None:
    used_pages = np.zeros(plan.decode_pool_pages, dtype=bool)
    for room in rooms:
        used_pages[room.decode_pages[room.decode_prefix_pages :]] = True  # cached prefix pages stay zero
    for entry, t in enumerate(pool.kv):
        free_slots = np.flatnonzero(np.repeat(~used_pages, pool.entry_page_tokens[entry]))
        dirty = np.flatnonzero(pool.byte_view(t)[free_slots].any(axis=(1, 2)))
        if len(dirty):
            out.bad(f"kv entry {entry}: {len(dirty)} slots of unassigned pages were written, e.g. slot {free_slots[dirty[0]]}")
    used_aux = {r.decode_aux for r in rooms}
    used_state = {r.decode_state for r in rooms}
    for name, bufs, used in (("aux", pool.aux, used_aux), ("state", pool.state, used_state)):
        for i, t in enumerate(bufs):
            view = pool.byte_view(t)
            free = [r for r in range(view.shape[0]) if r not in used]
            dirty = [r for r in free if view[r].any()]
            if dirty:
                out.bad(f"{name} buffer {i}: unassigned rows {dirty[:5]} were written")
    if pool.deepseek_state:
        ds_state.check_untouched(pool, rooms, out.bad)


def verify_decode(
    pool: RankPool, plan: Plan, outcomes: Sequence[RoomOutcome], report: RankReport, rooms=None
) -> None:
    """Check this decode rank; `rooms` are the rooms its instance serves (default: all), so the
    pages of another decode instance's rooms must stay zero here."""
    out = _Collector(report)
    rooms = plan.rooms if rooms is None else rooms
    ok = {o.index for o in outcomes if o.status == SUCCESS}
    checked = 0
    for room in rooms:
        if room.index in ok:
            checked += _check_kv(pool, room, out)
            checked += _check_rows(pool, room, out)
    _check_untouched(pool, plan, rooms, out)
    report.checked_bytes = checked
    report.verified = True



def snapshot_room(pool: RankPool, room: RoomPlan) -> list:
    """A digest per buffer of everything decode holds for a room (its KV pages, aux and state
    rows): enough to see any change later, without keeping a copy of the pages (a long run
    releases thousands of failed rooms, and the soak measures the process's RSS)."""
    pages = room.decode_pages.astype(np.int64)[:, None]
    parts = [
        pool.byte_view(t)[(pages * n + np.arange(n)).ravel()] for t, n in zip(pool.kv, pool.entry_page_tokens)
    ]
    parts += [pool.byte_view(t)[room.decode_aux] for t in pool.aux]
    parts += [pool.byte_view(t)[room.decode_state] for t in pool.state]
    return [hashlib.blake2b(np.ascontiguousarray(p).tobytes(), digest_size=16).digest() for p in parts]


def late_writes(pool: RankPool, plan: Plan, snapshots: dict) -> dict:
    """plan index -> description, for released rooms whose bytes changed since their snapshot."""
    out = {}
    for index, snap in snapshots.items():
        now = snapshot_room(pool, plan.rooms[index])
        changed = [i for i, (a, b) in enumerate(zip(snap, now)) if a != b]
        if changed:
            out[index] = f"buffers {changed} changed after the room's pages were released"
    return out
