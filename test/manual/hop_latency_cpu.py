"""The transfer process's hop on a lone request's path, on the CPU (issue 28, session 19).

A lone request through the prefill transfer process (SGLANG_MORI_TRANSFER_PROCESS=on), with the
child's softio engine replaced by one that completes like its device path (link_latency_cpu.py's
StreamLikeWrites: running statuses, one engine thread that completes a call COPY_MS after it).
The scheduler side is this process: SGLang's claim, one send() of every page with the aux slot,
then polls (`sync`, as the manager's check_status) every POLL_S until Success; decode runs here
too (harness/hotpath/rig.py). Stamps (time.perf_counter: CLOCK_MONOTONIC, one clock for both
processes) are taken by wrappers this script installs in the child, so the backend pays nothing
for them when it is not measured:

- `send`: the scheduler's send() call (start to return); `send_cpu` its thread's CPU time
- `to_reader`: send() start -> the child's reader has the record
- `to_engine`: the record read -> the engine call starts (the reader's inline post, or a shard's);
  `reader_cpu` the reader thread's CPU time over it (an inline post: wall - CPU = waits)
- `engine_call`: the engine call itself
- `done_late`: the copy's end -> the engine thread completed the statuses (its wake-up)
- `to_table`: completion -> Success written to the status table (completion thread, Success; the
  stamp is taken just before the write, so that a poll that sees it always comes after)
- `to_poll`: written -> the scheduler's poll saw it (half a poll interval plus the sleep's slack)
- `beyond_copy`: seen - send() start - COPY_MS: everything that is not the copy

`on_reader` counts requests whose engine call ran on the reader thread (an inline post).

    scripts/in_private_netns.sh .venv/bin/python test/manual/hop_latency_cpu.py \
        [mla61p64|gqa32p16] [TOKENS] [REQUESTS] [POLL_MS]

Base against new: the same command with PYTHONPATH=<other checkout>/python (the child inherits it).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

TEST = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(p) for p in (TEST / "harness", TEST / "inprocess", TEST / "manual", TEST) if str(p) not in sys.path]

COPY_MS = 1.6  # the gather kernel of MLA 8K on 2x H200 (docs/benchmarks.md, issue 28)
POLL_MS = 0.1  # test/gpu/link_bench.py's LINK_POLL_S
_STAMPS_ENV = "HOP_LATENCY_STAMPS"  # where the child writes its stamps when it ends
_COPY_ENV = "HOP_LATENCY_COPY_MS"
_PROFILE_ENV = "HOP_LATENCY_PROFILE"  # set: the child profiles its reader's chunk records into this pstats file


def stamped_child_main(spec, channel) -> None:
    """The transfer process's entry point with its stamps; runs in the spawned child."""
    from sglang_mori.backend import room_status as S
    from sglang_mori.transfer_process import child, handoff, proof
    from sglang_mori.transfer_process.status_table import StatusTable

    from link_latency_cpu import StreamLikeWrites

    stamps = {"read": [], "read_cpu": [], "post_cpu": [], "table": [], "threads": []}
    now = time.perf_counter
    next_record = handoff.Receiver.next

    def next_(self):
        rec = next_record(self)
        if rec is not None and rec.kind == handoff.CHUNK:
            stamps["read"].append(now())
            stamps["read_cpu"].append(time.thread_time())
        return rec
    handoff.Receiver.next = next_
    write = StatusTable.write

    def write_(self, slot, status, *a, **kw):
        if status == S.SUCCESS:  # before the write: a poll that sees it comes after this stamp
            stamps["table"].append(now())
        write(self, slot, status, *a, **kw)
    StatusTable.write = write_
    profile_path = os.environ.get(_PROFILE_ENV)
    if profile_path:
        import cProfile

        profiler = cProfile.Profile()
        def handle_(self, rec):
            if rec.kind != handoff.CHUNK:
                return handle(self, rec)
            profiler.enable()
            try:
                return handle(self, rec)
            finally:
                profiler.disable()
        import sglang_mori.transfer_process.child_parts as child_parts
        handle = child_parts.ChildService.handle
        child_parts.ChildService.handle = handle_

    with StreamLikeWrites(float(os.environ[_COPY_ENV]) / 1e3) as probe:
        from sglang_mori.softio.engine import IOEngine

        fake = IOEngine.batch_write

        def batch_write(*a, **kw):  # which thread made the call: the reader (inline) or a shard
            stamps["threads"].append(threading.current_thread() is threading.main_thread())
            stamps["post_cpu"].append(time.thread_time())
            return fake(*a, **kw)
        IOEngine.batch_write = batch_write
        prove = proof.prove

        def prove_for_real(*a, **kw):  # the start-up proof checks the bytes its probe moved
            IOEngine.batch_write = probe._original
            try:
                return prove(*a, **kw)
            finally:
                IOEngine.batch_write = batch_write
        proof.prove = prove_for_real
        try:
            child.main(spec, channel)
        finally:
            stamps["posts"], stamps["done"] = probe.posts, probe.done
            if profile_path:
                profiler.dump_stats(profile_path)
            with open(os.environ[_STAMPS_ENV], "w") as f:
                json.dump(stamps, f)


def _phases(t0, sent, seen, send_cpu, child: dict, i: int, copy_s: float) -> dict:
    (p0, p1), (end, done) = child["posts"][i], child["done"][i]
    read, table = child["read"][i], child["table"][i]
    return {"send": sent - t0, "send_cpu": send_cpu, "to_reader": read - t0, "to_engine": p0 - read,
            "engine_call": p1 - p0,  # the reader's CPU means something only where it made the call
            "reader_cpu": child["post_cpu"][i] - child["read_cpu"][i] if child["threads"][i] else math.nan,
            "done_late": done - end, "to_table": table - done, "to_poll": seen - table,
            "beyond_copy": seen - t0 - copy_s}


def main(shape_key: str = "mla61p64", tokens: int = 8192, requests: int = 40, poll_ms: float = POLL_MS) -> dict:
    import numpy as np
    import zmq

    from sglang_mori.backend import room_status as S
    from sglang_mori.backend.plans import encode_layout
    from sglang_mori.transfer_process.child import ChildSpec
    from sglang_mori.transfer_process.client import TransferProcess
    from sglang_mori.transfer_process.pools import describe
    from sglang_mori.transfer_process.scheduler_service import TransferProcessService

    from harness.hotpath.process_pair import SharedPrefillPool
    from harness.hotpath.rig import AUX_BYTES, AUX_SLOTS, SHAPES, ConcludedSGLang, PDPair, rig_config

    shape = SHAPES[shape_key]
    per = math.ceil(tokens / shape.page_size)
    pages = per * 2
    copy_s, poll_s = COPY_MS / 1e3, poll_ms / 1e3
    config = rig_config(engine="soft", transfer_shards=1)
    pool = SharedPrefillPool(shape, pages, 16)
    spec = ChildSpec(config=config, layout=encode_layout(pool.layout),
                     kv=describe(pool.args.kv_data_ptrs, pool.args.kv_data_lens, False, -1), on_gpu=False,
                     device=-1, host="127.0.0.1", control_host="127.0.0.1", table_name="", table_slots=0,
                     parent_pid=0, aux_buffers=1)
    fd, stamps_path = tempfile.mkstemp(prefix="hop-stamps-", suffix=".json")
    os.close(fd)
    os.environ[_STAMPS_ENV], os.environ[_COPY_ENV] = stamps_path, str(COPY_MS)
    try:
        process = TransferProcess(spec, slots=256, target=stamped_child_main)
    finally:  # the spawned child has its copy of the environment; the caller's stays as it was
        os.environ.pop(_STAMPS_ENV, None)
        os.environ.pop(_COPY_ENV, None)
    sglang = ConcludedSGLang()
    service = TransferProcessService(process, sglang, read_aux=lambda i: None if i is None else
                                     [pool.aux[i * AUX_BYTES:(i + 1) * AUX_BYTES].tobytes()])
    pair = PDPair(shape, pages, 16, config)  # its in-process prefill stays idle
    pair.decode.start()
    to_child = pair.ctx.socket(zmq.PUSH)
    to_child.connect(f"tcp://127.0.0.1:{process.port}")
    rng = np.random.default_rng(0)
    rounds = []  # (send() start, send() return, poll saw Success)

    def poll_until(room, done, end):
        while True:
            service.sync(room)
            if sglang.status(room) in done:
                return time.perf_counter()
            if time.monotonic() > end:
                raise TimeoutError(f"room {room}: status {sglang.status(room)}")
            if poll_s:
                time.sleep(poll_s)

    try:
        to_child.send_multipart(pair.encode(pair.decode.registration()))
        for room in range(1000, 1000 + 3 + requests):
            src, dst = rng.permutation(pages)[:per], rng.permutation(pages)[:per]
            pair.decode_sglang.open(room)
            attempt = pair.decode.new_receiver(room)
            to_child.send_multipart(pair.encode(pair.decode.record_destination(
                bootstrap_room=room, required_dst_info_num=1, kv_indices=dst, aux_index=room % AUX_SLOTS,
                state_indices=None, decode_prefix_len=None, is_dummy=False)))
            sglang.open(room)
            assert service.claim(room) is None
            end = time.monotonic() + 30
            poll_until(room, (S.WAITING_FOR_INPUT,), end)
            c0, t0 = time.thread_time(), time.perf_counter()
            service.add_chunk(room, src, slice(0, per), True, aux_index=room % AUX_SLOTS)
            sent, c1 = time.perf_counter(), time.thread_time()
            seen = poll_until(room, (S.SUCCESS, S.FAILED), end)
            if sglang.status(room) != S.SUCCESS:
                raise RuntimeError(f"room {room} failed: {sglang.failure_reason(room)}")
            pair.decode_sglang.wait_all([room], (S.SUCCESS, S.FAILED), 30)
            rounds.append((t0, sent, seen, c1 - c0))
            sglang.clear(room)
            service.release(room)
            pair.decode.forget(room, attempt)
            pair.decode_sglang.clear(room)
    finally:
        to_child.close(0)
        service.stop()  # the child ends and writes its stamps
        pair.stop()
        pool.close()
    with open(stamps_path) as f:
        child = json.load(f)
    os.unlink(stamps_path)
    if not (len(child["read"]) == len(child["posts"]) == len(child["done"]) == len(child["table"]) == len(rounds)):
        raise RuntimeError(f"stamps do not pair up: {[(k, len(v)) for k, v in child.items()]}, {len(rounds)} requests")
    rows = [_phases(*stamps, child, i, copy_s) for i, stamps in enumerate(rounds)][3:]
    medians = {k: round(1e3 * statistics.median([r[k] for r in rows if not math.isnan(r[k])] or [math.nan]), 3)
               for k in rows[0]}
    on_reader = sum(child["threads"][3:])
    print(f"{shape_key} {tokens} tok, copy {COPY_MS} ms, poll {poll_ms} ms, {requests} requests: "
          + ", ".join(f"{k} {v:.3f}" for k, v in medians.items())
          + f" ms; engine call on the reader {on_reader}/{requests}", flush=True)
    return {"shape": shape_key, "tokens": tokens, "poll_ms": poll_ms, "phases_ms": medians, "on_reader": on_reader,
            "requests": requests, "rows": rows}


if __name__ == "__main__":
    main(*(f(a) for f, a in zip((str, int, int, float), sys.argv[1:])))
