"""Where each token of a room must be on one decode rank under decode context parallel
(HarnessConfig.decode_dcp = N), derived from how SGLang's DCP decode lays out its KV:

- the decode scheduler allocates the request in virtual pages of page_size x N tokens and sends
  those page ids (after its cached prefix, a whole number of virtual pages);
- position p of the request is written by DCP rank p % N only (forward_batch_info keeps the
  out_cache_loc of positions with p % dcp_size == dcp_rank); within virtual page v, offset o, it
  sits in that rank's physical page v at slot o // N (physical pages of page_size slots);
- a draft (MTP/EAGLE) entry is not striped: every rank holds every token, at offset o of
  virtual page v in a pool of virtual-page-sized pages.

So the check is written from the virtual page outwards, not from the planner's formula. Slots of
the room's pages that receive no token must stay zero (the relayout moves tokens, not pages).
"""

from __future__ import annotations

import numpy as np

from harness.pd import pattern as pat


def token_placement(room, page_size: int, dcp_size: int, dcp_rank: int, draft: bool):
    """(positions, decode slots) of the room's tokens after the prefix that this rank holds in
    an entry of the given kind, in position order."""
    virtual = page_size * dcp_size
    prefix = room.prefix_pages * page_size
    pages = room.decode_pages[room.decode_prefix_pages :].astype(np.int64)
    positions = np.arange(prefix, room.tokens, dtype=np.int64)
    v, o = (positions - prefix) // virtual, (positions - prefix) % virtual
    if draft:
        return positions, pages[v] * virtual + o
    mine = positions % dcp_size == dcp_rank
    return positions[mine], pages[v[mine]] * page_size + o[mine] // dcp_size


def check_kv(pool, room, bad) -> int:
    """Every KV entry of this decode rank holds, at each of its token slots of the room, the
    prefill's bytes of that position, and zeros in the rest of the room's pages."""
    ps = pool.cfg.layout.page_size
    heads = pool.global_heads()
    p_pages = room.prefill_pages.astype(np.int64)
    checked = 0
    for entry, t in enumerate(pool.kv):
        view = pool.byte_view(t)
        draft = pool.is_draft_entry(entry)
        positions, d_slots = token_placement(room, ps, pool.dcp_size, pool.dcp_rank, draft)
        p_slots = p_pages[positions // ps] * ps + positions % ps
        expected = pat.pattern(pool.kv_key(entry, room.prefill_dp), p_slots, heads, view.shape[2])
        if not pool.sent_by_prefill(entry):
            expected = np.zeros_like(expected)
        actual = view[d_slots]
        checked += actual.nbytes
        wrong = ~(actual == expected).all(axis=(1, 2))
        if wrong.any():
            i = int(np.flatnonzero(wrong)[0])
            what = "zeros (never written)" if not actual[i].any() else _whose(pool, entry, actual[i], room, heads)
            bad(
                f"room#{room.index} kv entry {entry} ({'draft' if draft else 'target'}, DCP rank "
                f"{pool.dcp_rank}/{pool.dcp_size}): {int(wrong.sum())} of {len(positions)} tokens differ; "
                f"position {positions[i]} at decode slot {d_slots[i]} holds {what}"
            )
        page_tokens = pool.entry_page_tokens[entry]
        pages = room.decode_pages[room.decode_prefix_pages :].astype(np.int64)
        room_slots = (pages[:, None] * page_tokens + np.arange(page_tokens)).ravel()
        spare = np.setdiff1d(room_slots, d_slots)
        stray = spare[view[spare].any(axis=(1, 2))]
        if len(stray):
            bad(
                f"room#{room.index} kv entry {entry}: {len(stray)} slots of the room's pages that hold "
                f"no token of DCP rank {pool.dcp_rank} were written, e.g. slot {stray[0]}"
            )
    return checked


def _whose(pool, entry: int, row: np.ndarray, room, heads) -> str:
    """Best-effort: which position of the room the wrong row came from."""
    ps = pool.cfg.layout.page_size
    positions = np.arange(room.tokens, dtype=np.int64)
    p_slots = room.prefill_pages.astype(np.int64)[positions // ps] * ps + positions % ps
    cand = pat.pattern(pool.kv_key(entry, room.prefill_dp), p_slots, heads, row.shape[1])
    hits = np.flatnonzero((cand == row).all(axis=(1, 2)))
    if len(hits):
        return f"the bytes of position {hits[0]} (wrong DCP rank or slot)"
    return "foreign bytes (other room, layer or entry)"
