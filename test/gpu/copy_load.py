"""Copies only: the background load's device copies with none of our Python beside the forward
(scripts/gpu_bench.py --parts interference, the "copies" window).

Ours, loaded, runs this project's services: Python per request in the forward's process (in-process)
or only a hand-off there and the service in a transfer process (a second CUDA context on the GPU).
To tell what of the forward's slowdown is that Python and what the copies themselves cost (their
SM and memory traffic, and, from another process, the GPU time-slicing between CUDA contexts), this
load posts the same copies at the same rate through softio's own DeviceEngine (the same stream
kind, the same gather kernel or copy engines, SGLANG_MORI_SOFTIO_DEVICE_COPY, the same pacing) with
nothing else: each request's range table (the planner's columns for its pages, all layers) is made
once at start, and each due request is one `submit` of it.

Where it runs: a spawned process (`CopyLoadProcess`: its own CUDA context, as the transfer process
has) or a thread of the forward's process (`CopyLoad.start`: the forward's context, as in-process
transfers have). Its pools are its own, on the same GPU and of the same geometry as the rig's, so its
copies touch no byte of the rig's rooms. On the rig's CPU mode (rig_device) the copies are host
memmoves, so the bookkeeping can be checked without a GPU.
"""

from __future__ import annotations

import ctypes
import threading
import time

import numpy as np

from sglang_mori.softio.enums import StatusCode

TICK_S = 0.002  # the same cadence as the rig's background sender (gpu_bench.forwards_free_load)


def due(elapsed_s: float, rate: float, sent: int) -> int:
    """Requests due by `elapsed_s` at `rate` per second that are not sent yet (never negative)."""
    return max(0, int(elapsed_s * rate) - sent)


def copy_table(columns, pairs, src_ptrs, dst_ptrs):
    """One request's copies as (dsts, srcs, sizes) uint64 arrays: the planner's columns (local
    offsets, remote offsets, sizes: one entry per KV pair, in `pairs` order) turned into addresses
    of the buffers `src_ptrs[i]` -> `dst_ptrs[j]` of each pair (i, j), pair after pair, as softio's
    device batch builds its table."""
    lo, ro, sz = columns[0], columns[1], columns[2]
    if len(pairs) != len(lo):
        raise ValueError(f"{len(lo)} columns for {len(pairs)} pairs")
    dsts = np.concatenate([np.int64(dst_ptrs[j]) + np.asarray(ro[k], np.int64) for k, (_, j) in enumerate(pairs)])
    srcs = np.concatenate([np.int64(src_ptrs[i]) + np.asarray(lo[k], np.int64) for k, (i, _) in enumerate(pairs)])
    sizes = np.concatenate([np.asarray(s, np.int64) for s in sz])
    return dsts.view(np.uint64), srcs.view(np.uint64), sizes.view(np.uint64)


class _HostCopier:
    """The CPU mode's stand-in for the device engine: the copies done at once, in this thread."""

    def submit(self, dsts, srcs, sizes, statuses, to_peer=False, holds=()):
        for d, s, n in zip(dsts.tolist(), srcs.tolist(), sizes.tolist()):
            ctypes.memmove(d, s, n)
        for status in statuses:
            status.Update(StatusCode.SUCCESS, "")

    def close(self) -> None:
        pass


class CopyLoad:
    """The copies of `count` requests (pages `src_pages[k]` -> `dst_pages[k]`) between two pools of
    `pages` pages of `shape_key`'s geometry on GPU `device`, posted at a rate by `start`/`stop`."""

    def __init__(self, shape_key: str, page_size: int, pages: int, src_pages, dst_pages, device: int = 0):
        import torch

        import rig_device
        from sglang_mori.backend.plans import local_layout
        from sglang_mori.planning.planner import TransferPlanner
        from shapes import SHAPES, kv_args

        rig_device.set_device(device)
        shape = SHAPES[shape_key]
        item = page_size * shape.token_bytes
        where = rig_device.torch_device(device)
        self.src = [torch.randint(0, 255, (pages * item,), dtype=torch.uint8, device=where) for _ in range(shape.buffers)]
        self.dst = [torch.zeros(pages * item, dtype=torch.uint8, device=where) for _ in range(shape.buffers)]
        self.aux = np.zeros(64, np.uint8)  # the layout needs one (this load writes no aux)
        args = kv_args(shape, page_size, [t.data_ptr() for t in self.src], [t.numel() for t in self.src],
                       self.aux.ctypes.data, self.aux.nbytes, self.aux.nbytes)
        layout = local_layout(args, shape.tp_size, 0, shape.is_mla)
        planner = TransferPlanner(layout, layout)
        src_ptrs, dst_ptrs = [t.data_ptr() for t in self.src], [t.data_ptr() for t in self.dst]
        self.tables = [copy_table(planner.plan_kv_columns(s, d), planner.kv_pairs, src_ptrs, dst_ptrs)
                       for s, d in zip(np.asarray(src_pages), np.asarray(dst_pages))]
        self.bytes_per_request = [int(t[2].sum()) for t in self.tables]
        if rig_device.ON_GPU:
            from sglang_mori.softio import cuda_runtime
            from sglang_mori.softio.device_path import DeviceEngine

            self.engine = DeviceEngine(cuda_runtime.load(), device, "copies-only")
        else:
            self.engine = _HostCopier()
        self.sent, self._rate, self._last = 0, 0.0, None
        self._stop, self._go, self._idle = threading.Event(), threading.Event(), threading.Event()
        self._idle.set()
        self._closing = False
        self._error = None
        self._thread = None

    def post(self, k: int) -> None:
        from sglang_mori.softio.status import TransferStatus

        status = TransferStatus()
        status._start()  # the engine completes it when the copies' event fired (paced)
        dsts, srcs, sizes = self.tables[k % len(self.tables)]
        self.engine.submit(dsts, srcs, sizes, [status])
        self._last = status

    def _run(self) -> None:
        # One thread for the load's life, idle between windows: a thread that ended would take its
        # CPU time out of /proc before the window's meter reads it (thread_roles.ThreadCpu).
        while True:
            self._go.wait()
            if self._closing:
                return
            start = time.perf_counter()
            try:
                while not self._stop.is_set():
                    for _ in range(due(time.perf_counter() - start, self._rate, self.sent)):
                        self.post(self.sent)
                        self.sent += 1
                    self._stop.wait(TICK_S)
            except Exception as exc:  # noqa: BLE001 - stop() raises it in the caller's thread
                self._error = exc
            self._go.clear()
            self._idle.set()

    def start(self, rate: float) -> None:
        """Post the requests due at `rate` from this load's thread until `stop`."""
        if not self._idle.is_set():
            raise RuntimeError("copies-only load already started")
        self.sent, self._last, self._rate = 0, None, float(rate)
        self._stop.clear()
        self._idle.clear()
        self._go.set()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="copies-only", daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float = 60.0) -> int:
        """Stop posting, wait until the last copies landed (their paced status); the count posted."""
        self._stop.set()
        if not self._idle.wait(timeout_s):
            raise TimeoutError(f"copies-only load did not stop in {timeout_s} s")
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"copies-only load failed: {error}") from error
        if self._last is not None:
            code = self._last.WaitFor(int(timeout_s * 1000))
            if not self._last.Succeeded():
                raise RuntimeError(f"copies-only load: the last copies ended {code}: {self._last.Message()}")
        return self.sent

    def close(self) -> None:
        self._closing = True
        self._stop.set()
        self._go.set()
        if self._thread is not None:
            self._thread.join(10)
        self.engine.close()


def serve(conn, paths: list, spec: dict) -> None:
    """The spawned process: a CopyLoad driven over `conn` with ("start", rate) / ("stop", None) /
    ("close", None); answers each command (stop: the count posted; errors are sent back)."""
    import sys

    sys.path[:0] = [p for p in paths if p not in sys.path]
    try:
        load = CopyLoad(**spec)
    except Exception as exc:  # noqa: BLE001 - the parent raises it
        conn.send(exc)
        return
    conn.send(load.bytes_per_request)
    try:
        while True:
            cmd, arg = conn.recv()
            try:
                if cmd == "start":
                    load.start(float(arg))
                    conn.send(None)
                elif cmd == "stop":
                    conn.send(load.stop())
                elif cmd == "close":
                    conn.send(None)
                    return
                else:
                    conn.send(ValueError(f"unknown command {cmd!r}"))
            except Exception as exc:  # noqa: BLE001
                conn.send(exc)
    finally:
        load.close()


class CopyLoadProcess:
    """CopyLoad in a spawned process (its own CUDA context on the same GPU), same start/stop."""

    def __init__(self, paths: list, timeout_s: float = 120.0, **spec):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=serve, args=(child, paths, spec), daemon=True, name="copies-only")
        self.proc.start()
        self.bytes_per_request = self._recv(timeout_s)

    def _recv(self, timeout_s: float = 60.0):
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"copies-only process silent for {timeout_s} s (alive: {self.proc.is_alive()})")
        out = self.conn.recv()
        if isinstance(out, Exception):
            raise out
        return out

    def start(self, rate: float) -> None:
        self.conn.send(("start", rate))
        self._recv()

    def stop(self, timeout_s: float = 90.0) -> int:
        self.conn.send(("stop", None))
        return self._recv(timeout_s)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(("close", None))
                self._recv(10)
            except (OSError, TimeoutError, EOFError):
                pass
            self.proc.join(10)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(5)
