"""`scripts/bench_backend.py handoff`: wall-clock latency of the hand-offs on a PD request's time to
first token that are ours, on CPU (issue 27's "Where PD's 8K TTFT goes", docs/benchmarks.md).

One prefill and one decode service in this process (hotpath/rig.py: softio, ZMQ between them),
requests one at a time (concurrency 1), per request:

- destinations: decode's scheduler builds and sends its RoomMetadata -> prefill publishes the
  room's destinations to SGLang (WaitingForInput);
- last chunk -> Success: prefill's scheduler hands over the last chunk -> prefill's SGLang table
  says Success (our Success decision) -> decode's SGLang table says Success (the message arrived
  and was applied).

`--mode streamed` is layer-wise `auto` after a forward that streamed everything: the pages went in
an earlier chunk whose writes are done, and the last `send()` has nothing left to write (what
layerwise/session.add_chunk hands over then). `--mode chunk`: the last chunk carries every page.
`--spin`: a thread stands in for SGLang's scheduler loop, which runs Python between short calls
that release the GIL (ZMQ polls), so our threads' wake-ups compete for the GIL as in a server.
`--poll`: the spinning thread also polls the room as SGLang's sender / receiver `poll()` does
(MoriKVManager.check_status: `poll_inbox` first where the build has it), and the run reports when
that poll first sees destinations (prefill) and Success (decode): the moments SGLang acts on them.
`--after-send-us N`: the driver runs N us of Python right after handing the last chunk over, as
SGLang's scheduler goes on with the batch result after `send()`; a thread we woke waits for it.
Timings only; correctness is the tests' (test/inprocess).
"""

from __future__ import annotations

import contextlib
import json
import math
import statistics
import threading
import time

SEGMENTS = ("destinations", "last_chunk_to_prefill_success", "prefill_success_to_decode_success",
            "last_chunk_to_decode_success")
# With --poll: when the stand-in scheduler's poll first sees the status SGLang waits for.
POLL_SEGMENTS = ("destinations_to_prefill_poll", "prefill_success_to_decode_poll", "last_chunk_to_decode_poll")


def add_arguments(p) -> None:
    p.add_argument("--shape", default="gqa32p16", help="mla61p64 or gqa32p16")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--mode", choices=("streamed", "chunk"), default="streamed")
    p.add_argument("--spin", action="store_true", help="a Python thread spins as SGLang's scheduler loop does")
    p.add_argument("--engine", choices=("softio", "instant"), default="instant")
    p.add_argument("--after-send-us", type=int, default=0,
                   help="Python the driver runs right after the last hand-off, GIL held, as SGLang's "
                        "scheduler goes on processing the batch result after send()")
    p.add_argument("--poll", action="store_true",
                   help="the spinning thread also polls the room as SGLang's sender / receiver poll() does "
                        "(check_status: poll_inbox first where the build has it, then the status table); "
                        "implies --spin")
    p.add_argument("--ab", action="store_true",
                   help="with --poll: every other request the stand-in does not read the socket in its "
                        "poll (our reading thread does, as before the poll-reads change), so both "
                        "paths are measured in one run under the same machine load")
    p.add_argument("--spin-us", type=int, default=0,
                   help="with --spin/--poll: us of Python the stand-in runs (GIL held) between its ZMQ "
                        "polls, for a busier scheduler loop than the default ~10-20 us")
    p.add_argument("--json", action="store_true")


class Stamps:
    """Wraps a FakeSGLang's set_status/publish_destinations: the first time each room reaches a
    status, stamped with perf_counter."""

    def __init__(self, sglang):
        self.at: dict = {}
        original_set, original_publish = sglang.set_status, sglang.publish_destinations

        def set_status(room, status):
            original_set(room, status)
            self.at.setdefault((room, status), time.perf_counter())

        def publish(room, targets):
            self.at.setdefault((room, "published"), time.perf_counter())
            original_publish(room, targets)

        sglang.set_status, sglang.publish_destinations = set_status, publish


class Spinner:
    """SGLang's scheduler loop, idle: Python work between non-blocking ZMQ polls (GIL released).
    With `polls`, it also polls the watched rooms each pass as SGLang's bootstrap and transfer
    queues poll their senders and receivers, stamping when a poll first sees the awaited status."""

    def __init__(self, ctx, polls: bool = False, hold_us: int = 0):
        import zmq

        self.hold_s = hold_us / 1e6
        self.sock = ctx.socket(zmq.PULL)
        self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.stop = threading.Event()
        self.polls = polls
        self.watched: list = []  # (key, service, sglang, room, awaited statuses, statuses that read the inbox)
        self.seen: dict = {}  # key -> perf_counter of the first poll that saw the awaited status
        self.polled: set = set()  # keys polled at least once
        self.reads = True  # the poll reads the socket first (poll_inbox), as check_status does
        self.thread = threading.Thread(target=self.run, name="scheduler-stand-in", daemon=True)

    def watch(self, key, service, sglang, room, awaited, inbox_waits) -> None:
        self.watched = self.watched + [(key, service, sglang, room, awaited, inbox_waits)]

    def _poll_rooms(self) -> None:
        for key, service, sglang, room, awaited, inbox_waits in self.watched:
            if key in self.seen:
                continue
            status = sglang.status(room)
            poll_inbox = getattr(service, "poll_inbox", None)  # MoriKVManager.check_status's step
            if self.reads and status in inbox_waits and poll_inbox is not None:
                poll_inbox()
                status = sglang.status(room)
            if status in awaited:
                self.seen[key] = time.perf_counter()
            self.polled.add(key)

    def wait_polled(self, key, timeout_s: float = 30.0) -> None:
        """SGLang's sender polls its room for a while before decode's destinations arrive (decode
        pre-allocates first: 0.8 ms on the H200); the bench sends them once it has polled."""
        deadline = time.monotonic() + timeout_s
        while key not in self.polled:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the stand-in scheduler never polled {key}")
            time.sleep(0.0002)

    def wait_seen(self, key, timeout_s: float = 30.0) -> float:
        deadline = time.monotonic() + timeout_s
        while key not in self.seen:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the stand-in scheduler never saw {key}")
            time.sleep(0.0002)
        return self.seen[key]

    def run(self) -> None:
        import zmq

        deadline = time.monotonic() + 3600  # bounded: the bench ends it long before
        while not self.stop.is_set() and time.monotonic() < deadline:
            if self.hold_s:
                _busy(self.hold_s)
            else:
                sum(i * i for i in range(200))  # ~10-20 us of Python, GIL held
            self.sock.poll(0, zmq.POLLIN)
            if self.polls:
                self._poll_rooms()

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(5)
        self.sock.close(0)


def _busy(seconds: float) -> None:
    """Pure Python for `seconds`: the GIL is let go only when another thread forces a switch."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        sum(i for i in range(50))


def _wait(sglang, room, statuses, timeout_s=30.0) -> None:
    sglang.wait_all([room], statuses, timeout_s)


def _submit_last(pair, chunk) -> None:
    """Hand the last chunk over as layer-wise `add_chunk` does on this checkout."""
    service = pair.prefill
    if hasattr(service, "track_last_without_writes") and getattr(chunk, "writes_nothing", True):
        service.track_last_without_writes(chunk)
    else:  # a checkout before issue 27's change: every chunk through a shard
        service.submitter.enqueue(chunk)


def _streamed_done(pair, room) -> bool:
    rooms = pair.prefill.p.rooms
    with rooms.lock:
        r = rooms.get(room)
        return r is not None and not r.submitting and bool(r.writes) and not r.unfinished()


def run(args) -> int:
    import numpy as np

    from harness.hotpath.rig import AUX_SLOTS, SHAPES, PDPair, instant_writes
    from sglang_mori.backend import room_status as S
    from sglang_mori.backend.prefill.service import PrefillService
    from sglang_mori.backend.prefill.layerwise.planner import LayerwisePlanner, selected_chunk
    from sglang_mori.config import MoriConfig

    shape = SHAPES[args.shape]
    per = math.ceil(args.tokens / shape.page_size)
    writes = instant_writes() if args.engine == "instant" else contextlib.nullcontext()
    with writes:
        pair = PDPair(shape, per, 16, MoriConfig(transfer_shards=1))
        pool = pair.prefill_pool
        pair.prefill.p.planner = LayerwisePlanner(pool.layout, pool.buffers)  # plans SelectedChunk
        pre, dec = Stamps(pair.prefill_sglang), Stamps(pair.decode_sglang)
        pair.start()
        polls = args.poll
        spinner = Spinner(pair.ctx, polls=polls, hold_us=args.spin_us) if (args.spin or polls) else None
        spin = spinner if spinner is not None else contextlib.nullcontext()
        segments = SEGMENTS + (POLL_SEGMENTS if polls else ())
        samples = {k: [] for k in segments}
        if args.ab:
            samples.update({f"{k} (thread reads)": [] for k in segments})
        decode_waits = (S.BOOTSTRAPPING, S.WAITING_FOR_INPUT, S.TRANSFERRING)
        try:
            with spin:
                rng = np.random.default_rng(0)
                for n in range(args.requests + 5):  # 5 warm-up requests
                    room = 5000 + n
                    aux = room % AUX_SLOTS
                    src, dst = rng.permutation(per), rng.permutation(per)
                    pair.decode_sglang.open(room)
                    attempt = pair.decode.new_receiver(room)
                    pair.prefill_sglang.open(room)
                    if pair.prefill.claim(room):
                        raise RuntimeError(f"room {room} refused")
                    if args.ab:
                        # Every other request our thread reads; both start with no poll for 6 ms,
                        # so the thread is back on the socket (inbox.POLLER_ACTIVE_S) either way.
                        spinner.reads = n % 2 == 0
                        time.sleep(0.006)
                    if polls:
                        spinner.watched = []
                        spinner.watch(("dst", room), pair.prefill, pair.prefill_sglang, room,
                                      (S.WAITING_FOR_INPUT,), (S.BOOTSTRAPPING,))
                        # decode's scheduler polls its receiver from the start (prealloc, then
                        # transfer queue), not only once the transfer is under way
                        spinner.watch(("ok", room), pair.decode, pair.decode_sglang, room, (S.SUCCESS, S.FAILED),
                                      decode_waits)
                        spinner.wait_polled(("dst", room))
                        spinner.wait_polled(("ok", room))
                    t_meta = time.perf_counter()
                    pair.send_to_prefill(pair.encode(pair.decode.record_destination(
                        bootstrap_room=room, required_dst_info_num=1, kv_indices=dst, aux_index=aux,
                        state_indices=None, decode_prefix_len=None, is_dummy=False)))
                    _wait(pair.prefill_sglang, room, (S.WAITING_FOR_INPUT,))
                    if polls:
                        t_dst_seen = spinner.wait_seen(("dst", room))
                    if args.mode == "streamed":
                        pair.prefill.add_chunk(room, src, slice(0, per), False)
                        deadline = time.monotonic() + 30
                        while not _streamed_done(pair, room):  # bench only: the streamed writes ended
                            if time.monotonic() > deadline:
                                raise TimeoutError(f"room {room}: streamed writes never finished")
                            time.sleep(0.0005)
                        # state_indices as SGLang hands them for a model without state: [], not None
                        chunk = selected_chunk(room, src, slice(0, per), True, [], aux_index=aux, state_indices=[])
                        t_last = time.perf_counter()
                        _submit_last(pair, chunk)
                    else:
                        t_last = time.perf_counter()
                        pair.prefill.add_chunk(room, src, slice(0, per), True, aux_index=aux)
                    if args.after_send_us:
                        _busy(args.after_send_us / 1e6)
                    _wait(pair.decode_sglang, room, (S.SUCCESS, S.FAILED))
                    if pair.decode_sglang.status(room) != S.SUCCESS:
                        raise RuntimeError(f"room {room}: {pair.prefill_sglang.failure_reason(room)}")
                    t_pub = pre.at[(room, "published")]
                    t_ps, t_ds = pre.at[(room, S.SUCCESS)], dec.at[(room, S.SUCCESS)]
                    values = [t_pub - t_meta, t_ps - t_last, t_ds - t_ps, t_ds - t_last]
                    if polls:
                        t_ok_seen = spinner.wait_seen(("ok", room))
                        values += [t_dst_seen - t_meta, t_ok_seen - t_ps, t_ok_seen - t_last]
                    if n >= 5:
                        suffix = "" if spinner is None or spinner.reads else " (thread reads)"
                        for key, v in zip(segments, values):
                            samples[key + suffix].append(v * 1e3)
                    pair.prefill.release(room)
                    pair.prefill_sglang.clear(room)
                    pair.decode.forget(room, attempt)
                    pair.decode_sglang.clear(room)
            inboxes = {side: getattr(svc, "inbox", None) for side, svc in (("prefill", pair.prefill),
                                                                             ("decode", pair.decode))}
        finally:
            pair.stop()
    out = {"shape": args.shape, "tokens": args.tokens, "mode": args.mode, "spin": args.spin, "engine": args.engine,
           "requests": args.requests, "after_send_us": args.after_send_us, "poll": polls, "ab": args.ab, "spin_us": args.spin_us,
           "build_has_poll_inbox": hasattr(PrefillService, "poll_inbox")}
    for side, inbox in inboxes.items():  # which thread read the messages (warm-up included)
        if inbox is not None:
            out[f"{side}_read_by_poll"], out[f"{side}_read_by_thread"] = inbox.by_poller, inbox.by_thread
    for key, vals in samples.items():
        vals.sort()
        out[key] = {"p50_ms": round(statistics.median(vals), 3), "p90_ms": round(vals[int(0.9 * (len(vals) - 1))], 3)}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{args.shape} {args.tokens} tokens, {args.mode}, spin={args.spin}, poll={polls}, {args.engine}, "
              f"{args.requests} requests")
        for side in ("prefill", "decode"):
            if f"{side}_read_by_poll" in out:
                print(f"  {side} messages read by the poll / by our thread: {out[f'{side}_read_by_poll']} / "
                      f"{out[f'{side}_read_by_thread']}")
        for key in samples:
            print(f"  {key:55s} p50 {out[key]['p50_ms']:7.3f} ms  p90 {out[key]['p90_ms']:7.3f} ms")
    return 0
