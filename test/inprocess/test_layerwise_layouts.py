"""Layer-wise streaming over real KV geometries (issue 12, integration): MHA and MLA pools, page
sizes 1/16/64, chunked prefill with chunk ends inside pages and a trailing partial page, prefix
hits on either side, and attention-TP mismatches (MHA head slicing: prefill TP 1 -> decode TP 2,
and 2 -> 1).

Every prefill rank is driven as hooks.py drives it (begin_batch, on_layer per layer, end_batch)
and SGLang's send() as `_send_kv_chunk` cuts it (layerwise_rig.py). Each case checks decode's
bytes against the source pages byte for byte (the expected bytes are cut from the prefill pages
by head, independently of the planner), that every KV byte of the request landed exactly once and
nothing else was written (softio's write log on decode), and that the layer-wise worker moved the
full pages: before each pass's send() they are already on decode and the unsent rest is not, the
send() writes no byte into them, and `layerwise_writes` counts one write per room, layer group,
pass and decode peer.

Beyond the straight chunked run: the overlap scheduler's order with layer groups, layers whose
hook never fired (send() writes just those buffers, head-sliced), several requests in one batch,
an abort mid-stream and a radix checkpoint moving a streamed page, on these geometries.
"""

import math
import sys
import threading
import types
from typing import NamedTuple

import numpy as np
import pytest

import sglang_mori.softio.faults as faults
from sglang_mori import protocol
from sglang_mori.backend import room_status as S

from layerwise_rig import Geometry, LayerwiseRig

LAYERS = 3


class Case(NamedTuple):
    pool: str
    page: int
    prefill_tp: int
    decode_tp: int
    tokens: int
    chunk: int  # chunked prefill size
    cached: int = 0  # prefill radix-cache hit (the first pass starts there)
    decode_prefix: int = 0  # decode already holds these tokens (page-aligned)
    hnd: bool = False  # head-major MHA pages (SGLANG_USE_HND_KVCACHE, AITER's layouts)

    def __str__(self):
        extra = (f"-cached{self.cached}" if self.cached else "") + (
            f"-dprefix{self.decode_prefix}" if self.decode_prefix else "") + ("-hnd" if self.hnd else "")
        return (f"{self.pool}-page{self.page}-tp{self.prefill_tp}to{self.decode_tp}-{self.tokens}tok-"
                f"chunk{self.chunk}{extra}")


CASES = [
    Case("mha", 1, 1, 1, 37, 16),
    Case("mha", 16, 1, 1, 87, 32),  # 5 full pages and 7 tokens
    Case("mha", 64, 1, 1, 148, 96),  # the first chunk ends inside page 1
    Case("mha", 64, 1, 1, 148, 40),  # passes 1 and 3 complete no page
    Case("mla", 1, 1, 1, 37, 16),
    Case("mla", 16, 1, 1, 87, 32),
    Case("mla", 64, 1, 1, 148, 96),
    Case("mha", 1, 1, 2, 37, 16),  # each decode rank receives half of the KV heads
    Case("mha", 16, 1, 2, 87, 32),
    Case("mha", 64, 1, 2, 148, 96),
    Case("mha", 16, 2, 1, 87, 32),  # decode's pages are assembled from two prefill ranks' heads
    Case("mha", 64, 2, 1, 148, 40),
    Case("mla", 16, 1, 2, 87, 32),  # both decode ranks get the whole (replicated) latent pages
    Case("mla", 64, 2, 1, 148, 96),  # prefill rank 1 only gets dummy metadata: writes nothing
    Case("mha", 16, 1, 1, 87, 32, cached=20),  # cached page 0 goes with send(), page 1 streams
    Case("mla", 16, 1, 1, 87, 32, decode_prefix=32),  # decode holds pages 0-1: nothing lands there
    Case("mha", 64, 1, 2, 200, 96, cached=70, decode_prefix=64),
    Case("mha", 16, 1, 1, 87, 40, decode_prefix=64),  # pass 1 lies inside decode's prefix: no stream
    Case("mha", 16, 1, 2, 87, 32, hnd=True),  # head-major pages: one range per page and head block
    Case("mha", 64, 2, 1, 148, 40, hnd=True),
]


DRIVERS = ["session", "hooks"]  # the session's calls directly, or through hooks.py's AROUND hooks


@pytest.fixture
def stub_sender_module(monkeypatch):
    """hooks.py recognises our requests by `isinstance(req.disagg_kv_sender, MoriKVSender)`; the
    real module imports SGLang (seconds), so a stand-in takes its place unless it is loaded."""
    name = "sglang_mori.backend.sender"
    if name not in sys.modules:
        stub = types.ModuleType(name)
        stub.MoriKVSender = type("MoriKVSender", (), {})
        monkeypatch.setitem(sys.modules, name, stub)


def make_rig(case: Case, group_size: int = 1, via_hooks: bool = False) -> LayerwiseRig:
    pages = max(8, 2 * math.ceil(case.tokens / case.page) + 2)
    geometry = Geometry(is_mla=case.pool == "mla", layers=LAYERS, page_size=case.page, pages=pages,
                        head_major=case.hnd)
    return LayerwiseRig(geometry, prefill_tp=case.prefill_tp, decode_tp=case.decode_tp, group_size=group_size,
                        via_hooks=via_hooks)


def open_request(rig, case: Case, room: int):
    req = rig.request(room, case.tokens, cached=case.cached, decode_prefix=case.decode_prefix)
    rig.open(req)
    return req


def streaming_passes(streamed) -> int:
    """How many passes streamed pages; every prefill rank of the TP group must agree."""
    ends = np.asarray(streamed)  # [pass, prefill rank]
    assert (ends == ends[:, :1]).all(), streamed
    before = np.concatenate([[0], ends[:-1, 0]])
    return int((ends[:, 0] > before).sum())


def peer_writes(rig) -> int:
    """Decode peers summed over prefill ranks: one layer-wise write per (layer group, pass, peer)."""
    return sum(len(rig.writing_decodes(p)) for p in rig.prefills)


def expected_streamed(case: Case) -> list:
    """Request pages the layer-wise worker must have moved: every full page from the page holding
    the first token this prefill computes (a cached page before it is sent, not streamed), and
    from decode's prefix on."""
    first = max(case.cached // case.page, case.decode_prefix // case.page)
    return list(range(first, case.tokens // case.page))


def assert_landed(rig, req):
    assert rig.mismatches(req) == []
    assert rig.write_counts_off(req) == []
    if req.first_page:
        assert rig.untouched(req, range(req.first_page))  # decode's own prefix


def assert_success_aux(rig, req):
    for p in rig.prefills:
        def sent():
            return [m for m in p.messenger.of_type(protocol.RoomStatus, req.room) if m.aux is not None]
        # SGLang's status turns Success just before the message to decode leaves (effects.py), so
        # wait_success can return while the message is still being sent: wait for it, bounded.
        want = len(rig.writing_decodes(p))
        rig.wait(lambda: len(sent()) >= want, f"room {req.room}'s Success message(s) to decode")
        done = sent()
        assert len(done) == want, done
        assert all(m.aux == [p.aux[0:16].tobytes()] for m in done)


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("driver", DRIVERS)
def test_chunked_layerwise_lands_byte_exact(case, driver, stub_sender_module):
    with make_rig(case, via_hooks=driver == "hooks") as rig:
        req = open_request(rig, case, 21)
        marks = []  # (decode rank, write-log position, request pages streamed before that send)

        def before_send(k, ends):
            streamed = rig.streamed_pages(rig.prefills[0], req)
            assert all(rig.streamed_pages(p, req) == streamed for p in rig.prefills)
            landed = sorted(streamed | req.sent_pages)
            # the layer-wise writes alone put every streamed page on decode ...
            assert rig.mismatches(req, landed) == [], (k, landed)
            # ... and nothing else yet (the rest is still to be streamed or sent)
            assert rig.untouched(req, [i for i in range(req.num_pages) if i not in landed]), k
            marks.extend((d, len(d.write_log()), sorted(streamed)) for d in rig.decodes)

        streamed = rig.prefill_chunked(req, case.chunk, on_pass_sent=before_send)
        rig.wait_success(req.room)

        assert_landed(rig, req)
        # no send() wrote into a page that was streamed before it
        for d, since, pages in marks:
            assert rig.kv_writes_into(d, req, pages, since) == [], (d.tp_rank, pages)
        for p in rig.prefills:
            assert sorted(rig.streamed_pages(p, req)) == expected_streamed(case), p.tp_rank
        passes = streaming_passes(streamed)
        assert passes >= 1
        assert sum(p.metrics.layerwise for p in rig.prefills) == passes * LAYERS * peer_writes(rig)
        assert all(p.metrics.fallbacks == [] for p in rig.prefills), [p.metrics.fallbacks for p in rig.prefills]
        assert_success_aux(rig, req)


OVERLAP_CASES = [
    Case("mha", 16, 1, 2, 87, 32),
    Case("mla", 64, 1, 1, 148, 96),
    Case("mha", 64, 2, 1, 148, 40),
    Case("mha", 16, 1, 1, 87, 32, cached=20, decode_prefix=16),
    Case("mla", 16, 2, 1, 87, 32),
]


@pytest.mark.parametrize("case", OVERLAP_CASES, ids=str)
@pytest.mark.parametrize("driver", DRIVERS)
def test_overlap_scheduler_order_with_layer_groups(case, driver, stub_sender_module):
    """Pass k+1 is published and run before pass k's send() (the overlap scheduler), layers in
    groups of two (a group of 2 and a group of 1 per pass)."""
    with make_rig(case, group_size=2, via_hooks=driver == "hooks") as rig:
        req = open_request(rig, case, 22)
        streamed = rig.prefill_chunked(req, case.chunk, overlap=True)
        rig.wait_success(req.room)
        assert_landed(rig, req)
        for p in rig.prefills:
            assert sorted(rig.streamed_pages(p, req)) == expected_streamed(case), p.tp_rank
        groups = math.ceil(LAYERS / 2)
        assert sum(p.metrics.layerwise for p in rig.prefills) == streaming_passes(streamed) * groups * peer_writes(rig)
        assert all(p.metrics.fallbacks == [] for p in rig.prefills)
        assert_success_aux(rig, req)


HOOK_CASES = [
    Case("mha", 16, 1, 2, 87, 32),
    Case("mha", 1, 2, 1, 37, 16),
    Case("mla", 64, 1, 1, 148, 96),
]


@pytest.mark.parametrize("case", HOOK_CASES, ids=str)
@pytest.mark.parametrize("missing,group_size", [(LAYERS - 1, 1), (1, 2)], ids=["last-layer", "middle-layer-groups"])
def test_layers_the_hook_missed_go_with_send_head_sliced(case, missing, group_size):
    """One layer's hook never fires in the second pass (e.g. it runs in a graph without the
    hook): that pass's send() writes only the missing layer's buffers of those pages (head-sliced
    under a TP mismatch), plus the partial page. With groups of two, the group around the gap
    still goes out whole."""
    with make_rig(case, group_size=group_size) as rig:
        req = open_request(rig, case, 23)
        seen = [layer for layer in range(LAYERS) if layer != missing]
        streamed = rig.prefill_chunked(req, case.chunk, hook_layers=lambda k: seen if k == 1 else None)
        rig.wait_success(req.room)
        assert_landed(rig, req)
        passes = streaming_passes(streamed)
        groups = math.ceil(LAYERS / group_size)
        # pass 1 handed LAYERS - 1 layers to the worker in ceil((LAYERS - 1) / group_size) groups
        expected = ((passes - 1) * groups + math.ceil((LAYERS - 1) / group_size)) * peer_writes(rig)
        assert sum(p.metrics.layerwise for p in rig.prefills) == expected
        assert all(p.metrics.fallbacks == [] for p in rig.prefills)
        every = frozenset(range(rig.g.num_buffers))
        gap = frozenset(rig.g.buffers_of_layer(missing))
        for p in rig.prefills:
            partial = [s for s in p.session.records[req.room].coverage.segments if s.buffers != every]
            assert len(partial) == 1 and every - partial[0].buffers == gap, partial


BATCH_CASES = [
    Case("mha", 16, 1, 2, 87, 32),
    Case("mla", 64, 1, 1, 148, 96),
    Case("mha", 1, 2, 1, 37, 16),
]


@pytest.mark.parametrize("case", BATCH_CASES, ids=str)
@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_several_requests_stream_in_one_batch(case, overlap):
    """Three requests share each forward: the case's request, a shorter one with a prefill
    cache hit and a decode prefix (it finishes passes earlier), and one that fits one pass; every
    room streams its own pages to its own destination."""
    P = case.page
    shapes = [(case.tokens, 0, 0), (case.tokens // 2 + 3, P + 3, P), (P + P // 2 + 1, 0, 0)]
    pages = sum(math.ceil(n / P) for n, _, _ in shapes) + 2
    geometry = Geometry(is_mla=case.pool == "mla", layers=LAYERS, page_size=P, pages=pages)
    with LayerwiseRig(geometry, prefill_tp=case.prefill_tp, decode_tp=case.decode_tp) as rig:
        reqs = [rig.request(30 + i, n, cached=c, decode_prefix=dp) for i, (n, c, dp) in enumerate(shapes)]
        for req in reqs:
            rig.open(req)
        streamed = rig.prefill_chunked(reqs, case.chunk, overlap=overlap)
        for req in reqs:
            rig.wait_success(req.room)
            assert rig.mismatches(req) == [], req.room
            # (a concluded room's session record is pruned at the next batch, so the streamed
            # ends returned per pass are what is left to check here)
            full, first = req.input_len // P, max(req.cached // P, req.first_page)
            assert streamed[req.room][-1] == [full * P if full > first else 0] * len(rig.prefills), req.room
        assert rig.write_counts_off(reqs) == []
        assert all(p.metrics.fallbacks == [] for p in rig.prefills)
        # one write per room, layer, pass that streamed and decode peer
        writes = sum(streaming_passes(streamed[req.room]) for req in reqs) * LAYERS * peer_writes(rig)
        assert sum(p.metrics.layerwise for p in rig.prefills) == writes


STALL_CASES = [
    Case("mha", 16, 1, 2, 87, 87),
    Case("mla", 64, 1, 1, 148, 148),
    Case("mha", 1, 1, 2, 37, 37),
]


class stalled:
    """Every lane of a prefill engine towards every peer stops sending until the block ends."""

    def __init__(self, prefill, lanes=(0, 1)):
        self.engine, self.lanes = prefill.engine.engine, lanes

    def __enter__(self):
        for lane in self.lanes:
            faults.stall_lane(self.engine, lane)
        return self

    def __exit__(self, *exc):
        faults.resume_lane(self.engine, None)


@pytest.mark.parametrize("case", STALL_CASES, ids=str)
def test_abort_mid_stream_lands_nothing_after_it(case):
    """Decode rank 0 aborts after two of three layers were handed off: the rest of the forward
    posts nothing, the ACK waits until the streamed writes drained, and the third layer's
    buffers never reach any decode rank."""
    with make_rig(case) as rig:
        (p,) = rig.prefills
        req = open_request(rig, case, 24)
        peers = len(rig.decodes)
        life = p.parts.rooms.get(req.room)
        with stalled(p):
            batch = p.session.begin_batch(rig.batch_view(req, 0, req.input_len))
            pool = p.pool()
            p.session.on_layer(batch, pool, 0)
            p.session.on_layer(batch, pool, 1)
            rig.wait(lambda: len(life.writes) == 2 * peers, "two layers' writes to every peer on the wire")
            d0 = rig.decodes[0]
            p.service.control.on_abort(d0.service.abort_message(req.room, 5))
            assert p.sglang.status(req.room) == S.FAILED
            p.session.on_layer(batch, pool, 2)
            p.session.end_batch(batch)
            rig.wait(batch.done.is_set, "the worker finished the batch")
            assert len(life.writes) == 2 * peers  # nothing posted after the abort
            assert p.sglang.acks_sent == []
        rig.wait(lambda: p.sglang.acks_sent, "the held ACK, once the streamed writes drained")
        assert p.sglang.acks_sent == [(req.room, "127.0.0.1", 17001, 5)]
        streamed = range(req.input_len // case.page)
        layer2 = rig.g.buffers_of_layer(2)
        for d in rig.decodes:
            assert all(not d.page(b, int(req.dst_pages[i])).any() for b in layer2 for i in range(req.num_pages))
        # the two layers already on the wire landed whole (a drained write, not a torn one)
        for d in rig.decodes:
            for b in (*rig.g.buffers_of_layer(0), *rig.g.buffers_of_layer(1)):
                for i in streamed:
                    assert np.array_equal(d.page(b, int(req.dst_pages[i])),
                                          rig.expected_page(d, b, int(req.src_pages[i]))), (d.tp_rank, b, i)


@pytest.mark.parametrize("case", STALL_CASES, ids=str)
@pytest.mark.parametrize("driver", DRIVERS)
def test_radix_checkpoint_moving_a_streamed_page_holds_the_next_forward(case, driver, stub_sender_module):
    """After the forward, SGLang's radix checkpoint dedups streamed page 1 into another page
    (the old one is freed) while its writes are stalled: the next forward waits until they are
    terminal; the last send() (from the moved row) does not write the streamed pages again.
    Through hooks.py: the checkpoint hook finds the hazard, the next run_batch hook waits."""
    hooks = driver == "hooks"
    with make_rig(case, via_hooks=hooks) as rig:
        (p,) = rig.prefills
        req = open_request(rig, case, 25)
        released = threading.Event()
        with stalled(p):
            if hooks:
                batch = rig.run_batch_through_hooks(p, rig.batch_view(req, 0, req.input_len).reqs, range(LAYERS))
                rig.checkpoint_through_hooks(p, req.room)
                assert p.session.hazards == []  # nothing moved
            else:
                batch = p.session.begin_batch(rig.batch_view(req, 0, req.input_len))
                rig.forward(p, batch)
                assert p.session.after_checkpoint(req.room, req.row, case.page) is False  # nothing moved
            assert batch is not None and batch.streams[0].room == req.room
            moved = req.row.copy()
            new_page = rig.free_src.pop()
            moved[case.page:2 * case.page] = new_page * case.page + np.arange(case.page)
            if hooks:
                rig.req_to_token[req.room] = moved
                rig.checkpoint_through_hooks(p, req.room)
                assert len(p.session.hazards) == 1

                def next_forward():  # another batch (none of our requests) through the run_batch hook
                    rig.run_batch_through_hooks(p, [], range(LAYERS))
                    released.set()
            else:
                assert p.session.after_checkpoint(req.room, moved, case.page) is True

                def next_forward():
                    p.session.wait_hazards()
                    released.set()
            waiter = threading.Thread(target=next_forward, daemon=True)
            waiter.start()
            assert not released.wait(0.2)  # the next forward (which could rewrite the old page) waits
        assert released.wait(10)
        waiter.join(10)
        pages = moved[0:req.input_len:case.page] // case.page
        p.session.add_chunk(req.room, pages, slice(0, len(pages)), True, aux_index=0)
        rig.wait_success(req.room)
        assert_landed(rig, req)  # from the original pages: the moved page was never read again
