"""Both sides of one PD pair in this process, on softio host memory, wired as in production:
decode's metadata reaches prefill's control thread over ZMQ, prefill's Success (and a TransferStarted
for a room whose writes outlive SGLANG_MORI_ANNOUNCE_GRACE_MS) reach decode's status thread over
ZMQ (our Messenger). SGLang's per-room tables are stood in by
FakeSGLang (test/inprocess), so nothing here imports SGLang or torch.

Shapes keep real layer, buffer and page counts (what our Python's cost follows); the bytes per
token are shrunk by default (`token_bytes`) so an 8K-token pool fits a shared CPU host: the planner,
the plans and every call are the same, only softio's copies are smaller.
"""

from __future__ import annotations

import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import zmq

import sglang_mori.softio as io
from sglang_mori import protocol
from sglang_mori.backend import room_status as S
from sglang_mori.backend.decode.service import AuxSlots, DecodeIdentity, DecodeParts, DecodeService
from sglang_mori.backend.messenger import Messenger
from sglang_mori.backend.peers import InflightBudget, PeerRegistry
from sglang_mori.backend.plans import KVPlanner, LocalBuffers, local_layout
from sglang_mori.backend.prefill.parts import PrefillParts
from sglang_mori.backend.prefill.service import PrefillService
from sglang_mori.config import MoriConfig
from sglang_mori.engine import TransferEngine
from sglang_mori.metrics import NullTransferMetrics

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "inprocess"))
from fake_sglang import FakeSGLang  # noqa: E402

AUX_BYTES = 64
AUX_SLOTS = 256


@dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    is_mla: bool
    page_size: int
    kv_heads: int = 0  # MHA

    @property
    def buffers(self) -> int:
        return self.layers if self.is_mla else 2 * self.layers


SHAPES = {
    "mla61p64": Shape("deepseek-v3 MLA, 61 layers, page 64", 61, True, 64),
    "gqa32p16": Shape("llama-3-8b GQA, 32 layers (K and V), page 16", 32, False, 16, kv_heads=8),
}


def kv_args_and_layout(shape: Shape, kv, aux, item: int):
    """SGLang's kv_args for host arrays `kv` (one per buffer, `item` bytes a page) and `aux`, and
    the local layout built from them."""
    args = SimpleNamespace(
        kv_data_ptrs=[a.ctypes.data for a in kv], kv_data_lens=[a.nbytes for a in kv],
        kv_item_lens=[item] * shape.buffers, aux_data_ptrs=[aux.ctypes.data],
        aux_data_lens=[aux.nbytes], aux_item_lens=[AUX_BYTES], page_size=shape.page_size,
        kv_cache_dtype_str="bfloat16")
    if not shape.is_mla:
        args.kv_head_num = args.total_kv_head_num = shape.kv_heads
    return args, local_layout(args, 1, 0, shape.is_mla)


class Pool:
    """One side's registered memory: `buffers` KV buffers of `pages` pages, one aux buffer."""

    def __init__(self, role: str, shape: Shape, pages: int, token_bytes: int, fill: bool):
        item = shape.page_size * token_bytes
        self.kv = [np.full(pages * item, 7 if fill else 0, dtype=np.uint8) for _ in range(shape.buffers)]
        self.aux = np.zeros(AUX_SLOTS * AUX_BYTES, dtype=np.uint8)
        self.engine = TransferEngine(io, role=role, host="127.0.0.1", qp_per_transfer=2, post_batch_size=-1,
                                     num_workers=1)
        self.args, self.layout = kv_args_and_layout(shape, self.kv, self.aux, item)
        self.buffers = LocalBuffers(
            kv=[self.engine.register(a.ctypes.data, a.nbytes, -1, False) for a in self.kv],
            aux=[self.engine.register(self.aux.ctypes.data, self.aux.nbytes, -1, False)], state=[])

    def close(self) -> None:
        self.engine.close()


WAITED_FOR = (S.WAITING_FOR_INPUT, S.SUCCESS, S.FAILED)


class ConcludedSGLang(FakeSGLang):
    """FakeSGLang that wakes the driver when a room turns Success or Failed."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.changed = threading.Condition()

    def set_status(self, room, status):
        super().set_status(room, status)
        if status in WAITED_FOR:  # the driver waits for these only: others cost no wake-up
            with self.changed:
                self.changed.notify_all()

    def wait_all(self, rooms, done, timeout_s: float) -> None:
        with self.changed:
            ok = self.changed.wait_for(lambda: all(self.status(r) in done for r in rooms), timeout_s)
        if not ok:
            raise TimeoutError(f"rooms not concluded in {timeout_s} s: "
                               f"{[(r, self.status(r)) for r in rooms if self.status(r) not in done][:5]}")


def rig_config(**kw) -> MoriConfig:
    """The rigs' config: `kw`, plus SGLANG_MORI_INLINE_POST and SGLANG_MORI_DECODE_ARRIVAL_FLAG from
    the environment where set and the checkout has the knob (base vs new runs of a benchmark pick
    the mode by environment)."""
    mode = os.environ.get("SGLANG_MORI_INLINE_POST")
    if mode and "inline_post" in MoriConfig.__dataclass_fields__:
        kw["inline_post"] = mode.lower()
    flag = os.environ.get("SGLANG_MORI_DECODE_ARRIVAL_FLAG")
    if flag and "decode_arrival_flag" in MoriConfig.__dataclass_fields__:
        # (a checkout whose knob is a bool takes on/off; one with off|thread|process takes its spelling)
        kw["decode_arrival_flag"] = (flag.strip().lower() in ("1", "true", "yes", "on", "thread")
                                     if MoriConfig.__dataclass_fields__["decode_arrival_flag"].default is False
                                     else MoriConfig.from_env({"SGLANG_MORI_DECODE_ARRIVAL_FLAG": flag}).decode_arrival_flag)
    return MoriConfig(**kw)


class PDPair:
    def __init__(self, shape: Shape, pages: int, token_bytes: int, config: MoriConfig):
        self.shape = shape
        self.ctx = zmq.Context()
        self.rejections: list = []
        reject = lambda err, origin: self.rejections.append(f"{origin}: {err}")  # noqa: E731
        # prefill
        self.prefill_pool = Pool("prefill", shape, pages, token_bytes, fill=True)
        self.prefill_sock = self.ctx.socket(zmq.PULL)
        self.prefill_port = self.prefill_sock.bind_to_random_port("tcp://127.0.0.1")
        self.prefill_sglang = ConcludedSGLang()
        pool = self.prefill_pool
        self.prefill = PrefillService(PrefillParts(
            config=config, engine=pool.engine, local=pool.buffers, planner=KVPlanner(pool.layout, pool.buffers),
            peers=PeerRegistry(config.peer_fail_fast_s, InflightBudget.from_config(config)),
            messenger=Messenger(self.ctx), metrics=NullTransferMetrics(), sglang=self.prefill_sglang,
            read_aux=lambda i: None if i is None else [pool.aux[i * AUX_BYTES:(i + 1) * AUX_BYTES].tobytes()],
            control_socket=self.prefill_sock), reject)
        # decode
        self.decode_pool = Pool("decode", shape, pages, token_bytes, fill=False)
        self.decode_sock = self.ctx.socket(zmq.PULL)
        port = self.decode_sock.bind_to_random_port("tcp://127.0.0.1")
        self.decode_sglang = ConcludedSGLang()
        dpool = self.decode_pool
        self.decode = DecodeService(DecodeParts(
            config=config, engine=dpool.engine, local=dpool.buffers, layout=dpool.layout,
            identity=DecodeIdentity("127.0.0.1", port, 1, 0),
            aux=AuxSlots(list(dpool.args.aux_data_ptrs), [AUX_BYTES], [dpool.aux.nbytes]),
            messenger=Messenger(self.ctx), metrics=NullTransferMetrics(), sglang=self.decode_sglang,
            control_socket=self.decode_sock), reject)
        # What SGLang's receiver sends its prefill over the bootstrap socket (SGLang's socket).
        self.to_prefill = self.ctx.socket(zmq.PUSH)
        self.to_prefill.connect(f"tcp://127.0.0.1:{self.prefill_port}")

    def start(self) -> None:
        self.prefill.start()
        self.decode.start()
        self.prefill.control.on_register(self.decode.registration())
        if self.rejections:
            raise RuntimeError(f"registration refused: {self.rejections}")

    def stop(self) -> None:
        self.prefill.stop()
        self.decode.stop()
        self.prefill.p.messenger.close()
        self.decode.p.messenger.close()
        self.to_prefill.close(0)
        for sock in (self.prefill_sock, self.decode_sock):
            sock.close(0)
        self.prefill_pool.close()
        self.decode_pool.close()
        self.ctx.term()

    def send_to_prefill(self, frames) -> None:
        self.to_prefill.send_multipart(frames)

    def encode(self, message) -> list:
        return protocol.encode(message)


class instant_writes:
    """`with instant_writes():` softio's batch_write moves no bytes and returns statuses already
    SUCCESS (the NIC finished before anyone looked): our Python per request without softio's
    copies, whose GIL time and wall time (which the polling threads' idle cost follows) are
    softio's, not MORI-IO's. Argument checks stay softio's (its batch_plan validation)."""

    def __enter__(self):
        from sglang_mori.softio.engine import IOEngine
        from sglang_mori.softio.status import StatusCode, TransferStatus

        self._original = IOEngine.batch_write

        def batch_write(engine, local_descs, local_offsets, remote_descs, remote_offsets, sizes, uids):
            if not (len(local_descs) == len(local_offsets) == len(remote_descs) == len(remote_offsets)
                    == len(sizes) == len(uids)):
                raise ValueError("batch_write columns differ in length")
            out = []
            for _ in uids:
                status = TransferStatus()
                status.Update(StatusCode.SUCCESS, "")
                out.append(status)
            return out

        IOEngine.batch_write = batch_write
        return self

    def __exit__(self, *exc):
        from sglang_mori.softio.engine import IOEngine

        IOEngine.batch_write = self._original
