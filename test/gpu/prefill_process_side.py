"""The prefill side of the GPU rig through a transfer process (SGLANG_MORI_TRANSFER_PROCESS=on):
the pool stays in this process (the forward writes it); a spawned child imports it with CUDA IPC,
owns a softio engine and runs the prefill service. This process keeps what SGLang's scheduler keeps:
the claim at sender init, one hand-off per send(), polls that read the status table, the release.

Same interface as prefill_side.PrefillSide for chunk-wise loads (cost and interference parts);
layer-wise streaming stays in-process and is refused here. Written for the NVIDIA rig; the rig's
CPU mode (rig_device) puts this side's pools in /dev/shm files so that the child maps them there.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from typing import Dict, Optional

import numpy as np
import zmq

from sglang_mori.backend import room_status as S
from sglang_mori.backend.plans import encode_layout
from sglang_mori.config import MoriConfig
from sglang_mori.transfer_process.child import ChildSpec
from sglang_mori.transfer_process.client import TransferProcess
from sglang_mori.transfer_process.pools import describe
from sglang_mori.transfer_process.scheduler_service import TransferProcessService

from device_pool import AUX_BYTES, DevicePool
from prefill_side import CountingMetrics, PrefillSide, TimedSGLang, install_sender_stand_in
from rig_device import ON_GPU

POLL_S = 0.0005


class PolledSGLang(TimedSGLang):
    """TimedSGLang whose statuses arrive only through polls (the side's `poll`), as SGLang's do."""

    poll = None  # set by the side
    # Between polls; a part sets its own (link_bench: LINK_POLL_S, recorded with its figures). The
    # stamp of a room's Success is its poll's, so this interval is part of every latency measured.
    poll_s = POLL_S

    def wait_concluded(self, rooms, timeout_s: float) -> Dict[int, float]:
        end = time.monotonic() + timeout_s
        while True:
            self.poll()
            if all(r in self.concluded_at for r in rooms):
                return {r: self.concluded_at[r] for r in rooms}
            if time.monotonic() > end:
                missing = [r for r in rooms if r not in self.concluded_at]
                raise TimeoutError(f"rooms {missing[:5]} did not conclude in {timeout_s} s")
            time.sleep(self.poll_s)


class ProcessPrefillSide:
    def __init__(self, shape, page_size: int, pages: int, config: MoriConfig, group_size: int = 0,
                 device: int = 0, tp_rank: int = 0):
        self.shape, self.page_size, self.device, self.tp_rank = shape, page_size, device, tp_rank
        self.pool = DevicePool("prefill", shape, page_size, pages, device=device, tp_rank=tp_rank, shared=True)
        self.sglang = PolledSGLang(prefill_rank=tp_rank)
        self.sglang.poll = self.poll
        self.metrics = CountingMetrics()
        args = self.pool.args
        spec = ChildSpec(config=replace(config, engine="soft"), layout=encode_layout(self.pool.layout),
                         kv=describe(args.kv_data_ptrs, args.kv_data_lens, ON_GPU, device if ON_GPU else -1),
                         on_gpu=ON_GPU, device=device if ON_GPU else -1, host="127.0.0.1", control_host="127.0.0.1",
                         table_name="", table_slots=0, parent_pid=0, prefill_rank=tp_rank, aux_buffers=1)
        self.process = TransferProcess(spec, slots=4096)
        aux = self.pool.aux
        self.service = TransferProcessService(
            self.process, self.sglang,
            read_aux=lambda i: None if i is None else [aux[i * AUX_BYTES:(i + 1) * AUX_BYTES].tobytes()])
        self.ctx = zmq.Context()
        self.to_child = self.ctx.socket(zmq.PUSH)  # what decode's receivers send (SGLang's socket)
        self.to_child.connect(f"tcp://127.0.0.1:{self.process.port}")
        self.sender_class = install_sender_stand_in()
        self.req_to_token: Dict[int, np.ndarray] = {}
        self.layerwise_on = False
        self.live: set = set()
        self.waiting: Dict[int, np.ndarray] = {}  # sent before decode's metadata reached the child

    def start(self, registration_frames) -> None:
        self.to_child.send_multipart(registration_frames)

    def stop(self) -> None:
        self.service.stop()
        self.to_child.close(0)
        self.ctx.term()
        self.pool.close()

    def child_cpu_s(self) -> float:
        with open(f"/proc/{self.process.process.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    # --- rooms ------------------------------------------------------------------------------------
    def open(self, room: int, metadata_frames, row: np.ndarray) -> None:
        self.to_child.send_multipart(metadata_frames)
        self.sglang.open(room)
        assert self.service.claim(room) is None
        self.req_to_token[room] = row
        self.live.add(room)

    def send_all(self, room: int, src_pages: np.ndarray) -> None:
        """SGLang's last send(); SGLang sends only once the room is WaitingForInput, so a room
        whose destinations have not reached the child yet is sent by a later poll."""
        if self.layerwise_on:
            raise RuntimeError("the transfer process prototype is chunk-wise only")
        self.service.sync(room)
        if self.sglang.status(room) == S.BOOTSTRAPPING:
            self.waiting[room] = src_pages
            return
        self.service.add_chunk(room, src_pages, slice(0, len(src_pages)), True, aux_index=room % 64)

    def poll(self) -> None:
        """SGLang's poll of every live sender, once per scheduler loop."""
        for room in list(self.live):
            self.service.sync(room)
        for room in [r for r in self.waiting if self.sglang.status(r) != S.BOOTSTRAPPING]:
            self.send_all(room, self.waiting.pop(room))

    def release(self, room: int) -> None:
        self.service.release(room)
        self.sglang.clear(room)
        self.live.discard(room)
        self.waiting.pop(room, None)
        self.req_to_token.pop(room, None)
        with self.sglang.concluded:
            self.sglang.concluded_at.pop(room, None)

    def failure(self, room: int) -> Optional[str]:
        return self.sglang.failure_reason(room) if self.sglang.status(room) == S.FAILED else None

    def metrics_snapshot(self) -> dict:
        return {"fallbacks": {}, "layerwise_writes": 0}

    # What hooks.py reads: the same stand-ins as the in-process side (send_all refuses layer-wise).
    scheduler = PrefillSide.scheduler
    batch = PrefillSide.batch
