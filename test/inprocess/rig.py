"""One prefill service and one decode rank in this process, on two softio engines, built from their
parts (no manager, no SGLang): the prefill service's threads run for real; decode's messages are
handed to prefill's control handler directly, and prefill's messages are captured.

    with PrefillRig() as rig:
        rig.register()
        rig.metadata(room=1, pages=[3, 4])
        rig.claim(1); rig.send(1, pages=[0, 1], last=True)
        rig.wait_status(1, SUCCESS)
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Optional

import numpy as np

import sglang_mori.softio as io
from sglang_mori import protocol
from sglang_mori.backend.decode.service import AuxSlots, DecodeIdentity, DecodeParts, DecodeService
from sglang_mori.backend.peers import InflightBudget, PeerRegistry
from sglang_mori.backend.plans import KVPlanner, LocalBuffers, local_layout
from sglang_mori.backend.prefill.parts import PrefillParts
from sglang_mori.backend.prefill.service import PrefillService
from sglang_mori.config import MoriConfig
from sglang_mori.engine import TransferEngine
from sglang_mori.metrics import NullTransferMetrics

from fake_sglang import FakeSGLang
from waiting import wait_until

PAGE_BYTES = 256
PAGES = 64
BUFFERS = 2
AUX_BYTES = 16
AUX_SLOTS = 8
WAIT_S = 20.0


class CapturingMessenger:
    def __init__(self):
        self.sent: list = []
        self.nonblocking: list = []  # messages sent with block=False (from SGLang's scheduler thread)
        self.threads: list = []  # (message, name of the thread that sent it)
        self._lock = threading.Lock()

    def send(self, endpoint, message, *, block: bool = True) -> bool:
        with self._lock:
            self.sent.append((tuple(endpoint), message))
            self.threads.append((message, threading.current_thread().name))
            if not block:
                self.nonblocking.append(message)
        return True

    def send_all(self, endpoints, message) -> None:
        for endpoint in endpoints:
            self.send(endpoint, message)

    def of_type(self, cls, room: Optional[int] = None) -> list:
        with self._lock:
            return [m for _, m in self.sent if isinstance(m, cls) and (room is None or m.room == room)]


class Side:
    """One rank's registered memory: KV buffers of PAGES pages (BUFFERS of them unless told: MHA
    lists K of every layer, then V of every layer), one aux buffer."""

    def __init__(self, role: str, fill: bool, buffers: int = BUFFERS):
        rng = np.random.default_rng(7 if fill else 0)
        self.kv = [rng.integers(1, 256, PAGES * PAGE_BYTES, dtype=np.uint8) if fill
                   else np.zeros(PAGES * PAGE_BYTES, dtype=np.uint8) for _ in range(buffers)]
        self.aux = np.arange(AUX_SLOTS * AUX_BYTES, dtype=np.uint8) if fill else np.zeros(AUX_SLOTS * AUX_BYTES, np.uint8)
        self.engine = TransferEngine(io, role=role, host="127.0.0.1", qp_per_transfer=2, post_batch_size=-1,
                                     num_workers=1)
        self.args = SimpleNamespace(
            kv_data_ptrs=[a.ctypes.data for a in self.kv], kv_data_lens=[a.nbytes for a in self.kv],
            kv_item_lens=[PAGE_BYTES] * buffers, aux_data_ptrs=[self.aux.ctypes.data],
            aux_data_lens=[self.aux.nbytes], aux_item_lens=[AUX_BYTES], page_size=1,
            kv_cache_dtype_str="bfloat16",
        )
        self.layout = local_layout(self.args, 1, 0, False)
        self.buffers = LocalBuffers(
            kv=[self.engine.register(a.ctypes.data, a.nbytes, -1, False) for a in self.kv],
            aux=[self.engine.register(self.aux.ctypes.data, self.aux.nbytes, -1, False)],
            state=[],
        )

    def page(self, buffer: int, page: int) -> bytes:
        return self.kv[buffer][page * PAGE_BYTES:(page + 1) * PAGE_BYTES].tobytes()

    def pool(self) -> SimpleNamespace:
        """The KV pool a forward would use (MHA: k_buffer / v_buffer per layer) over these buffers."""
        layers = len(self.kv) // 2
        return SimpleNamespace(k_buffer=self.kv[:layers], v_buffer=self.kv[layers:], start_layer=0)


class PrefillRig:
    def __init__(self, config: Optional[MoriConfig] = None, clock=time.monotonic, buffers: int = BUFFERS,
                 planner_class=KVPlanner, sglang: Optional[FakeSGLang] = None, control_socket=None,
                 decode_socket=None, start_threads: bool = True):
        """`control_socket` / `decode_socket`: PULL sockets the services read (inbox.py; None: messages
        are handed to the handlers directly); `start_threads=False`: the services' threads do not
        run, so only SGLang's poll (`poll_inbox`) reads the sockets."""
        self.start_threads = start_threads
        self.config = config or MoriConfig(transfer_shards=2, transfer_timeout_ms=5000)
        self.prefill = Side("prefill", fill=True, buffers=buffers)
        self.decode = Side("decode", fill=False, buffers=buffers)
        self.layerwise_session = None
        self.sglang = sglang or FakeSGLang()
        self.messenger = CapturingMessenger()
        self.rejections: list = []
        cfg = self.config
        self.parts = PrefillParts(
            config=cfg, engine=self.prefill.engine, local=self.prefill.buffers,
            planner=planner_class(self.prefill.layout, self.prefill.buffers),
            peers=PeerRegistry(cfg.peer_fail_fast_s, InflightBudget.from_config(cfg)),
            messenger=self.messenger, metrics=NullTransferMetrics(), sglang=self.sglang,
            read_aux=lambda i: None if i is None else [self.prefill.aux[i * AUX_BYTES:(i + 1) * AUX_BYTES].tobytes()],
            clock=clock, control_socket=control_socket,
        )
        self.service = PrefillService(self.parts, lambda err, origin: self.rejections.append(err))
        self.decode_sglang = FakeSGLang()
        self.decode_service = self._decode_service(self.decode, self.decode_sglang, 17001, decode_socket)
        self.others: list = []  # further decode ranks (`add_decode`)

    def _decode_service(self, side: Side, sglang: FakeSGLang, port: int, socket=None) -> DecodeService:
        return DecodeService(DecodeParts(
            config=self.config, engine=side.engine, local=side.buffers, layout=side.layout,
            identity=DecodeIdentity("127.0.0.1", port, 1, 0),
            aux=AuxSlots(list(side.args.aux_data_ptrs), [AUX_BYTES], [side.aux.nbytes]),
            messenger=CapturingMessenger(), metrics=NullTransferMetrics(), sglang=sglang,
            control_socket=socket,
        ), lambda err, origin: self.rejections.append(err))

    def add_decode(self) -> "OtherDecode":
        """A second (third, ...) decode rank served by the same prefill, registered with it."""
        side = Side("decode", fill=False, buffers=len(self.decode.kv))
        other = OtherDecode(self, side, self._decode_service(side, FakeSGLang(), 17002 + len(self.others)))
        self.others.append(other)
        if self.start_threads:
            other.service.start()
        self.service.control.on_register(other.service.registration())
        return other

    def __enter__(self):
        if self.start_threads:
            self.service.start()
            self.decode_service.start()
        return self

    def __exit__(self, *exc):
        if self.layerwise_session is not None:
            self.layerwise_session.stop()
        self.service.stop()
        self.decode_service.stop()
        for other in self.others:
            other.service.stop()
        for side in (self.prefill, self.decode, *(other.side for other in self.others)):
            side.engine.deregister_all()

    def layerwise(self, group_size: int = 1, min_tokens: int = 0, min_batch_tokens: int = 0):
        """Start a layer-wise session on this service (build the rig with
        planner_class=LayerwisePlanner); tests drive its hooks' calls directly."""
        from sglang_mori.backend.prefill.layerwise.mapping import LayerBufferMap
        from sglang_mori.backend.prefill.layerwise.session import LayerwiseSession

        buffer_map = LayerBufferMap(self.prefill.args.kv_data_ptrs, 0, is_mla=False)
        self.layerwise_session = LayerwiseSession(self.parts, self.service, buffer_map, group_size=group_size,
                                                  min_tokens=min_tokens, min_batch_tokens=min_batch_tokens)
        self.layerwise_session.start()
        return self.layerwise_session

    # --- decode's messages ------------------------------------------------------------------
    def register(self) -> None:
        self.service.control.on_register(self.decode_service.registration())

    def new_attempt(self, room: int) -> int:
        """A decode receiver starts on `room` (a new attempt)."""
        self.decode_sglang.open(room)
        return self.decode_service.new_receiver(room)

    def metadata(self, room: int, pages, aux_index: int = 0, is_dummy: bool = False):
        message = self.decode_service.record_destination(
            bootstrap_room=room, required_dst_info_num=1, kv_indices=np.asarray(pages), aux_index=aux_index,
            state_indices=None, decode_prefix_len=None, is_dummy=is_dummy)
        self.service.control.on_metadata(message)
        return message

    def abort(self, room: int, generation: Optional[int] = 1) -> None:
        self.service.control.on_abort(self.decode_service.abort_message(room, generation))

    # --- the scheduler's side ---------------------------------------------------------------
    def claim(self, room: int) -> Optional[str]:
        self.sglang.open(room)
        return self.service.claim(room)

    def send(self, room: int, pages, last: bool, start: int = 0, aux_index: Optional[int] = 0) -> None:
        pages = np.asarray(pages)
        self.service.add_chunk(room, pages, slice(start, start + len(pages)), last,
                               aux_index=aux_index if last else None)

    def clear(self, room: int) -> None:
        self.sglang.clear(room)
        self.service.release(room)

    # --- waiting ----------------------------------------------------------------------------
    def wait(self, predicate, what: str, timeout_s: float = WAIT_S):
        return wait_until(predicate, what, timeout_s)

    def wait_status(self, room: int, status: int):
        return self.wait(lambda: self.sglang.status(room) == status, f"room {room} status {status}")

    def success_message(self, room: int):
        """The one RoomStatus message decode was sent for `room`. SGLang's status turns Success just
        before that message leaves (effects.py), so wait for it, bounded, after wait_status."""
        self.wait(lambda: self.messenger.of_type(protocol.RoomStatus, room), f"room {room}'s status message to decode")
        (done,) = self.messenger.of_type(protocol.RoomStatus, room)
        return done

    def wait_idle(self):
        """Every room drained and forgotten, no write in flight, nothing queued."""
        return self.wait(lambda: not any(v for k, v in self.service.debug_snapshot().items()
                                         if k != "prefill.unclaimed_rooms"),
                         f"an idle prefill service ({self.service.debug_snapshot()})")


class OtherDecode:
    """A further decode rank of a PrefillRig (`rig.add_decode()`): its own engine, memory and
    receivers; its messages go to the rig's prefill service like the first decode's."""

    def __init__(self, rig: PrefillRig, side: Side, service: DecodeService):
        self.rig, self.side, self.service = rig, side, service
        self.engine = side.engine

    def new_attempt(self, room: int) -> int:
        self.service.p.sglang.open(room)
        return self.service.new_receiver(room)

    def metadata(self, room: int, pages, aux_index: int = 0):
        message = self.service.record_destination(
            bootstrap_room=room, required_dst_info_num=1, kv_indices=np.asarray(pages), aux_index=aux_index,
            state_indices=None, decode_prefix_len=None, is_dummy=False)
        self.rig.service.control.on_metadata(message)
        return message

    def page(self, buffer: int, page: int) -> bytes:
        return self.side.page(buffer, page)
