"""The GPU PD rig: the decode side in a spawned process (decode_process.py), the prefill side and
the stand-in forward in this one, KV in device memory moved by softio's device path.

Devices: by default prefill and decode share GPU 0. `decode_device=1` puts decode on a second GPU
(the copies cross the GPUs' link); `prefill_devices=(0, 1)` runs prefill at attention TP 2, one rank
per GPU, into decode TP 1 (MHA: each rank writes its half of every token's heads; MLA: rank 1 gets
dummy metadata, as SGLang's receiver sends it).

`GpuPD.prefill_batch(...)` is one prefill step as SGLang runs it: the batch's rooms are opened
(decode's metadata, the sender's claim), the forward runs (through the layer-wise hooks when
layer-wise is on), SGLang's `send()` hands every page with the aux slot, and the result says how
long the forward took and when each room's last byte landed (its Success).
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List

import numpy as np
import torch

from sglang_mori import protocol
from sglang_mori.config import MoriConfig

import rig_device
from forward import StandInModel
from prefill_side import PrefillSide
from rig_device import on_device, synchronize, torch_device
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
    paged allocator hands out a fresh request's slots; SGLANG_MORI_RIG_PAGE1_RUN or `run` sets that run, and
    a run as long as the request is what a fresh SGLang pool gives at page size 1)."""

    def __init__(self, page_size: int, tokens: int, count: int, first_page: int, rng, run: int | None = None):
        self.page_size, self.tokens, self.count = page_size, tokens, count
        per = pages_for(tokens, page_size)
        total = per * count
        if page_size != 1:
            run = 1
        elif run is None:
            run = int(os.environ.get("SGLANG_MORI_RIG_PAGE1_RUN", "64"))
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
                 config: MoriConfig | None = None, prefill_devices=(0,), decode_device: int = 0):
        self.shape = SHAPES[shape_key]
        self.page_size = page_size
        self.prefill_devices, self.decode_device = tuple(prefill_devices), decode_device
        tp = len(self.prefill_devices)
        # SGLang's receiver: with MLA and prefill TP > decode TP only the first rank writes
        self.dummies = [self.shape.is_mla and r > 0 for r in range(tp)]
        # SGLANG_MORI_TRANSFER_PROCESS=on (gpu_bench.py --transfer-process): the prefill side
        # hands its transfers to a transfer process (prefill_process_side.py)
        env = MoriConfig.from_env(os.environ)
        # SGLANG_MORI_INLINE_POST from the environment too, where the backend under test has it
        inline = {"inline_post": env.inline_post} if hasattr(env, "inline_post") else {}
        self.config = config or MoriConfig(engine="soft", transfer_timeout_ms=30000,
                                           transfer_process=env.transfer_process, **inline)
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        config_kwargs = {k: getattr(self.config, k) for k in ("transfer_timeout_ms", "peer_fail_fast_s")}
        # decode's arrival flag (SGLANG_MORI_DECODE_ARRIVAL_FLAG) from the environment, where the
        # backend under test has it: on against off in one checkout
        if hasattr(env, "decode_arrival_flag"):
            config_kwargs["decode_arrival_flag"] = env.decode_arrival_flag
        import decode_process

        self.proc = ctx.Process(target=decode_process.serve, daemon=True,
                                args=(child, shape_key, page_size, pages, config_kwargs, PATHS, decode_device))
        self.proc.start()
        self.prefills: List[PrefillSide] = []
        self.prefill = None  # rank 0 (the only one at TP 1)
        try:
            registration = self._recv(timeout=120)
            self.registration = protocol.decode(registration)  # decode's Register (its MemoryDescs)
            for rank, device in enumerate(self.prefill_devices):
                side_class = PrefillSide
                if self.config.transfer_process:
                    from prefill_process_side import ProcessPrefillSide as side_class
                side = side_class(self.shape.sliced(tp), page_size, pages, self.config, group_size,
                                  device=device, tp_rank=rank)
                self.prefills.append(side)
                side.start(registration)
            self.prefill = self.prefills[0]
        except BaseException:
            self.close()
            raise
        self.models = [StandInModel(p.shape, seed=p.tp_rank, device=p.device) for p in self.prefills]
        self.model = self.models[0]
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
        for side in self.prefills:
            side.stop()
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

    def open_rooms(self, reqs: Requests, rooms: List[int], rows=None) -> None:
        """Decode's receivers send their metadata to every prefill rank; every rank claims.
        `rows`: request index of each room (default: room i is request i)."""
        rows = list(range(len(rooms))) if rows is None else rows
        frames = self.open_decode(reqs, rooms, rows)
        for k, room in enumerate(rooms):
            self.claim(reqs, room, rows[k], frames[k])

    def open_decode(self, reqs: Requests, rooms: List[int], rows: List[int]) -> list:
        """Decode's side of opening `rooms` (receivers, their metadata), in one command: per room,
        the frames for each prefill rank."""
        return self.ask("open", ([(room, reqs.dst[rows[k]]) for k, room in enumerate(rooms)], self.dummies))

    def claim(self, reqs: Requests, room: int, row: int, frames: list) -> None:
        """Every prefill rank claims `room` with the metadata decode sent it."""
        for side in self.prefills:
            side.open(room, frames[side.tp_rank], reqs.row(row))

    def prefill_batch(self, reqs: Requests, *, layerwise: bool, side_stream: bool = False,
                      store_delay_cycles: int = 0, seed: int = 0, wait_s: float = WAIT_S) -> StepResult:
        """One step. At TP > 1 the ranks' forwards run one after the other (each on its GPU), so
        forward_ms is their sum: only the bytes, not the times, are meant to be read then."""
        rooms = self.next_rooms(reqs.count)
        self.open_rooms(reqs, rooms)
        rows = np.concatenate([reqs.row(i) for i in range(reqs.count)])
        inputs = []
        for side, model in zip(self.prefills, self.models):
            side.layerwise_on = layerwise
            with on_device(side.device):
                inputs.append((torch.as_tensor(rows, device=torch_device(side.device)),
                               model.inputs(reqs.tokens * reqs.count, seed),
                               rig_device.stream(side_stream, side.device)))
        synchronize()
        t0 = time.perf_counter()
        for side, model, (slots, x, stream) in zip(self.prefills, self.models, inputs):
            with on_device(side.device), rig_device.on_stream(stream):
                model.forward(x, side.pool, slots, hooked=layerwise, scheduler=side.scheduler(),
                              batch=side.batch(rooms, reqs.tokens), store_delay_cycles=store_delay_cycles)
            # What SGLang does before it sends: the batch's results are ready (the KV is in the pool).
            stream.synchronize()
        t1 = time.perf_counter()
        for side in self.prefills:
            for i, room in enumerate(rooms):
                side.send_all(room, reqs.src[i])
        t2 = t1
        failures = []
        for side in self.prefills:
            done = side.sglang.wait_concluded(rooms, wait_s)
            failures += [(side.tp_rank, room, side.failure(room)) for room in rooms if side.failure(room)]
            t2 = max(t2, max(done.values()))
        self.last_rooms = rooms
        return StepResult((t1 - t0) * 1e3, (t2 - t1) * 1e3, (t2 - t0) * 1e3, failures)

    def release(self, rooms: List[int]) -> None:
        for side in self.prefills:
            for room in rooms:
                side.release(room)
        self.ask("clear", rooms)

    # --- checks ---------------------------------------------------------------------------------------
    def mismatched_pages(self, reqs: Requests) -> int:
        """Request pages whose decode bytes (every buffer) differ from what the prefill ranks hold."""
        synchronize()
        src = self.expected_digests(reqs.src.reshape(-1))
        dst = self.ask("digests", [int(p) for p in reqs.dst.reshape(-1)], timeout=300)
        return sum(a != b for a, b in zip(src, dst))

    def expected_digests(self, pages) -> List[str]:
        """What decode's digest of each of these prefill pages must be. One writing rank: its page.
        MHA at prefill TP > 1: every token's heads are the ranks' slices side by side, rank 0 first."""
        writers = [side for side, dummy in zip(self.prefills, self.dummies) if not dummy]
        if len(writers) == 1:
            return [writers[0].pool.digest([int(p)]) for p in pages]
        ps = self.page_size
        per_buffer = []
        for b in range(self.shape.buffers):
            parts = [side.pool.page_bytes(b, pages).cpu().view(len(pages), ps, -1) for side in writers]
            per_buffer.append(torch.cat(parts, dim=2).numpy())
        out = []
        for i in range(len(pages)):
            h = hashlib.sha256()
            for full in per_buffer:
                h.update(full[i].tobytes())
            out.append(h.hexdigest())
        return out


def child_env() -> None:
    """Spawned children import the rig's modules by path; set before GpuPD starts one."""
    for p in PATHS:
        if p not in sys.path:
            sys.path.insert(0, p)
    os.environ.setdefault("SGLANG_MORI_ENGINE", "soft")
