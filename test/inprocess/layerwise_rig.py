"""A layer-wise rig with real KV geometry: MHA or MLA pools of any page size, and prefill/decode
attention-TP groups of different sizes (MHA head slicing), on softio engines, in one process.

Each prefill TP rank is a prefill service with its own layer-wise session (built as
`assembly.build_session` builds it); each decode TP rank a decode service whose registration and
metadata are handed to the prefill ranks SGLang pairs it with. Tests drive every prefill rank the
way hooks.py drives it (begin_batch, on_layer per layer over the rank's own pool, end_batch) and
SGLang's `send()` the way `_send_kv_chunk` cuts it (full pages only for non-last chunks,
`index_slice` from the sender's running page count), see `LayerwiseRig.prefill_chunked`. With
`via_hooks=True` the passes go through hooks.py's AROUND hooks themselves (run_batch, attention
forward, checkpoint), over stand-ins for SGLang's scheduler, batch, Req and attention backend.
Decode's services only register and describe destinations here; what prefill tells them is
captured, not applied.

Byte layout of a page, as SGLang's pools hold it: MHA (NHD) [page_size, heads_of_this_rank,
head_bytes] per K or V buffer (head-major, HND: [heads, page_size, head_bytes]), buffers ordered K
of every layer then V of every layer; MLA [page_size, latent_bytes], one buffer per layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import List, Optional

import msgspec
import numpy as np

import sglang_mori.softio as io
from sglang_mori.backend import room_status as S
from sglang_mori.backend.decode.service import AuxSlots, DecodeIdentity, DecodeParts, DecodeService
from sglang_mori.backend.peers import InflightBudget, PeerRegistry
from sglang_mori.backend.plans import LocalBuffers, local_layout
from sglang_mori.backend.prefill.layerwise.mapping import LayerBufferMap
from sglang_mori.backend.prefill.layerwise.planner import LayerwisePlanner
from sglang_mori.backend.prefill.layerwise.session import BatchView, LayerwiseSession, ReqView
from sglang_mori.backend.prefill.parts import PrefillParts
from sglang_mori.backend.prefill.service import PrefillService
from sglang_mori.config import MoriConfig
from sglang_mori.engine import TransferEngine
from sglang_mori.metrics import NullTransferMetrics
from sglang_mori.planning.head_slice import decode_ranks_for_prefill_rank
from sglang_mori.planning.physical_layout import HND
from sglang_mori.softio.write_log import enable_write_log, get_write_log

from fake_sglang import FakeSGLang
from rig import CapturingMessenger
from waiting import wait_until

AUX_BYTES = 16
AUX_SLOTS = 4
WAIT_S = 20.0


@dataclass(frozen=True)
class Geometry:
    is_mla: bool
    layers: int
    page_size: int
    pages: int  # pages per KV buffer
    kv_heads: int = 4  # MHA: KV heads of the model
    head_bytes: int = 4  # MHA: head_dim * dtype size
    latent_bytes: int = 24  # MLA: bytes of one token's latent KV
    head_major: bool = False  # MHA pages [heads, page_size, head_bytes] (HND), not NHD

    @property
    def num_buffers(self) -> int:
        return self.layers if self.is_mla else 2 * self.layers

    def buffers_of_layer(self, layer: int) -> tuple:
        """Registered KV buffer indices of a layer (MHA: K then V; MLA: the latent buffer)."""
        return (layer,) if self.is_mla else (layer, self.layers + layer)

    def heads(self, tp_size: int) -> int:
        return self.kv_heads // tp_size

    def token_bytes(self, tp_size: int) -> int:
        return self.latent_bytes if self.is_mla else self.heads(tp_size) * self.head_bytes

    def item_len(self, tp_size: int) -> int:
        return self.page_size * self.token_bytes(tp_size)


class CountingMetrics(NullTransferMetrics):
    def __init__(self):
        self.layerwise = 0
        self.late = 0  # optimistic requests that joined a forward's stream
        self.late_after_hooks = 0  # of those, joined after the forward's layer hooks
        self.fallbacks: list = []

    def layerwise_writes(self, n: int = 1) -> None:
        self.layerwise += n

    def layerwise_fallback(self, reason: str, n: int = 1) -> None:
        self.fallbacks.extend([reason] * n)

    def layerwise_late_destinations(self, n: int = 1) -> None:
        self.late += n

    def layerwise_late_after_hooks(self, n: int = 1) -> None:
        self.late_after_hooks += n


class Rank:
    """One TP rank's registered memory and engine."""

    def __init__(self, role: str, geometry: Geometry, tp_size: int, tp_rank: int, seed: Optional[int]):
        g = geometry
        self.geometry, self.tp_size, self.tp_rank = g, tp_size, tp_rank
        self.item_len = g.item_len(tp_size)
        size = g.pages * self.item_len
        rng = np.random.default_rng(seed)
        self.kv = [rng.integers(1, 256, size, dtype=np.uint8) if seed is not None else np.zeros(size, np.uint8)
                   for _ in range(g.num_buffers)]
        self.aux = (rng.integers(1, 256, AUX_SLOTS * AUX_BYTES, dtype=np.uint8) if seed is not None
                    else np.zeros(AUX_SLOTS * AUX_BYTES, np.uint8))
        self.engine = TransferEngine(io, role=role, host="127.0.0.1", qp_per_transfer=2, post_batch_size=-1,
                                     num_workers=1)
        args = SimpleNamespace(
            kv_data_ptrs=[a.ctypes.data for a in self.kv], kv_data_lens=[a.nbytes for a in self.kv],
            kv_item_lens=[self.item_len] * g.num_buffers, aux_data_ptrs=[self.aux.ctypes.data],
            aux_data_lens=[self.aux.nbytes], aux_item_lens=[AUX_BYTES], page_size=g.page_size,
            kv_cache_dtype_str="bfloat16",
        )
        if not g.is_mla:
            args.kv_head_num, args.total_kv_head_num = g.heads(tp_size), g.kv_heads
        self.args = args
        self.layout = local_layout(args, tp_size, tp_rank, g.is_mla)
        if g.head_major:  # what SGLANG_USE_HND_KVCACHE would make physical_kv_layout() report
            self.layout = msgspec.structs.replace(self.layout, kv_physical_layout=HND)
        self.buffers = LocalBuffers(
            kv=[self.engine.register(a.ctypes.data, a.nbytes, -1, False) for a in self.kv],
            aux=[self.engine.register(self.aux.ctypes.data, self.aux.nbytes, -1, False)], state=[])

    def page(self, buffer: int, page: int) -> np.ndarray:
        return self.kv[buffer][page * self.item_len:(page + 1) * self.item_len]

    def pool(self) -> SimpleNamespace:
        """The KV pool the forward writes (what mapping.py reads tensors from); one object for
        the rank's life, as SGLang's pool is (mapping.py caches per pool object)."""
        if getattr(self, "_pool", None) is None:
            layers = self.geometry.layers
            self._pool = (SimpleNamespace(kv_buffer=self.kv, start_layer=0) if self.geometry.is_mla else
                          SimpleNamespace(k_buffer=self.kv[:layers], v_buffer=self.kv[layers:], start_layer=0))
        return self._pool


class PrefillRank(Rank):
    def __init__(self, geometry, tp_size, tp_rank, config: MoriConfig, group_size: int):
        super().__init__("prefill", geometry, tp_size, tp_rank, seed=100 + tp_rank)
        self.sglang = FakeSGLang(prefill_rank=tp_rank)
        self.messenger = CapturingMessenger()
        self.metrics = CountingMetrics()
        self.rejections: list = []
        self.parts = PrefillParts(
            config=config, engine=self.engine, local=self.buffers,
            planner=LayerwisePlanner(self.layout, self.buffers),
            peers=PeerRegistry(config.peer_fail_fast_s, InflightBudget.from_config(config)),
            messenger=self.messenger, metrics=self.metrics, sglang=self.sglang,
            read_aux=lambda i: None if i is None else [self.aux[i * AUX_BYTES:(i + 1) * AUX_BYTES].tobytes()],
        )
        self.service = PrefillService(self.parts, lambda err, origin: self.rejections.append(err))
        # as assembly.build_session builds it (no draft buffers here)
        self.session = LayerwiseSession(
            self.parts, self.service, LayerBufferMap(self.args.kv_data_ptrs, 0, geometry.is_mla),
            group_size=group_size, min_tokens=0)


class DecodeRank(Rank):
    def __init__(self, geometry, tp_size, tp_rank, config: MoriConfig):
        super().__init__("decode", geometry, tp_size, tp_rank, seed=None)
        self.sglang = FakeSGLang()
        self.rejections: list = []
        self.service = DecodeService(DecodeParts(
            config=config, engine=self.engine, local=self.buffers, layout=self.layout,
            identity=DecodeIdentity("127.0.0.1", 17001 + tp_rank, tp_size, tp_rank),
            aux=AuxSlots(list(self.args.aux_data_ptrs), [AUX_BYTES], [self.aux.nbytes]),
            messenger=CapturingMessenger(), metrics=NullTransferMetrics(), sglang=self.sglang,
        ), lambda err, origin: self.rejections.append(err))
        enable_write_log(self.engine.engine)

    def kv_region_ids(self) -> List[int]:
        return [d.id for d in self.buffers.kv]

    def write_log(self) -> list:
        return get_write_log(self.engine.engine)


def mori_sender_class():
    """The class hooks.py recognises our requests by. Importing the real one imports SGLang
    (seconds), so unless some test did already, a stand-in module takes its place (installed by
    the `stub_sender_module` fixture of the tests that go through hooks.py)."""
    import sys

    return sys.modules["sglang_mori.backend.sender"].MoriKVSender


@dataclass
class Request:
    room: int
    input_len: int
    page_size: int
    src_pages: np.ndarray  # prefill page per request page (the same on every prefill TP rank)
    dst_pages: np.ndarray  # decode page per request page (the same on every decode TP rank)
    row: np.ndarray  # req_to_token row: token slots
    cached: int = 0  # tokens prefill's radix cache already holds (the first pass starts there)
    decode_prefix: int = 0  # decode's cached prefix (page-aligned): decode's kv_indices start after it
    sent_pages: set = field(default_factory=set)  # request pages send() handed over so far

    @property
    def num_pages(self) -> int:
        return len(self.src_pages)

    @property
    def first_page(self) -> int:
        """The request page decode's kv_indices[0] receives (pages before it decode holds)."""
        return self.decode_prefix // self.page_size

    @property
    def decode_pages(self) -> range:
        """The request pages this transfer moves."""
        return range(self.first_page, self.num_pages)


class LayerwiseRig:
    def __init__(self, geometry: Geometry, prefill_tp: int = 1, decode_tp: int = 1, group_size: int = 1,
                 config: Optional[MoriConfig] = None, via_hooks: bool = False):
        self.g = geometry
        # True: passes go through hooks.py's AROUND hooks with stand-ins for SGLang's scheduler,
        # batch, Req and attention backend (run_batch_through_hooks); False: the session directly
        self.via_hooks = via_hooks
        self.req_to_token: dict = {}  # req_pool_idx -> row (what hooks.py indexes)
        self.config = config or MoriConfig(transfer_shards=2, transfer_timeout_ms=5000)
        self.prefills = [PrefillRank(geometry, prefill_tp, r, self.config, group_size) for r in range(prefill_tp)]
        self.decodes = [DecodeRank(geometry, decode_tp, r, self.config) for r in range(decode_tp)]
        # SGLang's pairing: the decode ranks each prefill rank writes
        self.pairs = {p.tp_rank: list(decode_ranks_for_prefill_rank(prefill_tp, p.tp_rank, decode_tp))
                      for p in self.prefills}
        self.rng = np.random.default_rng(1234)
        # free pages, shuffled: requests get scattered, distinct pages on both sides
        self.free_src = list(self.rng.permutation(geometry.pages))
        self.free_dst = list(self.rng.permutation(geometry.pages))

    def __enter__(self):
        for p in self.prefills:
            p.service.start()
            p.session.start()
        try:
            for p in self.prefills:
                for d in self.paired_decodes(p):
                    p.service.control.on_register(d.service.registration())
                assert not p.rejections, p.rejections
                peers = [p.parts.peers.get(k) for k in p.parts.peers.keys()]
                assert len(peers) == len(self.paired_decodes(p)), peers
                assert all(peer.rejected is None for peer in peers), [peer.rejected for peer in peers]
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc):
        for p in self.prefills:
            p.session.stop()
            p.service.stop()
        for rank in (*self.prefills, *self.decodes):
            rank.engine.deregister_all()

    def paired_decodes(self, prefill: PrefillRank) -> List[DecodeRank]:
        return [self.decodes[d] for d in self.pairs[prefill.tp_rank]]

    def is_dummy(self, prefill: PrefillRank) -> bool:
        """SGLang's receiver (`_resolve_rank_mapping`): with MLA and prefill TP > decode TP a decode
        rank reads the (replicated) latent KV from the first prefill rank of its group only; it
        tells the others with dummy metadata. With MHA every paired prefill rank writes its heads."""
        ratio = len(self.prefills) // len(self.decodes)
        return self.g.is_mla and ratio > 1 and prefill.tp_rank % ratio != 0

    def writing_decodes(self, prefill: PrefillRank) -> List[DecodeRank]:
        """The decode ranks `prefill` writes to (none for a rank that only gets dummy metadata)."""
        return [] if self.is_dummy(prefill) else self.paired_decodes(prefill)

    # --- one request ----------------------------------------------------------------------------
    def request(self, room: int, input_len: int, cached: int = 0, decode_prefix: int = 0) -> Request:
        """Pages for a request: scattered, distinct, on both sides; a req_to_token row over them.
        `cached`: prefill's radix-cache hit; `decode_prefix`: the prefix decode already holds."""
        assert decode_prefix % self.g.page_size == 0
        n = math.ceil(input_len / self.g.page_size)
        assert n <= min(len(self.free_src), len(self.free_dst)), "the rig's geometry has too few pages"
        src = np.array([self.free_src.pop() for _ in range(n)], dtype=np.int64)
        dst = np.array([self.free_dst.pop() for _ in range(n)], dtype=np.int64)
        tokens = np.arange(input_len, dtype=np.int64)
        row = src[tokens // self.g.page_size] * self.g.page_size + tokens % self.g.page_size
        self.req_to_token[room] = row  # the request's req_pool_idx is its room here
        return Request(room, input_len, self.g.page_size, src, dst, row, cached, decode_prefix)

    def open(self, req: Request, aux_index: int = 1) -> None:
        """Every decode rank's receiver tells its paired prefill ranks; every prefill rank claims."""
        for d in self.decodes:
            d.sglang.open(req.room)
            d.service.new_receiver(req.room)
        for p in self.prefills:
            self.destinations(p, req, aux_index)
            p.sglang.open(req.room)
            assert p.service.claim(req.room) is None

    def claim_pending(self, req: Request) -> None:
        """Decode's receivers start and every prefill rank claims; no destinations yet (what SGLang's
        optimistic prefill runs a forward on: `destinations` comes later)."""
        for d in self.decodes:
            d.sglang.open(req.room)
            d.service.new_receiver(req.room)
        for p in self.prefills:
            p.sglang.open(req.room)
            assert p.service.claim(req.room) is None

    def destinations(self, p: PrefillRank, req: Request, aux_index: int = 1) -> None:
        """Every decode rank paired with prefill rank `p` sends it the request's destinations."""
        decodes = self.paired_decodes(p)
        for d in decodes:
            p.service.control.on_metadata(d.service.record_destination(
                bootstrap_room=req.room, required_dst_info_num=len(decodes),
                kv_indices=req.dst_pages[req.first_page:], aux_index=aux_index, state_indices=None,
                decode_prefix_len=req.decode_prefix or None, is_dummy=self.is_dummy(p)))

    # --- through hooks.py ------------------------------------------------------------------------
    def scheduler(self, p: PrefillRank) -> SimpleNamespace:
        """What hooks.py reads of SGLang's Scheduler on prefill rank `p`."""
        return SimpleNamespace(
            disagg_prefill_bootstrap_queue=SimpleNamespace(kv_manager=SimpleNamespace(layerwise=p.session)),
            token_to_kv_pool_allocator=SimpleNamespace(page_size=self.g.page_size, get_kvcache=p.pool),
            req_to_token_pool=SimpleNamespace(req_to_token=self.req_to_token))

    def run_batch_through_hooks(self, p: PrefillRank, views, layers, after_layer=None):
        """One extend batch through `around_run_batch`, whose forward calls
        `around_attention_forward` after each layer (then `after_layer(layer)`, if given); the
        published LayerBatch, or None."""
        from sglang_mori.backend.prefill.layerwise import hooks

        sender_class = mori_sender_class()
        extend = SimpleNamespace(is_extend=lambda: True)
        reqs = [SimpleNamespace(
            disagg_kv_sender=object.__new__(sender_class), kv=SimpleNamespace(req_pool_idx=v.room),
            bootstrap_room=v.room, origin_input_ids=range(v.input_len), disagg_decode_prefix_len=v.decode_prefix_len,
            start_send_idx=v.start_send_idx, pending_bootstrap=v.pending_bootstrap) for v in views]
        batch = SimpleNamespace(forward_mode=extend, spec_algorithm=None, tbo_split_seq_index=None, reqs=reqs,
                                prefix_lens=[v.prefix_len for v in views], extend_lens=[v.extend_len for v in views])
        backend = SimpleNamespace()  # no pool of its own: the hook uses the scheduler's
        published = []

        def attention(backend, q, k, v, layer, forward_batch):
            return q

        def forward(scheduler, batch):
            current = getattr(hooks._current, "published", None)
            published.append(None if current is None else current[1])
            q = np.zeros(1)  # not a CUDA tensor: no device event
            for layer in layers:
                hooks.around_attention_forward(attention, backend, q, None, None, SimpleNamespace(layer_id=layer),
                                               SimpleNamespace(forward_mode=extend))
                if after_layer is not None:
                    after_layer(layer)
            return "forward result"

        assert hooks.around_run_batch(forward, self.scheduler(p), batch) == "forward result"
        assert getattr(hooks._current, "published", None) is None
        return published[0]

    def checkpoint_through_hooks(self, p: PrefillRank, room: int) -> None:
        """SGLang's radix checkpoint of `room` on rank `p` through `around_checkpoint` (the row in
        `req_to_token` is what the checkpoint left)."""
        from sglang_mori.backend.prefill.layerwise import hooks

        req = SimpleNamespace(kv=SimpleNamespace(req_pool_idx=room), bootstrap_room=room)
        hooks.around_checkpoint(lambda scheduler, req: None, self.scheduler(p), req)

    def batch_view(self, req: Request, lo: int, hi: int, start_send: Optional[int] = None) -> BatchView:
        """What hooks.batch_view reads of a batch extending `req` over tokens [lo, hi)."""
        return BatchView([ReqView(room=req.room, prefix_len=lo, extend_len=hi - lo, input_len=req.input_len,
                                  decode_prefix_len=req.decode_prefix,
                                  start_send_idx=req.decode_prefix if start_send is None else start_send,
                                  row=req.row)], page_size=self.g.page_size)

    def forward(self, prefill: PrefillRank, batch, layers=None) -> None:
        """What the attention hook does during one forward of `prefill` (all layers by default)."""
        pool = prefill.pool()
        for layer in range(self.g.layers) if layers is None else layers:
            prefill.session.on_layer(batch, pool, layer)
        prefill.session.end_batch(batch)

    def prefill_chunked(self, reqs, chunk_tokens: int, *, overlap: bool = False,
                        on_pass_sent=None, hook_layers=None, aux_index: int = 0):
        """Run the requests' chunked prefill layer-wise, the TP ranks in lockstep (each pass runs
        on every prefill rank, as one TP group's forward does), with SGLang's send() after each
        pass. Pass k is one batch holding pass k of every request that has one (a request's first
        pass starts at its cached prefix). Returns, per pass, each prefill rank's streamed token
        end (a page boundary): for one request a list, for a list of requests a dict by room.

        overlap=False: per pass, begin_batch, forward, end_batch on every rank, then, once the
        pass's streamed writes are terminal, `on_pass_sent(pass, [streamed end per rank])` and
        every rank's send(): the callback can prove the streamed pages landed on decode by
        themselves. overlap=True: the overlap scheduler's order, pass k+1 is published and run
        before pass k's send(). hook_layers(pass) -> the layers whose attention hook fires in
        that pass (None: all)."""
        single = isinstance(reqs, Request)
        reqs = [reqs] if single else list(reqs)
        P = self.g.page_size
        passes = {}
        for req in reqs:
            bounds = list(range(req.cached, req.input_len, chunk_tokens)) + [req.input_len]
            passes[req.room] = list(zip(bounds[:-1], bounds[1:]))
        # SGLang's finalize_bootstrap: start_send_idx = decode_prefix_len; the sender's curr_idx = 0
        states = {(p.tp_rank, req.room): SimpleNamespace(start_send=req.decode_prefix, curr_idx=0, pending=None)
                  for p in self.prefills for req in reqs}
        streamed = {req.room: [] for req in reqs}
        for k in range(max(len(v) for v in passes.values())):
            active = [req for req in reqs if k < len(passes[req.room])]
            batches = []
            for p in self.prefills:
                views = [ReqView(room=req.room, prefix_len=passes[req.room][k][0],
                                 extend_len=passes[req.room][k][1] - passes[req.room][k][0],
                                 input_len=req.input_len, decode_prefix_len=req.decode_prefix,
                                 start_send_idx=states[p.tp_rank, req.room].start_send, row=req.row)
                         for req in active]
                layers = range(self.g.layers) if hook_layers is None or hook_layers(k) is None else hook_layers(k)
                if self.via_hooks:
                    batch = self.run_batch_through_hooks(p, views, layers)
                else:
                    batch = p.session.begin_batch(BatchView(views, page_size=P))
                    if batch is not None:
                        self.forward(p, batch, layers)
                if batch is not None:
                    batches.append((p, batch))
                for req in active:  # overlap: the previous pass's send comes only now
                    state = states[p.tp_rank, req.room]
                    if state.pending is not None:
                        self._send(p, req, state, *state.pending, aux_index)
                        state.pending = None
            for req in active:
                streamed[req.room].append([self._streamed_until(p, req.room) for p in self.prefills])
            sends = []
            for req in active:
                hi = passes[req.room][k][1]
                last = k == len(passes[req.room]) - 1
                if overlap and not last:
                    for p in self.prefills:
                        states[p.tp_rank, req.room].pending = (hi, last)
                else:
                    sends.append((req, hi, last))
            if not sends:
                continue
            if not overlap:
                for p, batch in batches:
                    for stream in batch.streams:
                        self.wait_quiet(p, stream.room, batch)
                if on_pass_sent is not None:
                    on_pass_sent(k, streamed[reqs[0].room][-1])
            for req, hi, last in sends:
                for p in self.prefills:
                    self._send(p, req, states[p.tp_rank, req.room], hi, last, aux_index)
        return streamed[reqs[0].room] if single else streamed

    @staticmethod
    def _streamed_until(p: PrefillRank, room: int) -> int:
        record = p.session.records.get(room)
        return record.streamed_until if record is not None else 0

    def _send(self, p: PrefillRank, req: Request, state, extend_end: int, last: bool, aux_index: int) -> None:
        """SGLang's _send_kv_chunk + CommonKVSender.send, for one prefill rank."""
        P = self.g.page_size
        end = min(extend_end, req.input_len)
        if not last:
            end -= end % P  # a trailing partial page waits for the next send
        if end < state.start_send:
            return
        pages = req.row[state.start_send:end:P] // P
        if len(pages) or last:
            index_slice = slice(state.curr_idx, state.curr_idx + len(pages))
            # SGLang's last send() of a model without state types passes state_indices=[], not None.
            p.session.add_chunk(req.room, pages, index_slice, last, aux_index=aux_index if last else None,
                                state_indices=[] if last else None)
            state.curr_idx += len(pages)
            req.sent_pages.update(range(req.first_page + index_slice.start, req.first_page + index_slice.stop))
        state.start_send = end

    # --- waiting ----------------------------------------------------------------------------
    def wait(self, predicate, what: str, timeout_s: float = WAIT_S):
        return wait_until(predicate, what, timeout_s, interval_s=0.002)

    def wait_quiet(self, p: PrefillRank, room: int, batch) -> None:
        """The worker finished `batch` and every write of the room so far is terminal."""
        def quiet():
            if not batch.done.is_set():
                return False
            with p.parts.rooms.lock:
                life = p.parts.rooms.get(room)
                return life is not None and life.outstanding() == 0
        self.wait(quiet, f"prefill rank {p.tp_rank}: room {room}'s streamed writes terminal")

    def wait_success(self, room: int) -> None:
        for p in self.prefills:
            self.wait(lambda: p.sglang.status(room) in (S.SUCCESS, S.FAILED), f"room {room} concluded")
            assert p.sglang.status(room) == S.SUCCESS, p.sglang.failure_reason(room)

    # --- what decode must hold -------------------------------------------------------------------
    def expected_page(self, d: DecodeRank, buffer: int, page: int) -> np.ndarray:
        """Decode rank `d`'s bytes of request page `page`'s source, assembled from the prefill
        ranks' pages independently of the planner: MLA latent pages are copied whole; MHA pages
        are [page_size, heads, head_bytes] and decode rank d holds the model heads
        [d*hd, (d+1)*hd), which live on the prefill rank(s) holding them."""
        g = self.g
        if g.is_mla:
            (p,) = [p for p in self.prefills if d in self.writing_decodes(p)]
            return p.page(buffer, page)
        hp, hd = g.heads(self.prefills[0].tp_size), g.heads(d.tp_size)
        heads = slice(d.tp_rank * hd, (d.tp_rank + 1) * hd)
        if g.head_major:  # [heads, page_size, head_bytes]
            full = np.concatenate([p.page(buffer, page).reshape(hp, g.page_size, g.head_bytes)
                                   for p in self.prefills], axis=0)
            return full[heads].reshape(-1)
        full = np.concatenate([p.page(buffer, page).reshape(g.page_size, hp, g.head_bytes)
                               for p in self.prefills], axis=1)  # [page_size, all heads, head_bytes]
        return full[:, heads, :].reshape(-1)

    def mismatches(self, req: Request, pages=None) -> list:
        """(decode rank, buffer, request page) whose decode bytes differ from the source; by
        default over every page the transfer moves."""
        bad = []
        for d in self.decodes:
            for b in range(self.g.num_buffers):
                for i in req.decode_pages if pages is None else pages:
                    if not np.array_equal(d.page(b, int(req.dst_pages[i])),
                                          self.expected_page(d, b, int(req.src_pages[i]))):
                        bad.append((d.tp_rank, b, i))
        return bad

    def untouched(self, req: Request, pages) -> bool:
        """Decode pages of these request pages are still all zero on every decode rank."""
        return all(not d.page(b, int(req.dst_pages[i])).any()
                   for d in self.decodes for b in range(self.g.num_buffers) for i in pages)

    def streamed_pages(self, p: PrefillRank, req: Request) -> set:
        """Request pages prefill rank `p` streamed with every KV buffer (its session's coverage)."""
        every = frozenset(range(self.g.num_buffers))
        record = p.session.records.get(req.room)
        segments = list(record.coverage.segments) if record is not None else []
        return {req.first_page + i for s in segments if s.buffers == every for i in range(s.page_lo, s.page_hi)}

    def kv_writes_into(self, d: DecodeRank, req: Request, pages, since: int = 0) -> list:
        """Write-log records from `since` that touch decode KV bytes of these request pages."""
        ids = set(d.kv_region_ids())
        spans = [(int(req.dst_pages[i]) * d.item_len, (int(req.dst_pages[i]) + 1) * d.item_len) for i in pages]
        return [r for r in d.write_log()[since:] if r.region_id in ids
                and any(r.offset < hi and lo < r.offset + r.size for lo, hi in spans)]

    def write_counts_off(self, reqs) -> list:
        """(decode rank, buffer, room, request page or None) where decode's KV bytes were not
        written exactly once: each byte of the pages the transfers of `reqs` move once (whoever
        wrote it, streamed or sent), every other byte (other pages, decode's cached prefix) never."""
        reqs = [reqs] if isinstance(reqs, Request) else list(reqs)
        bad = []
        for d in self.decodes:
            by_region = {rid: b for b, rid in enumerate(d.kv_region_ids())}
            counts = [np.zeros(a.nbytes, np.int32) for a in d.kv]
            for r in d.write_log():
                if r.region_id in by_region:
                    counts[by_region[r.region_id]][r.offset:r.offset + r.size] += 1
            for b, c in enumerate(counts):
                for req in reqs:
                    for i in req.decode_pages:
                        page = int(req.dst_pages[i])
                        span = c[page * d.item_len:(page + 1) * d.item_len]
                        if not (span == 1).all():
                            bad.append((d.tp_rank, b, req.room, i))
                        span[:] = 0
                if c.any():
                    bad.append((d.tp_rank, b, None, None))
        return bad
