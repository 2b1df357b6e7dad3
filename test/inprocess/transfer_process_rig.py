"""A prefill transfer process (SGLANG_MORI_TRANSFER_PROCESS) and one decode rank: the child is a
real spawned process on softio with the prefill pools in /dev/shm; decode runs in this process
with its own softio engine and a real PULL socket; decode's messages go to the child's control port.

    with TransferProcessRig() as rig:
        rig.claim(1); rig.metadata(1, pages=[3, 4]); rig.wait_status(1, WAITING_FOR_INPUT)
        rig.send(1, pages=[0, 1], last=True); rig.wait_status(1, SUCCESS)
"""

from __future__ import annotations

from multiprocessing import shared_memory
from types import SimpleNamespace

import numpy as np
import zmq

from sglang_mori import protocol
from sglang_mori.backend.decode.service import AuxSlots, DecodeIdentity, DecodeParts, DecodeService
from sglang_mori.backend.messenger import Messenger
from sglang_mori.backend.plans import encode_layout, local_layout
from sglang_mori.config import MoriConfig
from sglang_mori.metrics import NullTransferMetrics
from sglang_mori.transfer_process.aux_rows import AuxRows
from sglang_mori.transfer_process.child import ChildSpec
from sglang_mori.transfer_process.client import TransferProcess
from sglang_mori.transfer_process.pools import describe
from sglang_mori.transfer_process.scheduler_service import TransferProcessService

from fake_sglang import FakeSGLang
from rig import AUX_BYTES, BUFFERS, PAGE_BYTES, PAGES, Side
from waiting import wait_until

WAIT_S = 30.0


class SharedPools:
    """Prefill's KV buffers in /dev/shm (what the child can map), filled with known bytes."""

    def __init__(self, buffers: int = BUFFERS):
        rng = np.random.default_rng(11)
        self.shm = [shared_memory.SharedMemory(create=True, size=PAGES * PAGE_BYTES) for _ in range(buffers)]
        self.kv = [np.ndarray((PAGES * PAGE_BYTES,), np.uint8, s.buf) for s in self.shm]
        for a in self.kv:
            a[:] = rng.integers(1, 256, a.size, dtype=np.uint8)
        self.aux = np.arange(8 * AUX_BYTES, dtype=np.uint8)
        self.args = SimpleNamespace(
            kv_data_ptrs=[a.ctypes.data for a in self.kv], kv_data_lens=[a.nbytes for a in self.kv],
            kv_item_lens=[PAGE_BYTES] * buffers, aux_data_ptrs=[self.aux.ctypes.data],
            aux_data_lens=[self.aux.nbytes], aux_item_lens=[AUX_BYTES], page_size=1,
            kv_cache_dtype_str="bfloat16",
        )

    def page(self, buffer: int, page: int) -> bytes:
        return self.kv[buffer][page * PAGE_BYTES:(page + 1) * PAGE_BYTES].tobytes()

    def close(self) -> None:
        self.kv = []
        for s in self.shm:
            s.close()
            s.unlink()


def child_spec(pools: SharedPools, config: MoriConfig = None, is_mla: bool = False) -> ChildSpec:
    """The child's start-up description for prefill pools in /dev/shm, on softio at 127.0.0.1."""
    config = config or MoriConfig(engine="soft", transfer_shards=1, transfer_timeout_ms=5000)
    layout = local_layout(pools.args, 1, 0, is_mla)
    return ChildSpec(config=config, layout=encode_layout(layout),
                     kv=describe(pools.args.kv_data_ptrs, pools.args.kv_data_lens, False, -1),
                     on_gpu=False, device=-1, host="127.0.0.1", control_host="127.0.0.1",
                     table_name="", table_slots=0, parent_pid=0)


class TransferProcessRig:
    """`buffers`, `is_mla`: the pools' shape on both sides (MLA: one latent buffer per layer)."""

    def __init__(self, config: MoriConfig = None, buffers: int = BUFFERS, is_mla: bool = False):
        self.config = config or MoriConfig(engine="soft", transfer_shards=1, transfer_timeout_ms=5000)
        self.pools = SharedPools(buffers)
        self.process = TransferProcess(child_spec(self.pools, self.config, is_mla), slots=16)
        self.sglang = FakeSGLang()
        args = self.pools.args  # the manager's reader for the hand-off (row views of the aux buffers)
        self.service = TransferProcessService(
            self.process, self.sglang, read_aux=AuxRows(args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens))
        self.ctx = zmq.Context()
        self.decode = Side("decode", fill=False, buffers=buffers)
        self.decode.layout = local_layout(self.decode.args, 1, 0, is_mla)
        self.decode_socket = self.ctx.socket(zmq.PULL)
        port = self.decode_socket.bind_to_random_port("tcp://127.0.0.1")
        self.decode_sglang = FakeSGLang()
        self.decode_service = DecodeService(DecodeParts(
            config=self.config, engine=self.decode.engine, local=self.decode.buffers, layout=self.decode.layout,
            identity=DecodeIdentity("127.0.0.1", port, 1, 0),
            aux=AuxSlots(list(self.decode.args.aux_data_ptrs), [AUX_BYTES], [self.decode.aux.nbytes]),
            messenger=Messenger(self.ctx), metrics=NullTransferMetrics(), sglang=self.decode_sglang,
            control_socket=self.decode_socket,
        ), lambda err, origin: None)
        self.to_prefill = Messenger(self.ctx)

    def __enter__(self):
        self.decode_service.start()
        self.to_prefill.send(("127.0.0.1", self.process.port), self.decode_service.registration())
        return self

    def __exit__(self, *exc):
        self.service.stop()
        self.decode_service.stop()
        self.to_prefill.close()
        self.decode_socket.close(linger=0)
        self.decode.engine.deregister_all()
        self.ctx.destroy(linger=0)
        self.pools.close()

    # --- decode's side ----------------------------------------------------------------------
    def metadata(self, room: int, pages, aux_index: int = 0) -> None:
        self.decode_sglang.open(room)
        self.decode_service.new_receiver(room)
        message = self.decode_service.record_destination(
            bootstrap_room=room, required_dst_info_num=1, kv_indices=np.asarray(pages), aux_index=aux_index,
            state_indices=None, decode_prefix_len=None, is_dummy=False)
        self.to_prefill.send(("127.0.0.1", self.process.port), message)

    # --- the scheduler's side, as SGLang's sender drives it ------------------------------------
    def claim(self, room: int):
        self.sglang.open(room)
        return self.service.claim(room)

    def send(self, room: int, pages, last: bool, start: int = 0, aux_index=0, **sglang_kw) -> None:
        """`sglang_kw`: the other keywords SGLang's send() passes (state_indices, wait_event, ...)."""
        pages = np.asarray(pages)
        self.service.add_chunk(room, pages, slice(start, start + len(pages)), last,
                               aux_index=aux_index if last else None, **sglang_kw)

    def poll(self, room: int):
        """SGLang's sender.poll(): the manager's check_status syncs the room first."""
        self.service.sync(room)
        return self.sglang.status(room)

    def wait_status(self, room: int, status: int, timeout_s: float = WAIT_S):
        return wait_until(lambda: self.poll(room) == status, f"room {room} status {status} "
                          f"(now {self.sglang.status(room)}, child {self.process.status(room)})", timeout_s)
