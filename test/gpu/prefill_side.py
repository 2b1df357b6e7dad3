"""The prefill side of the GPU rig, in the driving process: a KV pool on the GPU, this project's
PrefillService (chunk submitter shards, completion thread) and LayerwiseSession (worker), its
messages to decode over real ZMQ (Messenger), and the layer-wise hooks of hooks.py driven by a
stand-in forward (forward.py) through stand-ins for SGLang's Scheduler, batch and Req.

Rooms are opened as SGLang opens them: decode's receiver sends RoomMetadata (from the decode
process), the prefill's sender claims the room; after the forward the scheduler's `send()` hands
the request's pages (the layer-wise session sends only what it did not stream) with the aux index;
the room's Success is stamped with the time (TimedSGLang) so "last byte landed" can be measured.
"""

from __future__ import annotations

import sys
import threading
import time
import types
from types import SimpleNamespace
from typing import Dict, List, Optional

import numpy as np
import zmq

from sglang_mori import protocol
from sglang_mori.backend import room_status as S
from sglang_mori.backend.messenger import Messenger
from sglang_mori.backend.peers import InflightBudget, PeerRegistry
from sglang_mori.backend.prefill.layerwise.mapping import LayerBufferMap
from sglang_mori.backend.prefill.layerwise.planner import LayerwisePlanner
from sglang_mori.backend.prefill.layerwise.session import LayerwiseSession
from sglang_mori.backend.prefill.parts import PrefillParts
from sglang_mori.backend.prefill.service import PrefillService
from sglang_mori.config import MoriConfig
from sglang_mori.metrics import NullTransferMetrics

from device_pool import AUX_BYTES, DevicePool
from fake_sglang import FakeSGLang


def install_sender_stand_in():
    """hooks.py recognises our requests by `isinstance(req.disagg_kv_sender, MoriKVSender)`; the real
    module imports SGLang, which the GPU host does not have."""
    name = "sglang_mori.backend.sender"
    if name not in sys.modules:
        try:
            __import__(name)
        except ImportError:
            stub = types.ModuleType(name)
            stub.MoriKVSender = type("MoriKVSender", (), {})
            sys.modules[name] = stub
    return sys.modules[name].MoriKVSender


class TimedSGLang(FakeSGLang):
    """FakeSGLang that stamps when each room turned Success or Failed (time.perf_counter)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.concluded_at: Dict[int, float] = {}
        self.concluded = threading.Condition()

    def set_status(self, room, status):
        super().set_status(room, status)
        if status in (S.SUCCESS, S.FAILED):
            with self.concluded:
                self.concluded_at.setdefault(room, time.perf_counter())
                self.concluded.notify_all()

    def wait_concluded(self, rooms, timeout_s: float) -> Dict[int, float]:
        deadline = time.monotonic() + timeout_s
        with self.concluded:
            while not all(r in self.concluded_at for r in rooms):
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [r for r in rooms if r not in self.concluded_at]
                    raise TimeoutError(f"rooms {missing[:5]} did not conclude in {timeout_s} s")
                self.concluded.wait(left)
            return {r: self.concluded_at[r] for r in rooms}


class CountingMetrics(NullTransferMetrics):
    def __init__(self):
        self.fallbacks: Dict[str, int] = {}
        self.layerwise = 0

    def layerwise_writes(self, n: int = 1) -> None:
        self.layerwise += n

    def layerwise_fallback(self, reason: str, n: int = 1) -> None:
        self.fallbacks[reason] = self.fallbacks.get(reason, 0) + n


class PrefillSide:
    """One prefill TP rank: `shape` is its share (Shape.sliced), its pool on GPU `device`."""

    def __init__(self, shape, page_size: int, pages: int, config: MoriConfig, group_size: int = 0,
                 device: int = 0, tp_rank: int = 0):
        self.shape, self.page_size, self.device, self.tp_rank = shape, page_size, device, tp_rank
        self.pool = DevicePool("prefill", shape, page_size, pages, device=device, tp_rank=tp_rank)
        self.sglang = TimedSGLang(prefill_rank=tp_rank)
        self.metrics = CountingMetrics()
        self.ctx = zmq.Context()
        self.rejections: list = []
        aux = self.pool.aux
        self.parts = PrefillParts(
            config=config, engine=self.pool.engine, local=self.pool.buffers,
            planner=LayerwisePlanner(self.pool.layout, self.pool.buffers),
            peers=PeerRegistry(config.peer_fail_fast_s, InflightBudget.from_config(config)),
            messenger=Messenger(self.ctx), metrics=self.metrics, sglang=self.sglang,
            read_aux=lambda i: None if i is None else [aux[i * AUX_BYTES:(i + 1) * AUX_BYTES].tobytes()],
        )
        self.service = PrefillService(self.parts, lambda err, origin: self.rejections.append(str(err)))
        self.session = LayerwiseSession(self.parts, self.service,
                                        LayerBufferMap(self.pool.args.kv_data_ptrs, 0, shape.is_mla),
                                        group_size=group_size, min_tokens=0)
        self.sender_class = install_sender_stand_in()
        self.req_to_token: Dict[int, np.ndarray] = {}
        self.layerwise_on = False

    def start(self, registration_frames) -> None:
        self.service.start()
        self.session.start()
        self.service.control.on_register(protocol.decode(registration_frames))
        assert not self.rejections, self.rejections

    def stop(self) -> None:
        self.session.stop()
        self.service.stop()
        self.parts.messenger.close()
        self.pool.close()
        self.ctx.term()

    # --- rooms ------------------------------------------------------------------------------------
    def open(self, room: int, metadata_frames, row: np.ndarray) -> None:
        self.service.control.on_metadata(protocol.decode(metadata_frames))
        self.sglang.open(room)
        assert self.service.claim(room) is None
        self.req_to_token[room] = row

    def send_all(self, room: int, src_pages: np.ndarray) -> None:
        """SGLang's last send() of a request: every page, with its aux slot."""
        target = self.session if self.layerwise_on else self.service
        target.add_chunk(room, src_pages, slice(0, len(src_pages)), True, aux_index=room % 64)

    def release(self, room: int) -> None:
        """What the scheduler does with a finished sender: the room's life ends."""
        self.service.release(room)
        self.sglang.clear(room)
        self.req_to_token.pop(room, None)
        with self.sglang.concluded:
            self.sglang.concluded_at.pop(room, None)

    def failure(self, room: int) -> Optional[str]:
        return self.sglang.failure_reason(room) if self.sglang.status(room) == S.FAILED else None

    # --- what hooks.py reads ------------------------------------------------------------------------
    def scheduler(self) -> SimpleNamespace:
        return SimpleNamespace(
            disagg_prefill_bootstrap_queue=SimpleNamespace(kv_manager=SimpleNamespace(
                layerwise=self.session if self.layerwise_on else None)),
            token_to_kv_pool_allocator=SimpleNamespace(page_size=self.page_size, get_kvcache=self.pool.pool),
            req_to_token_pool=SimpleNamespace(req_to_token=self.req_to_token))

    def batch(self, rooms: List[int], tokens: int) -> SimpleNamespace:
        """An extend batch of whole new prompts of `tokens` tokens each."""
        extend = SimpleNamespace(is_extend=lambda: True)
        reqs = [SimpleNamespace(
            disagg_kv_sender=object.__new__(self.sender_class), kv=SimpleNamespace(req_pool_idx=room),
            bootstrap_room=room, origin_input_ids=range(tokens), disagg_decode_prefix_len=0, start_send_idx=0,
            pending_bootstrap=False) for room in rooms]
        return SimpleNamespace(forward_mode=extend, spec_algorithm=None, tbo_split_seq_index=None, reqs=reqs,
                               prefix_lens=[0] * len(rooms), extend_lens=[tokens] * len(rooms))

    def metrics_snapshot(self) -> dict:
        return {"fallbacks": dict(self.metrics.fallbacks), "layerwise_writes": self.metrics.layerwise}
