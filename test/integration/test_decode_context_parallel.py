"""Decode context parallel end to end: an MLA prefill with DCP 1 (TP 1) into an MLA decode with
`--tp-size 2 --dcp-size 2`, one process per rank. SGLang's runtime context gives decode TP rank r
`attn_dcp_rank = r % 2`, which CommonKVManager reads into `dcp_size` / `dcp_rank`; the decode
scheduler sends virtual pages of page_size x 2 tokens, and each decode rank must hold only its
positions (p % 2 == dcp_rank) packed into its pages, while the MTP draft entry holds every token
on both ranks (harness/pd/dcp.py). Rooms are chunked with a partial last page, and some have a
decode prefix hit of whole virtual pages.

The first test is the checker's own (no processes): it accepts our planner's relayout and
rejects a page-for-page copy.
"""

from __future__ import annotations

import torch
from integration_support import config

from harness.pd import dcp
from harness.pd.plan import build_plan
from harness.pd.pool import RankPool
from harness.pd.run import KVLayout, RoomShape
from harness.plan_ranges import ranges

PAGE = 4
LAYOUT = KVLayout(num_layers=2, mla=True, head_dim=72, page_size=PAGE, draft_layers=1)
SHAPE = RoomShape(min_tokens=1, max_tokens=6 * PAGE + 3, chunks=3)
# Prefix hits in prefill pages; the plan rounds them down to whole virtual pages (2 pages).
PREFIX = ((0, 4), (2, 2), (10, 3))


def _cfg(**kw):
    return config(
        rooms=12, layout=LAYOUT, shape=SHAPE, prefill_tp=1, decode_tp=2, decode_dcp=2, decode_prefix=PREFIX, **kw
    )


def _copy(cfg, decode_rank: int, page_for_page: bool = False):
    """Decode rank `decode_rank` after every room was moved by our planner's relayout, chunk by
    chunk as prefill sends it (or, with page_for_page, by copying pages as if there were no DCP)."""
    from sglang.srt.disaggregation.base.conn import KVArgs

    from sglang_mori.planning import KVLayout as Layout
    from sglang_mori.planning import TransferPlanner

    plan = build_plan(cfg)
    src = RankPool(cfg, plan, "prefill", 0)
    src.fill_prefill()
    dst = RankPool(cfg, plan, "decode", decode_rank)
    planner = TransferPlanner(
        Layout.from_kv_args(src.kv_args(KVArgs), 1, 0, True),
        Layout.from_kv_args(dst.kv_args(KVArgs), 2, decode_rank, True, dcp_size=2, dcp_rank=dst.dcp_rank),
    )
    for room in plan.rooms:
        sent = room.decode_pages[room.decode_prefix_pages :]
        for chunk, (first, end) in enumerate(room.chunks):
            pages = room.prefill_pages[first:end]
            if page_for_page:  # a backend unaware of DCP: the chunk's page i -> decode page i
                for s, d in zip(src.kv, dst.kv):
                    for a, b in zip(pages, sent[first - room.prefix_pages :]):
                        d[b * PAGE : (b + 1) * PAGE] = s[a * PAGE : (a + 1) * PAGE]
                continue
            moved = planner.plan_kv_dcp(
                pages, sent, page_offset=first - room.prefix_pages,
                decode_prefix_len=room.prefix_pages * PAGE, num_tokens=room.chunk_tokens(chunk, PAGE),
            )
            for t in moved.transfers:
                a = src.kv[t.local_index].view(torch.uint8).numpy().reshape(-1)
                b = dst.kv[t.remote_index].view(torch.uint8).numpy().reshape(-1)
                for lo, ro, size in zip(*ranges(t)):
                    b[ro : ro + size] = a[lo : lo + size]
    return plan, dst


def _check(plan, dst) -> list:
    bad = []
    for room in plan.rooms:
        dcp.check_kv(dst, room, bad.append)
    return bad


def test_checker_accepts_the_relayout_and_rejects_a_page_copy():
    cfg = _cfg()
    plan = build_plan(cfg)
    # The plan has what the end-to-end run needs: partial last pages, rooms longer than one
    # virtual page, prefixes of whole virtual pages.
    assert any(r.tokens % PAGE for r in plan.rooms) and any(r.tokens > 2 * PAGE for r in plan.rooms)
    assert sorted(r.prefix_pages for r in plan.rooms if r.prefix_pages) == [2, 2, 4], plan.rooms
    for rank in (0, 1):
        plan, dst = _copy(cfg, rank)
        assert _check(plan, dst) == [], rank
        assert all(dst.byte_view(t).any() for t in dst.kv)
    plan, dst = _copy(cfg, 1, page_for_page=True)
    text = "\n".join(_check(plan, dst))
    assert "(target, DCP rank 1/2)" in text and "(draft, DCP rank 1/2)" in text, text


def test_mla_prefill_into_decode_dcp2_with_draft_chunked_and_prefix(run_clean):
    cfg = _cfg()
    result = run_clean(cfg)
    decode = sorted(result.side("decode"), key=lambda r: r.rank)
    assert [r.rank for r in decode] == [0, 1], result.summary()
    assert all(r.checked_bytes > 0 for r in decode), result.summary()
