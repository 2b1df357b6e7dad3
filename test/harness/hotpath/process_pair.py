"""`bench hotpath --transfer-process`: the scheduler process's Python per request with the prefill
transfer process (SGLANG_MORI_TRANSFER_PROCESS=on) against the in-process path (off), same run.

The prefill pools live in /dev/shm so the child maps them; decode runs in this process as in the
in-process rig (harness/hotpath/rig.py). The driver makes SGLang's calls: sender init (claim), one
send with every page and the aux slot, polls (the manager's check_status runs `sync` first) until
Success, clear. Counted on the scheduler process: those calls one by one (thread CPU) plus our
threads left there (the death watcher, which sleeps in the kernel); the child's CPU per request
(utime + stime from /proc) is reported apart, as what left the scheduler's process.
"""

from __future__ import annotations

import gc
import math
import os
import time
from multiprocessing import shared_memory

import numpy as np

from sglang_mori.backend import room_status as S
from sglang_mori.backend.plans import encode_layout
from sglang_mori.config import MoriConfig
from sglang_mori.transfer_process.child import ChildSpec
from sglang_mori.transfer_process.client import TransferProcess
from sglang_mori.transfer_process.pools import describe
from sglang_mori.transfer_process.scheduler_service import TransferProcessService

from harness.hotpath.meter import CallMeter, ThreadClocks
from harness.hotpath.rig import AUX_BYTES, AUX_SLOTS, SHAPES, PDPair, kv_args_and_layout
from harness.hotpath.run import Driver

POLL_S = 0.001  # SGLang polls every room once per scheduler loop; a busy loop is about this often
WAIT_S = 120.0


class SharedPrefillPool:
    def __init__(self, shape, pages: int, token_bytes: int):
        item = shape.page_size * token_bytes
        self.shm = [shared_memory.SharedMemory(create=True, size=pages * item) for _ in range(shape.buffers)]
        self.kv = [np.ndarray((pages * item,), np.uint8, s.buf) for s in self.shm]
        for a in self.kv:
            a[:] = 7
        self.aux = np.zeros(AUX_SLOTS * AUX_BYTES, dtype=np.uint8)
        self.args, self.layout = kv_args_and_layout(shape, self.kv, self.aux, item)

    def close(self) -> None:
        self.kv = []
        for s in self.shm:
            s.close()
            s.unlink()


def instant_child_main(spec, channel) -> None:
    """The transfer process with softio's writes instant (`--engine instant`), as in the parent."""
    from sglang_mori.transfer_process.child import main

    from harness.hotpath.rig import instant_writes

    with instant_writes() as instant:
        _proof_moves_real_bytes(instant)
        main(spec, channel)


def _proof_moves_real_bytes(instant) -> None:
    """The child's start-up proof checks the bytes its probe write moved, which instant writes
    never move: it runs with softio's own batch_write (a backend without the proof has nothing
    to wrap)."""
    try:
        from sglang_mori.transfer_process import proof
    except ImportError:
        return
    from sglang_mori.softio.engine import IOEngine

    prove = proof.prove

    def prove_for_real(*args, **kwargs):
        fake, IOEngine.batch_write = IOEngine.batch_write, instant._original
        try:
            return prove(*args, **kwargs)
        finally:
            IOEngine.batch_write = fake

    proof.prove = prove_for_real


def sync_cost_ns(service: TransferProcessService, sglang, room: int, calls: int = 20000) -> float:
    """One poll of a room with nothing new (the common case), timed in bulk without the per-call
    meter: what the manager's check_status adds to SGLang's own lookup."""
    sglang.open(room)
    service.claim(room)
    service.sync(room)
    start = time.thread_time_ns()
    for _ in range(calls):
        service.sync(room)
    spent = time.thread_time_ns() - start
    sglang.clear(room)
    service.release(room)
    return spent / calls


def _cpu_ns_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * 1_000_000_000 // os.sysconf("SC_CLK_TCK")


class ProcessDriver:
    draw_window = Driver.draw_window  # the same rooms and pages as the in-process driver's

    def __init__(self, pair: PDPair, service: TransferProcessService, sglang, tokens: int, window: int):
        self.pair, self.service, self.sglang = pair, service, sglang
        self.calls = CallMeter()
        self.per = math.ceil(tokens / pair.shape.page_size)
        self.window = window
        self.rng = np.random.default_rng(0)
        self.next_room = 1000
        self.polls = 0

    def _poll_until(self, rooms, done) -> None:
        end = time.monotonic() + WAIT_S
        pending = list(rooms)
        while pending:
            still = []
            for room in pending:
                with self.calls.call("prefill.poll"):
                    self.service.sync(room)
                    status = self.sglang.status(room)
                if self.calls.enabled:
                    self.polls += 1
                if status not in done:
                    still.append(room)
            pending = still
            if pending:
                if time.monotonic() > end:
                    raise TimeoutError(f"rooms not done: {pending[:5]}")
                time.sleep(POLL_S)

    def batch(self) -> None:
        p, c = self.pair, self.calls
        rooms, src, dst = self.draw_window()
        src = src.astype(np.int32)  # SGLang 0.5.23 sends int32 pages (kv_to_page_indices of its int32 req_to_token)
        attempts = {}
        for i, room in enumerate(rooms):
            p.decode_sglang.open(room)
            attempts[room] = p.decode.new_receiver(room)
            frames = p.encode(p.decode.record_destination(
                bootstrap_room=room, required_dst_info_num=1, kv_indices=dst[i], aux_index=room % AUX_SLOTS,
                state_indices=None, decode_prefix_len=None, is_dummy=False))
            self.to_child.send_multipart(frames)
            self.sglang.open(room)
            with c.call("prefill.init"):
                refused = self.service.claim(room)
            if refused:
                raise RuntimeError(f"room {room} refused: {refused}")
        self._poll_until(rooms, (S.WAITING_FOR_INPUT,))
        for i, room in enumerate(rooms):
            with c.call("prefill.send"):
                self.service.add_chunk(room, src[i], slice(0, self.per), True, aux_index=room % AUX_SLOTS)
        self._poll_until(rooms, (S.SUCCESS, S.FAILED))
        p.decode_sglang.wait_all(rooms, (S.SUCCESS, S.FAILED), WAIT_S)
        failed = [r for r in rooms if self.sglang.status(r) != S.SUCCESS or p.decode_sglang.status(r) != S.SUCCESS]
        if failed:
            raise RuntimeError(f"rooms failed: {[(r, self.sglang.failure_reason(r)) for r in failed[:3]]}")
        for room in rooms:
            self.sglang.clear(room)
            with c.call("prefill.clear"):
                self.service.release(room)
            p.decode.forget(room, attempts[room])
            p.decode_sglang.clear(room)


def _handoff_aux_reader(pool):
    """The manager's reader for the hand-off: row views of the aux buffer (AuxRows); a checkout
    from before session 22 copied bytes out instead."""
    try:
        from sglang_mori.transfer_process.aux_rows import AuxRows
    except ImportError:
        return lambda i: None if i is None else [pool.aux[i * AUX_BYTES:(i + 1) * AUX_BYTES].tobytes()]
    args = pool.args
    return AuxRows(args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens)


def run_process_case(shape_key: str, tokens: int, requests: int, window: int, token_bytes: int,
                     config: MoriConfig | None = None, engine_mode: str = "softio") -> dict:
    import zmq

    from harness.hotpath.rig import ConcludedSGLang

    shape = SHAPES[shape_key]
    per = math.ceil(tokens / shape.page_size)
    config = config or MoriConfig(engine="soft", transfer_shards=1)
    pages = per * window
    pool = SharedPrefillPool(shape, pages, token_bytes)
    spec = ChildSpec(config=config, layout=encode_layout(pool.layout),
                     kv=describe(pool.args.kv_data_ptrs, pool.args.kv_data_lens, False, -1), on_gpu=False,
                     device=-1, host="127.0.0.1", control_host="127.0.0.1", table_name="", table_slots=0,
                     parent_pid=0, aux_buffers=1)
    from sglang_mori.transfer_process.child import main as child_main

    process = TransferProcess(spec, slots=4096,
                              target=instant_child_main if engine_mode == "instant" else child_main)
    sglang = ConcludedSGLang()
    service = TransferProcessService(process, sglang, read_aux=_handoff_aux_reader(pool))
    pair = PDPair(shape, pages, token_bytes, config)  # its in-process prefill stays idle
    pair.decode.start()
    driver = ProcessDriver(pair, service, sglang, tokens, window)
    driver.to_child = pair.ctx.socket(zmq.PUSH)
    driver.to_child.connect(f"tcp://127.0.0.1:{process.port}")
    try:
        driver.to_child.send_multipart(pair.encode(pair.decode.registration()))
        for _ in range(2):
            driver.batch()
        gc.collect()
        gc.freeze()
        clocks = ThreadClocks()
        batches = max(1, requests // window)
        driver.calls.enabled = True
        child_start = _cpu_ns_of(process.process.pid)
        clocks.start()
        start = time.perf_counter()
        for _ in range(batches):
            driver.batch()
        wall = time.perf_counter() - start
        threads = clocks.since()
        child_ns = _cpu_ns_of(process.process.pid) - child_start
        per_sync_ns = sync_cost_ns(service, sglang, room=1)
    finally:
        driver.to_child.close(0)
        service.stop()
        pair.stop()  # its idle in-process prefill too
        pool.close()
        gc.unfreeze()
    n = batches * window
    rows = {"scheduler." + k.split(".", 1)[1]: round(v / n / 1e3, 1) for k, v in sorted(driver.calls.ns.items())}
    rows["mori-transfer-watch"] = round(threads.get("mori-transfer-watch", 0) / n / 1e3, 1)
    calls = round(sum(v for k, v in rows.items() if k != "scheduler.poll"), 1)
    polls = driver.polls / n
    return {"shape": shape_key, "tokens": tokens, "pages": per, "requests": n, "window": window,
            "engine": engine_mode, "wall_s": round(wall, 3), "scheduler_us": rows,
            # init + send + clear (+ the watcher): the calls SGLang makes once per request or chunk
            "calls_us": calls,
            # what sync adds to one poll of a room with nothing new, timed in bulk
            "sync_us_per_poll": round(per_sync_ns / 1e3, 3),
            "polls_per_request": round(polls, 1),
            # the calls plus this run's polls at the bulk sync cost (the per-call meter's own
            # overhead, about what a poll costs, left out)
            "scheduler_total_us": round(calls + polls * per_sync_ns / 1e3, 1),
            "metered_polls_us": rows.get("scheduler.poll", 0.0),
            "child_cpu_us": round(child_ns / n / 1e3, 1)}
