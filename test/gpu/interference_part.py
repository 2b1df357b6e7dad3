"""scripts/gpu_bench.py --parts interference: what background chunk-wise transfers cost a 512-token
launch-bound MLA forward (prefill) and a decode step loop (decode), attributed in one run.

Window kinds, each `--seconds` of forwards back to back (decode: `--decode-steps` steps):
  alone          nothing in the background
  ours           this project's services send requests at the rate (in-process, or through the
                 transfer process with --transfer-process)
  copies         the same requests' device copies at the same rate from a spawned process that runs
                 none of our Python (copy_load.py: its own CUDA context, as the transfer process)
  copies_thread  the same from a thread of the forward's process (the forward's CUDA context)
`ours - copies` is then what our Python and hand-offs add; `copies` what the copies (SM and memory
traffic, context switching) cost by themselves. Every round runs each kind once, in an order
rotated by round (window_order), so drift over minutes falls on every kind alike; the figures are
medians over all rounds' samples, and each round's own ratio is kept to show the spread.

Decode windows (session 19) are counted by owner: the decode process gets one command per window
while its steps run (`steps_run`, answered when they end), the same in every kind; ours opens its
rooms' decode side before the window and clears it after, in one command each (OpenedRooms), so
the rig's pipe work and FakeSGLang never share the step loop's GIL. Our calls (receiver init,
metadata and its encode, clear: the scheduler thread's in SGLang; the step loop's inbox poll) are
timed by thread CPU inside them (decode_calls.py), and each kind's slowdown is also given as the
median of the rounds' own ratios with a ~95 % interval (`paired`), over --decode-rounds rounds.
"""

from __future__ import annotations

import math
import statistics
import time

from decode_calls import merge, meter_us_per_call, us_per_request

LEAD_S = 0.1  # a decode window's load runs this long before the steps start (transfers in flight)
COPY_KINDS = {"process": "copies", "thread": "copies_thread"}


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def window_order(kinds, round_index: int) -> list:
    """The kinds of round `round_index`: the list rotated by the round, so each kind takes each
    place in turn."""
    k = round_index % len(kinds)
    return list(kinds[k:]) + list(kinds[:k])


def per_request(cpu_s: dict, requests: int, top: int = 10) -> dict:
    """{role: ms per request}, the largest `top` roles first."""
    return {k: round(v * 1e3 / max(requests, 1), 3) for k, v in sorted(cpu_s.items(), key=lambda kv: -kv[1])[:top]}


class Windows:
    """Per window kind, over all rounds: the samples (ms), each round's median, the requests sent
    and the CPU seconds of this process's threads by role."""

    def __init__(self, kinds):
        self.kinds = list(kinds)
        self.samples = {k: [] for k in self.kinds}
        self.by_round = {k: [] for k in self.kinds}
        self.sent = {k: 0 for k in self.kinds}
        self.cpu = {k: {} for k in self.kinds}

    def add(self, kind: str, samples, sent: int = 0, cpu: dict | None = None) -> None:
        self.samples[kind] += list(samples)
        self.by_round[kind].append(median(samples))
        self.sent[kind] += sent
        for role, seconds in (cpu or {}).items():
            self.cpu[kind][role] = self.cpu[kind].get(role, 0.0) + seconds

    def medians(self) -> dict:
        return {k: median(v) for k, v in self.samples.items()}

    def slowdown_pct(self, base: str = "alone") -> dict:
        m = self.medians()
        return {k: 100.0 * (m[k] / m[base] - 1.0) for k in self.kinds if k != base}

    def slowdown_pct_by_round(self, base: str = "alone") -> dict:
        """Each round's median against the same round's `base`: the spread behind the medians."""
        return {k: [round(100.0 * (x / b - 1.0), 2) for x, b in zip(self.by_round[k], self.by_round[base])]
                for k in self.kinds if k != base}

    def extra_cpu_ms_per_request(self, kind: str, base: str = "alone", top: int = 10) -> dict:
        """What `kind`'s windows cost this process's threads beyond `base`'s windows (the same
        seconds in all), per request of `kind`: the main thread's share of the forward cancels out."""
        roles = set(self.cpu[kind]) | set(self.cpu[base])
        extra = {r: self.cpu[kind].get(r, 0.0) - self.cpu[base].get(r, 0.0) for r in roles}
        return per_request(extra, self.sent[kind], top)


class SideCalls:
    """CPU seconds (thread_time) of the calls the scheduler's thread makes into the prefill side:
    open (the sender's claim), send_all (SGLang's send), poll (its statuses, once per loop; the
    transfer process only) and release, each wrapped on the side object. Of the forward's process, these are what
    the main thread runs per request; its CPU by role cannot say it, since the thread spins in the
    forward's synchronize whenever it is not running them."""

    NAMES = ("open", "send_all", "poll", "release")

    def __init__(self, side):
        self.names = [n for n in self.NAMES if callable(getattr(side, n, None))]
        self.seconds = dict.fromkeys(self.names, 0.0)
        self._depth = 0  # a send_all from inside a poll is counted once, in the poll
        for name in self.names:
            setattr(side, name, self._timed(name, getattr(side, name)))
        # The stand-in's waits (drain at a window's end) keep polling the untimed poll: they are the
        # harness waiting, not scheduler loops; SGLang polls each room once per loop (send_due).

    def _timed(self, name: str, call):
        def timed(*args, **kwargs):
            self._depth += 1
            start = time.thread_time()
            try:
                return call(*args, **kwargs)
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self.seconds[name] += time.thread_time() - start
        return timed

    def reset(self) -> None:
        self.seconds = dict.fromkeys(self.names, 0.0)

    def us_per_request(self, requests: int) -> dict:
        out = {k: round(v * 1e6 / max(requests, 1), 1) for k, v in self.seconds.items()}
        out["total"] = round(sum(self.seconds.values()) * 1e6 / max(requests, 1), 1)
        return out


class OpenedRooms:
    """Rooms whose decode side (receivers, their metadata) was opened in one command before a decode
    window, so that no command reaches the decode process while its steps run: the window's sends
    claim them in order (prefill's side of the open), and all of them are cleared on decode in one
    command after the window. `short` counts sends that were due but found no room left (the
    pool is sized for three times the window's expected length: a window with any sent less than its
    rate; they are not sent later, the schedule goes on)."""

    def __init__(self, rig, bg, count: int):
        self.rooms = rig.next_rooms(count)
        self.rows = [k % bg.count for k in range(count)]
        self.frames = rig.open_decode(bg, self.rooms, self.rows) if count else []
        self.used = 0
        self.short = 0

    def take(self, n: int) -> list:
        """Up to `n` (room, row, frames) not used yet."""
        k = min(n, len(self.rooms) - self.used)
        out = [(self.rooms[i], self.rows[i], self.frames[i]) for i in range(self.used, self.used + k)]
        self.used += k
        self.short += n - k
        return out


def rooms_for(rate: float, steps: int, step_ms: float) -> int:
    """Rooms to open before a decode window of `steps` steps (and the loop's warm steps) of about
    `step_ms`: what the rate sends over three times that, the lead included, and a few more."""
    from decode_process import WARM_STEPS

    return int(math.ceil(rate * (LEAD_S + 3.0 * (steps + WARM_STEPS) * step_ms / 1e3))) + 8


def send_due(rig, bg, rate: float, start: float, sent: int, live: list, opened: OpenedRooms | None = None) -> int:
    """Open and send the background requests due by now at `rate`; release the concluded ones.
    With `opened`, the rooms come from it (decode's side opened already) and decode's side is not
    cleared here (OpenedRooms: after the window). Returns the new count due so far (sent, and
    with `opened` any sends that found no room: opened.short)."""
    from copy_load import due

    poll = getattr(rig.prefill, "poll", None)  # a transfer process's statuses come by polls
    if poll is not None:
        poll()
    n = due(time.perf_counter() - start, rate, sent)
    if n > 0:
        if opened is None:
            rooms = rig.next_rooms(n)
            rows = [k % bg.count for k in range(len(rooms))]
            rig.open_rooms(bg, rooms, rows)
        else:
            taken = opened.take(n)
            rooms, rows = [t[0] for t in taken], [t[1] for t in taken]
            for room, row, frames in taken:
                rig.claim(bg, room, row, frames)
        for room, row in zip(rooms, rows):
            rig.prefill.send_all(room, bg.src[row])
        live += rooms
        sent += n  # the schedule: with `opened`, sends that found no room are in opened.short
    done = [r for r in live if r in rig.prefill.sglang.concluded_at]
    if done:
        for r in done:
            rig.prefill.release(r)
        if opened is None:
            rig.ask("clear", done)
        gone = set(done)
        live[:] = [r for r in live if r not in gone]
    return sent


def drain(rig, live: list, clear: bool = True) -> None:
    if live:
        rig.prefill.sglang.wait_concluded(live, 60)
        for r in live:
            rig.prefill.release(r)
        if clear:
            rig.ask("clear", live)
        live.clear()


class Part:
    """One load (rate x tokens) on one rig: its forward and decode windows of every kind."""

    def __init__(self, rig, bg, rate: float, x, slots, copy_loads: dict):
        self.rig, self.bg, self.rate, self.x, self.slots = rig, bg, rate, x, slots
        self.copy_loads = copy_loads  # kind -> CopyLoad / CopyLoadProcess

    def forwards(self, seconds: float, kind: str, builtin=None):
        """Forwards back to back for `seconds` beside `kind`'s load: (times in ms, requests sent)."""
        import rig_device

        rig, model = self.rig, self.rig.model
        copies = self.copy_loads.get(kind)
        if copies is not None:
            copies.start(self.rate)
        times, sent, live = [], 0, []
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            if builtin is not None:
                sent = builtin.due(self.rate, start, sent)
            elif kind == "ours":
                sent = send_due(rig, self.bg, self.rate, start, sent, live)
            t0 = time.perf_counter()
            model.forward(self.x, rig.prefill.pool, self.slots, hooked=False)
            rig_device.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
        if builtin is not None:
            builtin.drain()
        drain(rig, live)
        if copies is not None:
            sent = copies.stop()
        return times, sent

    def decode_window(self, steps: int, kind: str, step_ms: float) -> dict:
        """The decode process's step loop (`steps` steps) beside `kind`'s load, the load started
        LEAD_S before the steps and kept up until they end. Every kind sends the decode process
        the same single command while its steps run (`steps_run`, answered when they end), so
        the rig's work there is equal across kinds; ours opens its rooms' decode side before the
        window and clears them after it (OpenedRooms), timed as our calls but outside the steps.
        Returns the step times (ms), the requests sent, the decode process's CPU by thread role
        over the steps, our calls' CPU ({name: (s, calls)}, decode_calls.py), prefill's messages
        read over the steps by the step loop's polls and by our status thread, and the sends that
        found no room."""
        rig = self.rig
        opened = OpenedRooms(rig, self.bg, rooms_for(self.rate, steps, step_ms)) if kind == "ours" else None
        copies = self.copy_loads.get(kind)
        if copies is not None:
            copies.start(self.rate)
        live, sent, started = [], 0, False
        start = time.perf_counter()
        while True:
            if opened is not None:
                sent = send_due(rig, self.bg, self.rate, start, sent, live, opened)
            if not started:
                if time.perf_counter() - start >= LEAD_S:
                    rig.conn.send(("steps_run", steps))
                    started = True
                else:
                    time.sleep(0.002)
            elif rig.conn.poll(0.002):  # the answer comes when the steps end (a wait, not a command)
                break
            elif time.perf_counter() - start > 150:
                raise TimeoutError(f"decode steps did not end in 150 s (alive: {rig.proc.is_alive()})")
        times, cpu, read = rig._recv()
        drain(rig, live, clear=opened is None)
        if copies is not None:
            sent = copies.stop()
        if opened is not None:
            rig.ask("clear", opened.rooms)  # every room opened, sent or not
            sent -= opened.short
        return {"times": times, "sent": sent, "cpu": cpu, "calls": rig.ask("calls"), "read": read,
                "short": 0 if opened is None else opened.short}


def paired(by_round: list) -> tuple:
    """The median of the rounds' own ratios (%) and the half-width of its ~95 % interval (the
    boxplot notch: 1.58 IQR / sqrt(n)); drift between rounds falls out of each round's ratio."""
    if not by_round:
        return float("nan"), float("nan")
    xs = sorted(by_round)
    if len(xs) < 4:
        return statistics.median(xs), float("nan")
    q = statistics.quantiles(xs, n=4)
    return statistics.median(xs), 1.58 * (q[2] - q[0]) / math.sqrt(len(xs))


def measure(part: Part, kinds: list, args) -> dict:
    """Every round: each kind's forward window, then (after all rounds) each kind's decode window,
    both in rotated order. The forward's process CPU is metered per window."""
    from engine_meter import metered_engine
    from thread_roles import ThreadCpu

    rig = part.rig
    fwd, dec = Windows(kinds), Windows(kinds)
    part.forwards(1.0, "alone")  # warm-up: kernels, allocator
    for kind in kinds[1:]:
        part.forwards(1.0, kind)  # warm-up of each load: sessions, plans, the copy kernel
    rig.ask("cpu_reset")
    rig.ask("calls")  # our decode calls from here on (the warm-ups' dropped)
    calls = SideCalls(rig.prefill)
    with metered_engine() as engine_meter:
        for r in range(args.rounds):
            for kind in window_order(kinds, r):
                meter = ThreadCpu()
                times, sent = part.forwards(args.seconds, kind)
                fwd.add(kind, times, sent, meter.since())
        engine_cpu = engine_meter.since_reset()
    calls_us = calls.us_per_request(fwd.sent["ours"])  # only the ours windows call the side
    decode_cpu = rig.ask("cpu")
    fwd_decode_calls = rig.ask("calls")  # our decode calls of the measured forward windows
    # warm-up decode windows, alone then ours, which also size the rooms ours opens before each
    # window (for steps as long as ours' warm-up's; updated after every ours window)
    step_ms = median(part.decode_window(min(args.decode_steps, 100), "alone", 0.0)["times"])
    warm = part.decode_window(min(args.decode_steps, 100), "ours", step_ms)
    step_ms = max(step_ms, statistics.fmean(warm["times"]))
    dec_calls = {k: {} for k in kinds}
    short = 0
    decode_rounds = getattr(args, "decode_rounds", 0) or args.rounds
    for r in range(decode_rounds):
        for kind in window_order(kinds, r):
            w = part.decode_window(args.decode_steps, kind, step_ms)
            dec.add(kind, w["times"], w["sent"], w["cpu"])
            merge(dec_calls[kind], w["calls"])
            merge(dec_calls[kind], {f"read_{k}": (0.0, v) for k, v in w["read"].items()})
            short += w["short"]
            if kind == "ours":  # the next ours window's rooms: for steps as long as this one's
                step_ms = max(step_ms, statistics.fmean(w["times"]))
    sent = fwd.sent["ours"]
    ours_cpu = fwd.cpu["ours"]
    m, d = fwd.medians(), dec.medians()
    return {
        "kinds": kinds, "rounds": args.rounds, "seconds": args.seconds,
        "forward_ms": {"alone": m["alone"], "loaded": m["ours"]},
        "slowdown_pct": fwd.slowdown_pct()["ours"],
        "forward_ms_by_kind": m, "slowdown_pct_by_kind": fwd.slowdown_pct(),
        "slowdown_pct_by_round": fwd.slowdown_pct_by_round(), "requests_sent_by_kind": fwd.sent,
        "requests_sent": sent,
        "prefill_cpu_ms_per_request": per_request(ours_cpu, sent),
        # Of each role's CPU above, the part spent inside softio's IOEngine calls (on MORI-IO
        # those are C++ that release the GIL); the rest is ours.
        "prefill_engine_call_cpu_ms_per_request": per_request(engine_cpu, sent),
        "prefill_ours_cpu_ms_per_request": {k: round((v - engine_cpu.get(k, 0.0)) * 1e3 / max(sent, 1), 3)
                                            for k, v in ours_cpu.items() if k.startswith("mori-")},
        # The scheduler thread's calls into the prefill side (claim, send, polls, release; with the
        # transfer process: all that is left of ours on the forward's thread), us per request
        "scheduler_calls_cpu_us_per_request": calls_us,
        # Every thread of the forward's process, each kind's windows less the alone windows, per
        # request (MainThread's is no measure of our calls: it spins in the forward's synchronize)
        "forward_process_extra_cpu_ms_per_request": {k: fwd.extra_cpu_ms_per_request(k) for k in kinds[1:]},
        "decode_cpu_ms_per_request": per_request(decode_cpu, sent, 8),
        "decode_step_ms": {"alone": d["alone"], "loaded": d["ours"]},
        "decode_slowdown_pct": dec.slowdown_pct()["ours"],
        "decode_step_ms_by_kind": d, "decode_slowdown_pct_by_kind": dec.slowdown_pct(),
        "decode_slowdown_pct_by_round": dec.slowdown_pct_by_round(),
        "decode_requests_sent": dec.sent["ours"], "decode_requests_sent_by_kind": dec.sent,
        **decode_owners(dec, dec_calls, kinds, args.decode_steps, fwd_decode_calls, fwd.sent["ours"]),
        "decode_rooms_short": short, "decode_rounds": decode_rounds,
    }


WATCHER_ROLE = "arrival-watcher (child process)"  # decode_process.py's name for the child's CPU


def _extra_us(dec: Windows, role: str, sent: int) -> float:
    return round((dec.cpu["ours"].get(role, 0.0) - dec.cpu["alone"].get(role, 0.0)) * 1e6 / max(sent, 1), 1)


def decode_owners(dec: Windows, dec_calls: dict, kinds: list, steps: int,
                  fwd_calls: dict, fwd_sent: int) -> dict:
    """The decode side by owner: our calls' CPU (decode_calls.py) per request, the step loop's
    poll per step in each kind and ours beyond alone per request, every thread's CPU over the
    steps beyond alone's, and each kind's slowdown as the median of the rounds' own ratios."""
    sent = max(dec.sent["ours"], 1)
    ours = {n: v for n, v in dec_calls["ours"].items() if not n.startswith("read_")}
    read = {n[5:]: v[1] for n, v in dec_calls["ours"].items() if n.startswith("read_")}
    polls = {k: dec_calls[k].get("poll_inbox", (0.0, 0)) for k in kinds}  # (s, calls): warm steps too
    poll_s = {k: v[0] for k, v in polls.items()}
    by_round = dec.slowdown_pct_by_round()
    pairs = {k: paired(v) for k, v in by_round.items()}
    return {
        # The scheduler thread's calls of ours (new_receiver, record_destination, the metadata's
        # encode, forget) and the step loop's polls, in the ours windows, us per request
        "decode_calls_us_per_request": us_per_request(ours, sent),
        "decode_scheduler_calls_us_per_request": us_per_request(
            {n: v for n, v in ours.items() if n != "poll_inbox"}, sent),
        # the same calls in the forward windows (no step loop polls there: the status thread reads)
        "decode_calls_us_per_request_fwd_windows": us_per_request(fwd_calls, fwd_sent),
        # prefill's messages (TransferStarted, RoomStatus) per request, by who read them
        "decode_messages_per_request": {k: round(v / sent, 2) for k, v in read.items()},
        "decode_poll_us_per_step": {k: round(s * 1e6 / max(n, 1), 2) for k, (s, n) in polls.items()},
        # what the per-call meter adds to each of those polls (decode_calls.py; the flag's empty
        # look costs less than it): read poll_inbox's per-step and per-request figures net of it
        "decode_poll_meter_us_per_call": meter_us_per_call(),
        # (every kind's windows run the same number of steps, so alone's polls are the baseline)
        "decode_poll_extra_us_per_request": round((poll_s["ours"] - poll_s["alone"]) * 1e6 / sent, 1),
        "decode_window_extra_cpu_ms_per_request": {k: dec.extra_cpu_ms_per_request(k) for k in kinds[1:]},
        "decode_window_cpu_ms_per_request": per_request(dec.cpu["ours"], sent, 8),
        # The two readers beside the step loop, ours beyond alone's windows, us per request: the
        # status thread, and SGLANG_MORI_DECODE_ARRIVAL_FLAG=process's watcher child (a process of
        # its own: not the decode process's CPU, but ours; absent without one)
        "decode_status_thread_extra_us_per_request": _extra_us(dec, "mori-decode-status", sent),
        "decode_watcher_extra_us_per_request": (_extra_us(dec, WATCHER_ROLE, sent)
                                                if WATCHER_ROLE in dec.cpu["ours"] else None),
        "decode_slowdown_pct_paired": {k: round(v[0], 2) for k, v in pairs.items()},
        "decode_slowdown_ci95_pct": {k: round(v[1], 2) for k, v in pairs.items()},
        "decode_steps": steps,
    }


def builtin_point(part: Part, bg, seconds: float, base_ms: float) -> dict:
    from builtin_load import BuiltinPatternLoad
    from thread_roles import ThreadCpu

    load = BuiltinPatternLoad(part.rig, bg)
    try:
        part.forwards(1.0, "builtin", load)  # warm-up of its pattern
        meter = ThreadCpu()
        loaded, sent = part.forwards(seconds, "builtin", load)
        cpu = meter.since()
    finally:
        load.close()
    return {"forward_ms": median(loaded), "requests_sent": sent, "failures": load.failures,
            "slowdown_pct": 100.0 * (median(loaded) / base_ms - 1.0),
            "prefill_cpu_ms_per_request": per_request(cpu, sent, 6)}


def _top(d: dict, n: int = 3) -> str:
    return "{" + ", ".join(f"{k} {v}" for k, v in list(d.items())[:n]) + "}"


def summary_line(p: dict) -> str:
    """One compact line per point (a device call's output tail is short; the JSON has the rest):
    each kind's slowdown against alone, with each round's in parentheses, then the CPU figures."""
    def kinds(total: dict, rounds: dict) -> str:
        return " ".join(f"{k} {v:+.1f}% ({'/'.join(f'{x:+.1f}' for x in rounds[k])})" for k, v in total.items())

    extra = " ".join(f"{k} {_top(v)}" for k, v in p["forward_process_extra_cpu_ms_per_request"].items())
    line = (f"interference {p['rate_per_s']}/s x {p['bg_tokens']}{' [transfer process]' if p['transfer_process'] else ''}"
            f" {p['device_copy']}: fwd alone {p['forward_ms']['alone']:.3f} ms, "
            f"{kinds(p['slowdown_pct_by_kind'], p['slowdown_pct_by_round'])} | decode alone "
            f"{p['decode_step_ms']['alone']:.3f} ms, {kinds(p['decode_slowdown_pct_by_kind'], p['decode_slowdown_pct_by_round'])}"
            f" | sent {p['requests_sent_by_kind']} | scheduler calls {p['scheduler_calls_cpu_us_per_request']['total']} us/req"
            f" | fwd-process extra ms/req {extra} | decode ms/req (fwd windows) {_top(p['decode_cpu_ms_per_request'])}")
    if "decode_calls_us_per_request" in p:
        c = p["decode_calls_us_per_request"]
        paired_k = " ".join(f"{k} {v:+.1f}±{p['decode_slowdown_ci95_pct'][k]:.1f}%"
                            for k, v in p["decode_slowdown_pct_paired"].items())
        dextra = " ".join(f"{k} {_top(v)}" for k, v in p["decode_window_extra_cpu_ms_per_request"].items())
        line += (f" | decode paired {paired_k} | decode ours calls {c['total']} us/req {_top(c, 5)}"
                 f", poll beyond alone {p['decode_poll_extra_us_per_request']} us/req"
                 f", poll/step {p['decode_poll_us_per_step']} (meter {p.get('decode_poll_meter_us_per_call')} us/call)"
                 f", messages/req {p['decode_messages_per_request']}"
                 f", status thread +{p.get('decode_status_thread_extra_us_per_request')} us/req"
                 f", watcher child +{p.get('decode_watcher_extra_us_per_request')} us/req"
                 f" | decode-window extra ms/req {dextra}")
        if p.get("decode_rooms_short"):
            line += f" | decode sends short {p['decode_rooms_short']}"
    if "transfer_process_cpu_ms_per_request" in p:
        line += f" | transfer process {p['transfer_process_cpu_ms_per_request']} ms/req"
    return line


def run_interference(args, results: list) -> None:
    import os

    import numpy as np
    import torch

    import rig_device
    from copy_load import CopyLoad, CopyLoadProcess
    from pd_rig import PATHS, GpuPD, Requests

    copies = [c for c in args.copies.split(",") if c and c != "off"]
    unknown = [c for c in copies if c not in COPY_KINDS]
    if unknown:
        raise SystemExit(f"--copies: unknown {unknown} (process, thread or off)")
    kinds = ["alone", "ours"] + [COPY_KINDS[c] for c in copies]
    page = 64
    for spec in args.loads.split(","):
        rate, bg_tokens = (int(x) for x in spec.split("x"))
        fwd = Requests(page, args.fwd_tokens, 1, 0, np.random.default_rng(1))
        bg = Requests(page, bg_tokens, 16, fwd.pages, np.random.default_rng(2))
        pages = fwd.pages + bg.pages
        # decode on its own GPU (--decode-device 1) as in a deployment: the decode step loop then
        # shares no GPU with the prefill's forward, its transfer process or the copies-only load
        # (time-sliced contexts on one GPU spread the decode rounds by tens of percent, every kind alike)
        with GpuPD("mla", page, pages, decode_device=args.decode_device) as rig:
            loads = {}
            try:
                load_spec = dict(shape_key="mla", page_size=page, pages=pages, src_pages=bg.src, dst_pages=bg.dst)
                for c in copies:
                    loads[COPY_KINDS[c]] = CopyLoadProcess(PATHS, **load_spec) if c == "process" else CopyLoad(**load_spec)
                slots = torch.as_tensor(fwd.row(0), device=rig_device.DEVICE)
                part = Part(rig, bg, rate, rig.model.inputs(args.fwd_tokens, 0), slots, loads)
                point = {"shape": rig.shape.name, "rate_per_s": rate, "bg_tokens": bg_tokens,
                         "fwd_tokens": args.fwd_tokens, "transfer_process": bool(rig.config.transfer_process),
                         "device_copy": os.environ.get("SGLANG_MORI_SOFTIO_DEVICE_COPY", "kernel")}
                point.update(measure(part, kinds, args))
                child_cpu_s = getattr(rig.prefill, "child_cpu_s", None)
                if child_cpu_s is not None:  # the transfer process's CPU since it started, warm-ups included
                    total = point["requests_sent"] + point["decode_requests_sent"]
                    point["transfer_process_cpu_ms_per_request"] = round(child_cpu_s() * 1e3 / max(total, 1), 3)
                if args.builtin:
                    point["builtin_pattern"] = builtin_point(part, bg, args.seconds, point["forward_ms"]["alone"])
            finally:
                for load in loads.values():
                    load.close()
            results.append(point)
            args.save()
            print(summary_line(point), flush=True)
            if "builtin_pattern" in point:
                b = point["builtin_pattern"]
                print(f"  built-in pattern, same load: fwd loaded {b['forward_ms']:.2f} ms ({b['slowdown_pct']:+.1f}%), "
                      f"{b['requests_sent']} requests, {b['failures']} failed; CPU/request {b['prefill_cpu_ms_per_request']}",
                      flush=True)
