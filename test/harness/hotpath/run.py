"""Drive one PD pair as the two schedulers do and count our Python per request by thread role."""

from __future__ import annotations

import gc
import inspect
import math
import time

import numpy as np

from sglang_mori.backend import room_status as S
from sglang_mori.config import MoriConfig

from harness.hotpath.meter import CallMeter, EngineMeter, ThreadClocks, metered_engine
import contextlib

from harness.hotpath.rig import AUX_SLOTS, SHAPES, PDPair, instant_writes, rig_config
from harness.hotpath.steps import metered_steps

WAIT_S = 120.0
# --decode-polls: a decode scheduler pass polls every room waiting for prefill this often (SGLang
# polls each room of its transfer queue once per loop; a loop is about a decode step).
DECODE_POLL_S = 0.001
DECODE_WAITS = (S.BOOTSTRAPPING, S.WAITING_FOR_INPUT, S.TRANSFERRING)  # manager.DECODE_INBOX_WAITS
# Thread roles of each side (after role(): digits -> N). Everything else in the process is the
# harness (MainThread, whose calls into us are timed one by one) or softio's own threads.
PREFILL_THREADS = ("mori-shard-N", "mori-completion", "mori-control")
DECODE_THREADS = ("mori-decode-status",)
# SGLANG_MORI_DECODE_ARRIVAL_FLAG=process: decode's arrival watcher, a child process of ours (its CPU
# is no thread's of the decode process; reported as its own decode row, and in decode's total)
WATCHER_ROW = "arrival-watcher-process"


def watcher_cpu_ns(inbox) -> int | None:
    """CPU ns of the inbox's watcher child (/proc/PID/schedstat), None without one."""
    watcher = getattr(inbox, "_watcher", None)
    if watcher is None:
        return None
    try:
        with open(f"/proc/{watcher.pid}/schedstat") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


class Driver:
    def __init__(self, pair: PDPair, tokens: int, window: int, seed: int = 0, decode_polls: bool = False):
        self.pair = pair
        self.decode_polls = decode_polls
        self.polls = 0
        self.calls = CallMeter()
        self.per = math.ceil(tokens / pair.shape.page_size)
        self.window = window
        self.rng = np.random.default_rng(seed)
        self.next_room = 1000
        # check_status names the polled room where the build's poll_inbox takes it (one look per
        # pass, issue 28); an older build's (--backend-root) is called as its check_status does.
        # (One wrapper frame either way: the two builds' timed polls carry the same overhead.)
        poll = pair.decode.poll_inbox
        takes_room = "room" in inspect.signature(poll).parameters
        self.poll_inbox = (lambda room: poll(room)) if takes_room else (lambda room: poll())

    def draw_window(self):
        """The next window's rooms, and each request's prefill and decode pages (shuffled, disjoint)."""
        rooms = list(range(self.next_room, self.next_room + self.window))
        self.next_room += self.window
        total = self.per * self.window
        src = self.rng.permutation(total).reshape(self.window, self.per)
        dst = self.rng.permutation(total).reshape(self.window, self.per)
        return rooms, src, dst

    def batch(self) -> None:
        """`window` requests at once, each one chunk (SGLang's last send with every page and aux)."""
        p, c = self.pair, self.calls
        rooms, src, dst = self.draw_window()
        attempts = {}
        for i, room in enumerate(rooms):
            p.decode_sglang.open(room)  # SGLang's receiver init opens the room
            with c.call("decode.init"):
                attempts[room] = p.decode.new_receiver(room)
            with c.call("decode.send_metadata"):
                frames = p.encode(p.decode.record_destination(
                    bootstrap_room=room, required_dst_info_num=1, kv_indices=dst[i], aux_index=room % AUX_SLOTS,
                    state_indices=None, decode_prefix_len=None, is_dummy=False))
            p.send_to_prefill(frames)  # SGLang's bootstrap socket
            p.prefill_sglang.open(room)  # SGLang's sender init
            with c.call("prefill.init"):
                refused = p.prefill.claim(room)
            if refused:
                raise RuntimeError(f"room {room} refused: {refused}")
        # The scheduler polls until decode's metadata made the room WaitingForInput, then sends.
        p.prefill_sglang.wait_all(rooms, (S.WAITING_FOR_INPUT,), WAIT_S)
        for i, room in enumerate(rooms):
            with c.call("prefill.send"):
                p.prefill.add_chunk(room, src[i], slice(0, self.per), True, aux_index=room % AUX_SLOTS)
        if self.decode_polls:
            self.poll_decode(rooms)
        p.prefill_sglang.wait_all(rooms, (S.SUCCESS, S.FAILED), WAIT_S)
        p.decode_sglang.wait_all(rooms, (S.SUCCESS, S.FAILED), WAIT_S)
        failed = [r for r in rooms if p.prefill_sglang.status(r) != S.SUCCESS or p.decode_sglang.status(r) != S.SUCCESS]
        if failed:
            raise RuntimeError(f"rooms failed: {[(r, p.prefill_sglang.failure_reason(r)) for r in failed[:3]]}")
        for room in rooms:
            with c.call("prefill.clear"):
                p.prefill.release(room)
            p.prefill_sglang.clear(room)
            with c.call("decode.clear"):
                p.decode.forget(room, attempts[room])
            p.decode_sglang.clear(room)


    def poll_decode(self, rooms) -> None:
        """Decode's scheduler polls its rooms as MoriKVManager.check_status does (a room still
        waiting for prefill has our socket read first: poll_inbox), one pass per DECODE_POLL_S,
        until every room concluded. Timed: poll_inbox, ours; the status reads are SGLang's."""
        p, c = self.pair, self.calls
        end = time.monotonic() + WAIT_S
        pending = list(rooms)
        while pending:
            still = []
            for room in pending:
                if p.decode_sglang.status(room) in DECODE_WAITS:
                    with c.call("decode.poll"):
                        self.poll_inbox(room)
                    if c.enabled:
                        self.polls += 1
                    if p.decode_sglang.status(room) in DECODE_WAITS:
                        still.append(room)
            pending = still
            if pending:
                if time.monotonic() > end:
                    raise TimeoutError(f"decode rooms not concluded: {pending[:5]}")
                time.sleep(DECODE_POLL_S)


def polled_idle_status_cpu(pair: PDPair, seconds: float = 2.0) -> float:
    """Decode's status thread, us of CPU per second, while the scheduler polls every DECODE_POLL_S
    and no message comes (rooms waiting for prefill's forward): the fixed cost of the thread's
    looks at the socket, each a wake-up that takes the GIL from the scheduler."""
    thread = pair.decode.thread
    start_cpu, start = time.clock_gettime_ns(time.pthread_getcpuclockid(thread.ident)), time.monotonic()
    while time.monotonic() - start < seconds:
        pair.decode.poll_inbox()
        time.sleep(DECODE_POLL_S)
    used = time.clock_gettime_ns(time.pthread_getcpuclockid(thread.ident)) - start_cpu
    return round(used / 1e3 / (time.monotonic() - start), 1)


def _us(ns: float, n: int) -> float:
    return round(ns / n / 1e3, 1)


def report(calls: dict, threads: dict, engine: EngineMeter, requests: int, wall_s: float) -> dict:
    out: dict = {"requests": requests, "wall_s": round(wall_s, 3)}
    for side, roles in (("prefill", PREFILL_THREADS), ("decode", DECODE_THREADS)):
        rows: dict = {}
        for name, ns in sorted(calls.items()):
            if name.startswith(side + "."):
                rows["scheduler." + name.split(".", 1)[1]] = {"ours_us": _us(ns, requests), "engine_us": 0.0}
        if side == "decode" and WATCHER_ROW in threads:
            roles = roles + (WATCHER_ROW,)
        for r in roles:
            eng = engine.ns.get(r, 0)
            rows[r] = {"ours_us": _us(threads.get(r, 0) - eng, requests), "engine_us": _us(eng, requests),
                       "engine_calls": round(engine.calls.get(r, 0) / requests, 1)}
        rows["total"] = {"ours_us": round(sum(v["ours_us"] for v in rows.values()), 1),
                         "engine_us": round(sum(v["engine_us"] for v in rows.values()), 1)}
        out[side] = rows
    known = set(PREFILL_THREADS) | set(DECODE_THREADS) | {"MainThread"}
    out["softio_threads_us"] = _us(sum(v for k, v in threads.items() if k not in known), requests)
    return out


def run_case(shape_key: str, tokens: int, requests: int, window: int, token_bytes: int,
             config: MoriConfig | None = None, engine_mode: str = "softio", steps: bool = False,
             decode_polls: bool = False) -> dict:
    shape = SHAPES[shape_key]
    per = math.ceil(tokens / shape.page_size)
    config = config or rig_config(transfer_shards=1)
    writes = instant_writes() if engine_mode == "instant" else contextlib.nullcontext()
    step_meter = metered_steps() if steps else contextlib.nullcontext()
    with writes, metered_engine() as engine, step_meter as stepped:
        pair = PDPair(shape, per * window, token_bytes, config)
        pair.start()
        try:
            driver = Driver(pair, tokens, window, decode_polls=decode_polls)
            for _ in range(2):  # warm-up: sessions, first plans, caches
                driver.batch()
            gc.collect()
            gc.freeze()  # as the backend does after start-up: no full collections of old objects
            clocks = ThreadClocks()
            batches = max(1, requests // window)
            engine.reset()
            if stepped is not None:
                stepped.enabled = True
            driver.calls.enabled = True
            driver.polls = 0
            inbox = pair.decode.inbox
            read_before = inbox.by_poller + inbox.by_thread
            looks_before = getattr(inbox, "poller_looks", 0)
            watcher0 = watcher_cpu_ns(inbox)
            clocks.start()
            start = time.perf_counter()
            for _ in range(batches):
                driver.batch()
            wall = time.perf_counter() - start
            threads = clocks.since()
            if watcher0 is not None:
                threads[WATCHER_ROW] = watcher_cpu_ns(inbox) - watcher0
            result_mode = getattr(config, "decode_arrival_flag", None)
            result = report(driver.calls.ns, threads, engine, batches * window, wall)
            if result_mode is not None:
                result["decode_arrival_flag"] = result_mode
                if str(result_mode) == "process" and watcher0 is None:
                    raise RuntimeError("SGLANG_MORI_DECODE_ARRIVAL_FLAG=process: no arrival watcher process ran")
            # Prefill's messages decode read per request (2: TransferStarted and Success; 1: the
            # last chunk finished within SGLANG_MORI_ANNOUNCE_GRACE_MS). A message read just after
            # the last batch ended may be missed.
            result["decode_messages_per_request"] = round(
                (inbox.by_poller + inbox.by_thread - read_before) / (batches * window), 2)
            if decode_polls:
                result["decode_polls_per_request"] = round(driver.polls / (batches * window), 1)
                if hasattr(inbox, "poller_looks"):  # the polls that read the socket (builds that count them)
                    result["decode_poll_looks_per_request"] = round(
                        (inbox.poller_looks - looks_before) / (batches * window), 2)
                result["decode_status_polled_idle_us_per_s"] = polled_idle_status_cpu(pair)
                # read after those 2 s: a reader counts a message just after handling it
                result["decode_read_by"] = {"poll": inbox.by_poller, "thread": inbox.by_thread}
            if stepped is not None:
                stepped.enabled = False
                result["steps"] = stepped.report(batches * window)
        finally:
            pair.stop()
            gc.unfreeze()
    result.update(shape=shape_key, tokens=tokens, engine=engine_mode, pages=per, window=window, token_bytes=token_bytes,
                  rejections=pair.rejections, decode_polls=decode_polls)
    return result
