"""Several prefill services (the CP or KV-shard ranks of one prefill) and one decode rank in this
process, on softio engines, with SGLang's own choice of what each rank sends.

Each rank's chunks go through SGLang 0.5.23's real `CommonKVSender._prepare_send_indices` (CP page
ranges, shard-owned pages, dummy CP ranks) and our manager's `prepare_send_state_indices`, exactly
as `MoriKVSender.send` runs them, then into the rank's real PrefillService. Decode's metadata goes
to the CP ranks SGLang's decode would target (`_resolve_rank_mapping`), and the decode's softio
write log counts how often every byte of its buffers was written.

    with ContextParallelRig([PrefillCP(cp_size=2, cp_rank=r, all_ranks_send=True) for r in (0, 1)],
                            decode_all_cp_ranks=True) as rig:
        rig.register(); rig.request(room=1, chunks=[[0, 1, 2], [3, 4]], dst=[10, 11, 12, 13, 14])
"""

from __future__ import annotations

from types import SimpleNamespace
from unittest import mock
from typing import List, Optional, Sequence

import numpy as np

import sglang_mori.softio as io
from sglang_mori.backend import room_status as S
from sglang_mori.backend.decode.service import AuxSlots, DecodeIdentity, DecodeParts, DecodeService
from sglang_mori.backend.peers import InflightBudget, PeerRegistry
from sglang_mori.backend.plans import KVPlanner, LocalBuffers, local_layout
from sglang_mori.backend.prefill.context_parallel import PrefillCP
from sglang_mori.backend.prefill.parts import PrefillParts
from sglang_mori.backend.prefill.service import PrefillService
from sglang_mori.config import MoriConfig
from sglang_mori.engine import TransferEngine
from sglang_mori.metrics import NullTransferMetrics
from sglang_mori.softio.write_log import enable_write_log, get_write_log

from fake_sglang import FakeSGLang
from rig import AUX_BYTES, AUX_SLOTS, BUFFERS, PAGE_BYTES, PAGES, WAIT_S, CapturingMessenger
from waiting import wait_until

STATE_ITEM = 64
STATE_ITEMS = 32


def logical_pool(seed: int = 11) -> dict:
    """The request's bytes as one unsharded prefill would hold them: KV per buffer, state, aux."""
    rng = np.random.default_rng(seed)
    return {
        "kv": [rng.integers(1, 256, PAGES * PAGE_BYTES, dtype=np.uint8) for _ in range(BUFFERS)],
        "state": rng.integers(1, 256, STATE_ITEMS * STATE_ITEM, dtype=np.uint8),
        "aux": rng.integers(1, 256, AUX_SLOTS * AUX_BYTES, dtype=np.uint8),
    }


def _striped(buf: np.ndarray, item: int, rank: int, size: int) -> np.ndarray:
    """What shard rank `rank` stores: logical item l (l % size == rank) at local item l // size."""
    items = buf.reshape(-1, item)
    out = np.zeros_like(items)
    mine = items[rank::size]
    out[:len(mine)] = mine
    return out.reshape(-1)


class _Rank:
    """One prefill rank's memory, engine and service."""

    def __init__(self, cp: PrefillCP, pool: dict, state_type: Optional[str], config: MoriConfig):
        self.cp = cp
        n, r = cp.kv_shard_size, cp.kv_shard_rank
        # CP ranks hold the request's KV and state alike; shard ranks hold their stripe of pages.
        self.kv = [_striped(b, PAGE_BYTES, r, n) for b in pool["kv"]]
        self.state = (_striped(pool["state"], STATE_ITEM, r, n) if state_type == "dsa"
                      else pool["state"].copy())
        self.aux = pool["aux"].copy()
        self.engine = TransferEngine(io, role="prefill", host="127.0.0.1", qp_per_transfer=2, post_batch_size=-1,
                                     num_workers=1)
        self.args = _kv_args(self.kv, self.state, self.aux, state_type)
        self.buffers = _register(self.engine, self.kv, self.state if state_type else None, self.aux)
        self.sglang = FakeSGLang(prefill_rank=cp.cp_rank if cp.cp_size > 1 else cp.kv_shard_rank)
        self.messenger = CapturingMessenger()
        self.rejections: list = []
        layout = local_layout(self.args, 1, 0, False)
        self.parts = PrefillParts(
            config=config, engine=self.engine, local=self.buffers,
            planner=KVPlanner(layout, self.buffers, kv_shard=(r, n)),
            peers=PeerRegistry(config.peer_fail_fast_s, InflightBudget.from_config(config)),
            messenger=self.messenger, metrics=NullTransferMetrics(), sglang=self.sglang,
            read_aux=lambda i: None if i is None else [self.aux[i * AUX_BYTES:(i + 1) * AUX_BYTES].tobytes()],
            owns_aux=cp.owns_aux, cp=cp,
        )
        self.service = PrefillService(self.parts, lambda err, origin: self.rejections.append(err))
        # What CommonKVManager.__init__ derives for this rank (SGLang 0.5.23, common/conn.py).
        self.mgr = SimpleNamespace(
            attn_cp_size=cp.cp_size, attn_cp_rank=cp.cp_rank, kv_shard_size=n, kv_shard_rank=r,
            enable_all_cp_ranks_for_transfer=cp.all_ranks_send,
            is_dummy_cp_rank=(not cp.all_ranks_send and not cp.tp_group_sharing and cp.cp_size > 1
                              and cp.cp_rank != 0),
            update_status=self.sglang.set_status,
        )


def _kv_args(kv, state, aux, state_type) -> SimpleNamespace:
    args = SimpleNamespace(
        kv_data_ptrs=[a.ctypes.data for a in kv], kv_data_lens=[a.nbytes for a in kv],
        kv_item_lens=[PAGE_BYTES] * len(kv), aux_data_ptrs=[aux.ctypes.data], aux_data_lens=[aux.nbytes],
        aux_item_lens=[AUX_BYTES], page_size=1, kv_cache_dtype_str="bfloat16",
    )
    if state_type:
        args.state_types = [state_type]
        args.state_item_lens = [[STATE_ITEM]]
        args.state_data_lens = [[state.nbytes]]
    return args


def _register(engine, kv, state, aux) -> LocalBuffers:
    return LocalBuffers(
        kv=[engine.register(a.ctypes.data, a.nbytes, -1, False) for a in kv],
        aux=[engine.register(aux.ctypes.data, aux.nbytes, -1, False)],
        state=[] if state is None else [[engine.register(state.ctypes.data, state.nbytes, -1, False)]],
    )


class ContextParallelRig:
    def __init__(self, ranks: Sequence[PrefillCP], *, decode_all_cp_ranks: bool = False,
                 state_type: Optional[str] = None, config: Optional[MoriConfig] = None):
        self.config = config or MoriConfig(transfer_shards=1, transfer_timeout_ms=5000)
        self.pool = logical_pool()
        self.state_type = state_type
        self.ranks = [_Rank(cp, self.pool, state_type, self.config) for cp in ranks]
        self.decode_kv = [np.zeros(PAGES * PAGE_BYTES, np.uint8) for _ in range(BUFFERS)]
        self.decode_state = np.zeros(STATE_ITEMS * STATE_ITEM, np.uint8)
        self.decode_aux = np.zeros(AUX_SLOTS * AUX_BYTES, np.uint8)
        self.decode_engine = TransferEngine(io, role="decode", host="127.0.0.1", qp_per_transfer=2,
                                            post_batch_size=-1, num_workers=1)
        enable_write_log(self.decode_engine.engine)
        args = _kv_args(self.decode_kv, self.decode_state, self.decode_aux, state_type)
        self.decode_buffers = _register(self.decode_engine, self.decode_kv,
                                        self.decode_state if state_type else None, self.decode_aux)
        self.decode_sglang = FakeSGLang()
        self.decode_service = DecodeService(DecodeParts(
            config=self.config, engine=self.decode_engine, local=self.decode_buffers,
            layout=local_layout(args, 1, 0, False),
            identity=DecodeIdentity("127.0.0.1", 17001, 1, 0, cp_all_ranks=decode_all_cp_ranks),
            aux=AuxSlots(list(args.aux_data_ptrs), [AUX_BYTES], [self.decode_aux.nbytes]),
            messenger=CapturingMessenger(), metrics=NullTransferMetrics(), sglang=self.decode_sglang,
        ), lambda err, origin: None)
        self.decode_all_cp_ranks = decode_all_cp_ranks

    def __enter__(self):
        for rank in self.ranks:
            rank.service.start()
        return self

    def __exit__(self, *exc):
        for rank in self.ranks:
            rank.service.stop()
            rank.engine.deregister_all()
        self.decode_engine.deregister_all()

    # --- decode ------------------------------------------------------------------------------
    def register(self) -> None:
        """Decode registers with the ranks it targets (all CP ranks, or CP rank 0 only)."""
        message = self.decode_service.registration()
        for rank in self.targeted():
            rank.service.control.on_register(message)

    def targeted(self) -> List[_Rank]:
        """The prefill ranks SGLang's decode sends metadata to and waits for a Success from."""
        cp = self.ranks[0].cp
        if cp.decode_sees_cp and not cp.decode_pulls_all(self.decode_all_cp_ranks):
            return [r for r in self.ranks if r.cp.cp_rank == 0]
        return list(self.ranks)

    def peer(self, rank: _Rank):
        return rank.parts.peers.get(self.decode_engine.key)

    # --- one request, as SGLang's decode receiver and prefill senders run it --------------------
    def request(self, room: int, chunks: Sequence[Sequence[int]], dst: Sequence[int], aux_index: int = 0,
                src_aux: int = 0, src_state: Optional[Sequence[int]] = None,
                dst_state: Optional[Sequence[int]] = None) -> None:
        """Decode bootstraps `room` with pages `dst`; every prefill rank's scheduler then sends
        the request's logical pages in `chunks` (and state `src_state` on the last chunk)."""
        self.decode_sglang.open(room)
        self.decode_service.new_receiver(room)
        for rank in self.targeted():
            rank.service.control.on_metadata(self.decode_service.record_destination(
                bootstrap_room=room, required_dst_info_num=1, kv_indices=np.asarray(dst), aux_index=aux_index,
                state_indices=None if dst_state is None else [list(dst_state)], decode_prefix_len=None,
                is_dummy=False))
        total = sum(len(c) for c in chunks)
        for rank in self.ranks:
            self._send(rank, room, chunks, total, src_aux, src_state)

    @staticmethod
    def _send(rank: _Rank, room: int, chunks, total: int, src_aux: int, src_state) -> None:
        """MoriKVSender's life on one rank: claim, then SGLang's send() per chunk."""
        from sglang.srt.disaggregation.common import conn as sglang_conn

        from sglang_mori.backend.manager import MoriKVManager

        parallel = SimpleNamespace(enable_dsa_cache_layer_split=rank.cp.dsa_layer_split,
                                   enable_cp_tp_group_sharing=rank.cp.tp_group_sharing)
        with mock.patch.object(sglang_conn, "get_parallel", lambda: parallel):
            CommonKVSender = sglang_conn.CommonKVSender
            rank.sglang.open(room)
            rank.service.claim(room)
            sender = SimpleNamespace(curr_idx=0, num_kv_indices=total, kv_mgr=rank.mgr, bootstrap_room=room)
            for i, chunk in enumerate(chunks):
                last = i == len(chunks) - 1
                state = [np.asarray(src_state)] if (last and src_state is not None) else None
                kv, index_slice, is_last, skip = CommonKVSender._prepare_send_indices(
                    sender, np.asarray(chunk, dtype=np.int32), state)
                if skip:
                    continue
                state = MoriKVManager.prepare_send_state_indices(SimpleNamespace(cp=rank.cp), state)
                rank.service.add_chunk(room, kv, index_slice, is_last, aux_index=src_aux if is_last else None,
                                       state_indices=state if is_last else None)

    # --- what arrived -----------------------------------------------------------------------
    def wait(self, predicate, what: str, timeout_s: float = WAIT_S):
        return wait_until(predicate, what, timeout_s)

    def wait_concluded(self, room: int) -> None:
        """Every prefill rank's room is terminal in SGLang's table."""
        self.wait(lambda: all(r.sglang.status(room) in S.TERMINAL for r in self.ranks),
                  f"room {room} concluded on every prefill rank")

    def statuses(self, room: int) -> list:
        """Every RoomStatus the prefill ranks sent to decode for `room`."""
        from sglang_mori import protocol

        return [m for r in self.ranks for m in r.messenger.of_type(protocol.RoomStatus, room)]

    def write_counts(self, desc, nbytes: int) -> np.ndarray:
        """How many times each byte of one decode buffer was written."""
        counts = np.zeros(nbytes, dtype=np.int64)
        for rec in get_write_log(self.decode_engine.engine, desc.id):
            counts[rec.offset:rec.offset + rec.size] += 1
        return counts

    def kv_write_counts(self, buffer: int) -> np.ndarray:
        return self.write_counts(self.decode_buffers.kv[buffer], self.decode_kv[buffer].nbytes)

    def state_write_counts(self) -> np.ndarray:
        return self.write_counts(self.decode_buffers.state[0][0], self.decode_state.nbytes)
