"""The GPU PD rig: the decode side in a spawned process (decode_process.py), the prefill side and
the stand-in forward in this one, one GPU, KV in device memory moved by softio's device path.

`GpuPD.prefill_batch(...)` is one prefill step as SGLang runs it: the batch's rooms are opened
(decode's metadata, the sender's claim), the forward runs (through the layer-wise hooks when
layer-wise is on), SGLang's `send()` hands every page with the aux slot, and the result says how
long the forward took and when each room's last byte landed (its Success).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List

import numpy as np
import torch

from sglang_mori.config import MoriConfig

import rig_device
from forward import StandInModel
from prefill_side import PrefillSide
from rig_device import DEVICE, synchronize
from shapes import SHAPES, pages_for

HERE = Path(__file__).resolve().parent
PATHS = [str(HERE), str(HERE.parent / "inprocess"), str(HERE.parents[1] / "python")]
WAIT_S = 60.0


@dataclass
class StepResult:
    forward_ms: float
    tail_ms: float  # forward end -> last room's Success (last byte landed)
    total_ms: float  # forward start -> last room's Success
    failures: list


class Requests:
    """Token slots for `count` requests of `tokens` tokens each: distinct pages on both sides,
    scattered (page size > 1: every page shuffled; page size 1: shuffled runs of 64 slots, as a
    paged allocator hands out a fresh request's slots)."""

    def __init__(self, page_size: int, tokens: int, count: int, first_page: int, rng):
        self.page_size, self.tokens, self.count = page_size, tokens, count
        per = pages_for(tokens, page_size)
        total = per * count
        run = 64 if page_size == 1 else 1
        blocks = np.arange(0, total, run)
        src = (rng.permutation(blocks)[:, None] + np.arange(run)).reshape(-1)[:total] + first_page
        dst = (rng.permutation(blocks)[:, None] + np.arange(run)).reshape(-1)[:total] + first_page
        self.src = src.reshape(count, per)
        self.dst = dst.reshape(count, per)
        self.pages = total

    def row(self, i: int) -> np.ndarray:
        t = np.arange(self.tokens)
        return self.src[i][t // self.page_size] * self.page_size + t % self.page_size


class GpuPD:
    def __init__(self, shape_key: str, page_size: int, pages: int, *, group_size: int = 0,
                 config: MoriConfig | None = None):
        self.shape = SHAPES[shape_key]
        self.page_size = page_size
        self.config = config or MoriConfig(engine="soft", transfer_timeout_ms=30000)
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        config_kwargs = {k: getattr(self.config, k) for k in ("transfer_timeout_ms", "peer_fail_fast_s")}
        import decode_process

        self.proc = ctx.Process(target=decode_process.serve, daemon=True,
                                args=(child, shape_key, page_size, pages, config_kwargs, PATHS))
        self.proc.start()
        self.prefill = None
        try:
            registration = self._recv(timeout=120)
            self.prefill = PrefillSide(self.shape, page_size, pages, self.config, group_size)
            self.prefill.start(registration)
        except BaseException:
            self.close()
            raise
        self.model = StandInModel(self.shape)
        self._room = 1000

    def _recv(self, timeout: float = WAIT_S):
        if not self.conn.poll(timeout):
            raise TimeoutError(f"decode process did not answer in {timeout} s (alive: {self.proc.is_alive()})")
        out = self.conn.recv()
        if isinstance(out, Exception):
            raise out
        return out

    def ask(self, cmd: str, arg=None, timeout: float = WAIT_S):
        self.conn.send((cmd, arg))
        return self._recv(timeout)

    def close(self) -> None:
        if self.prefill is not None:
            self.prefill.stop()
        if self.proc.is_alive():
            try:
                self.conn.send(("stop", None))
            except OSError:
                pass
            self.proc.join(timeout=20)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(timeout=5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # --- one prefill step -------------------------------------------------------------------------
    def next_rooms(self, n: int) -> List[int]:
        rooms = list(range(self._room, self._room + n))
        self._room += n
        return rooms

    def open_rooms(self, reqs: Requests, rooms: List[int]) -> None:
        frames = self.ask("open", [(room, reqs.dst[i]) for i, room in enumerate(rooms)])
        for i, room in enumerate(rooms):
            self.prefill.open(room, frames[i], reqs.row(i))

    def prefill_batch(self, reqs: Requests, *, layerwise: bool, side_stream: bool = False,
                      store_delay_cycles: int = 0, seed: int = 0, wait_s: float = WAIT_S) -> StepResult:
        p = self.prefill
        rooms = self.next_rooms(reqs.count)
        self.open_rooms(reqs, rooms)
        slots = torch.as_tensor(np.concatenate([reqs.row(i) for i in range(reqs.count)]), device=DEVICE)
        x = self.model.inputs(reqs.tokens * reqs.count, seed)
        p.layerwise_on = layerwise
        synchronize()
        stream = rig_device.stream(side_stream)
        t0 = time.perf_counter()
        with rig_device.on_stream(stream):
            self.model.forward(x, p.pool, slots, hooked=layerwise, scheduler=p.scheduler(),
                               batch=p.batch(rooms, reqs.tokens), store_delay_cycles=store_delay_cycles)
        # What SGLang does before it sends: the batch's results are ready (the KV is in the pool).
        stream.synchronize()
        t1 = time.perf_counter()
        for i, room in enumerate(rooms):
            p.send_all(room, reqs.src[i])
        done = p.sglang.wait_concluded(rooms, wait_s)
        failures = [(room, p.failure(room)) for room in rooms if p.failure(room)]
        t2 = max(done.values())
        self.last_rooms = rooms
        return StepResult((t1 - t0) * 1e3, (t2 - t1) * 1e3, (t2 - t0) * 1e3, failures)

    def release(self, rooms: List[int]) -> None:
        for room in rooms:
            self.prefill.release(room)
        self.ask("clear", rooms)

    # --- checks ---------------------------------------------------------------------------------------
    def mismatched_pages(self, reqs: Requests) -> int:
        """Request pages whose decode bytes (every buffer) differ from the prefill's."""
        synchronize()
        src = [self.prefill.pool.digest([int(p)]) for p in reqs.src.reshape(-1)]
        dst = self.ask("digests", [int(p) for p in reqs.dst.reshape(-1)], timeout=300)
        return sum(a != b for a, b in zip(src, dst))


def child_env() -> None:
    """Spawned children import the rig's modules by path; set before GpuPD starts one."""
    for p in PATHS:
        if p not in sys.path:
            sys.path.insert(0, p)
    os.environ.setdefault("SGLANG_MORI_ENGINE", "soft")
