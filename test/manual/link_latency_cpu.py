"""Our Python's share of a lone request's latency from send() to Success, on the CPU, with softio's
engine replaced by one that behaves like its device path: `batch_write` returns running statuses
and one engine thread completes a call's statuses together (succeed_all) a fixed COPY_MS after the
call, calls in the order posted, as a GPU stream runs its kernels (two calls in a row: the second
ends COPY_MS after the first). Both services run as in production (harness/hotpath/rig.py: ZMQ,
control, shard, completion, decode's status thread).

Per request, medians in ms: `to_post` (send() to the engine call), `post` (the call), `done_late`
(the engine thread's completion after the copy's end: its wake-up and the GIL), `to_success`
(completion to the room's Success on prefill: the completion thread's wake-up and pass), and
`beyond_copy` = Success - send() - COPY_MS. A burst of BURST requests sent back to back reports
`burst_beyond` = the last Success - the first send() - BURST x COPY_MS. The copy is a sleep, so
these are wake-ups, GIL hand-offs and our Python, which on a GPU host add to the kernel's time.

    scripts/in_private_netns.sh .venv/bin/python test/manual/link_latency_cpu.py [mla61p64|gqa32p16] [TOKENS] [REQUESTS]
"""

from __future__ import annotations

import queue
import statistics
import sys
import threading
import time
from pathlib import Path

TEST = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(TEST / "harness"), str(TEST / "inprocess"), str(TEST)]

COPY_MS = 1.6  # the gather kernel of MLA 8K on 2x H200 (docs/benchmarks.md, issue 28)
BURST = 4


class StreamLikeWrites:
    """`with StreamLikeWrites(copy_s):` softio's batch_write as its device path completes it."""

    def __init__(self, copy_s: float):
        self.copy_s = copy_s
        self.posts: list = []  # (call start, call end)
        self.done: list = []  # when the engine thread completed a call's statuses
        self._pending: queue.SimpleQueue = queue.SimpleQueue()
        self._free_at = 0.0

    def __enter__(self):
        from sglang_mori.softio.engine import IOEngine
        from sglang_mori.softio.status import TransferStatus, start_all, succeed_all

        self._original = IOEngine.batch_write
        probe = self

        def batch_write(engine, local_descs, local_offsets, remote_descs, remote_offsets, sizes, uids):
            start = time.perf_counter()
            statuses = [TransferStatus() for _ in uids]
            start_all(statuses)
            probe._free_at = max(probe._free_at, start) + probe.copy_s  # one stream, in order
            probe._pending.put((probe._free_at, statuses))
            probe.posts.append((start, time.perf_counter()))
            return statuses

        def complete():
            while True:
                item = probe._pending.get()
                if item is None:
                    return
                end, statuses = item
                delay = end - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)  # GIL released, as cudaEventSynchronize
                probe.done.append((end, time.perf_counter()))
                succeed_all(statuses)

        self._thread = threading.Thread(target=complete, name="softio-gpu-probe", daemon=True)
        self._thread.start()
        IOEngine.batch_write = batch_write
        return self

    def __exit__(self, *exc):
        from sglang_mori.softio.engine import IOEngine

        IOEngine.batch_write = self._original
        self._pending.put(None)
        self._thread.join(5)


def main(shape_key: str = "mla61p64", tokens: int = 8192, requests: int = 30) -> None:
    import math

    import numpy as np

    from sglang_mori.backend import room_status as S
    from sglang_mori.config import MoriConfig
    from harness.hotpath.rig import AUX_SLOTS, SHAPES, PDPair, rig_config

    shape = SHAPES[shape_key]
    per = math.ceil(tokens / shape.page_size)
    rng = np.random.default_rng(0)
    stamps: dict = {}

    with StreamLikeWrites(COPY_MS / 1e3) as probe:
        pair = PDPair(shape, per * BURST, 16, rig_config(transfer_shards=1))
        original_set = pair.prefill_sglang.set_status

        def set_status(room, status):
            if status == S.SUCCESS:
                stamps[room] = time.perf_counter()
            original_set(room, status)
        pair.prefill_sglang.set_status = set_status
        pair.start()
        room = [1000]

        def run(n: int):
            rooms = list(range(room[0], room[0] + n))
            room[0] += n
            src = rng.permutation(per * BURST)[:per * n].reshape(n, per)
            dst = rng.permutation(per * BURST)[:per * n].reshape(n, per)
            for i, r in enumerate(rooms):
                pair.decode_sglang.open(r)
                pair.decode.new_receiver(r)
                pair.send_to_prefill(pair.encode(pair.decode.record_destination(
                    bootstrap_room=r, required_dst_info_num=1, kv_indices=dst[i], aux_index=r % AUX_SLOTS,
                    state_indices=None, decode_prefix_len=None, is_dummy=False)))
                pair.prefill_sglang.open(r)
                assert pair.prefill.claim(r) is None
            pair.prefill_sglang.wait_all(rooms, (S.WAITING_FOR_INPUT,), 30)
            posts, done = len(probe.posts), len(probe.done)
            t0 = time.perf_counter()
            for i, r in enumerate(rooms):
                pair.prefill.add_chunk(r, src[i], slice(0, per), True, aux_index=r % AUX_SLOTS)
            pair.prefill_sglang.wait_all(rooms, (S.SUCCESS, S.FAILED), 30)
            pair.decode_sglang.wait_all(rooms, (S.SUCCESS, S.FAILED), 30)
            bad = [r for r in rooms if pair.prefill_sglang.status(r) != S.SUCCESS]
            assert not bad, [pair.prefill_sglang.failure_reason(r) for r in bad]
            for r in rooms:
                pair.prefill.release(r)
                pair.prefill_sglang.clear(r)
                pair.decode_sglang.clear(r)
            return t0, rooms, probe.posts[posts:], probe.done[done:]

        try:
            for _ in range(3):
                run(1)
            phases = {"to_post": [], "post": [], "done_late": [], "to_success": [], "beyond_copy": []}
            for _ in range(requests):
                t0, rooms, posts, done = run(1)
                success = stamps[rooms[0]]
                (p0, p1), (end, seen) = posts[0], done[0]
                for key, value in (("to_post", p0 - t0), ("post", p1 - p0), ("done_late", seen - end),
                                   ("to_success", success - seen), ("beyond_copy", success - t0 - COPY_MS / 1e3)):
                    phases[key].append(value * 1e3)
            bursts = []
            for _ in range(max(3, requests // 4)):
                t0, rooms, _, _ = run(BURST)
                bursts.append((max(stamps[r] for r in rooms) - t0) * 1e3 - BURST * COPY_MS)
        finally:
            pair.stop()
        # chunks posted on send()'s own thread (SGLANG_MORI_INLINE_POST; None: a backend without it)
        inline = getattr(pair.prefill.submitter, "inline_posts", None)
    row = ", ".join(f"{k} {statistics.median(v):.3f}" for k, v in phases.items())
    print(f"{shape_key} {tokens} tok, copy {COPY_MS} ms, {requests} requests: {row} ms; "
          f"burst of {BURST}: beyond copies {statistics.median(bursts):.3f} ms; "
          f"inline posts {inline} of {3 + requests + BURST * len(bursts)} chunks", flush=True)


if __name__ == "__main__":
    main(*(f(a) for f, a in zip((str, int, int), sys.argv[1:])))
