"""`scripts/bench_backend.py soak`: a long run of the full backend over softio with injected faults and
aborts, held to "nothing corrupted, nothing hung, nothing leaked".

One prefill and one decode process (the PD transfer harness: SGLang's real disaggregation classes
driven like the schedulers drive them, byte-exact checks on decode) run N requests with at most
`--concurrency` open at once. While they run:

- `--abort-rate` of the requests are aborted mid-flight, split between prefill (an AbortReq after
  its last chunk), decode mid-transfer (after TransferStarted: a room whose last chunk finishes
  within SGLANG_MORI_ANNOUNCE_GRACE_MS sends none and simply succeeds) and decode while pre-allocating;
- `--fault-rate` of the requests meet an injected fault, half request-level (metadata naming a
  decode page past the pool) and half transport-level (softio `partial_post` armed on prefill's
  engine at even intervals: a transfer fails after part of it was posted, whose bytes still land).

It reports, and fails (exit 1) unless all hold: 0 corrupted bytes (every successful request
byte-exact, no write outside the requests' pages, no change to a failed request's pages after
decode released them); 0 hung requests (each ends Success, or Failed with a reason, on both sides
within HUNG_AFTER_S = 30 s, the default transfer deadline); 0 requests failed without a cause
(neither aborted nor faulted); manager tables empty at the end; the RSS of the prefill and
decode processes grown by less than `--max-rss-growth-mb` from start-up (before the first request)
to the end; and their open file descriptors (sockets) by at most FD_SLACK from the end of the
first tenth of the requests (lazily opened sockets are in place by then) to the end.

Two settings differ from the defaults, both so that one injected fault stays one request's fault:
SGLANG_MORI_PEER_FAIL_FAST_S=0 (a failed transfer would otherwise fail every request to the same,
healthy, decode peer for 5 s) and SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT=5 (a
failed request whose writes cannot be proven drained holds its decode pages this long, not 30 s).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

QUICK_REQUESTS = 300
# A request still unresolved this long after it opened counts as hung even if a far-off SGLang
# timeout (bootstrap, waiting: 300 s by default) ends it later: our transfer deadline's default.
HUNG_AFTER_S = 30.0
FD_SLACK = 4  # open file descriptors a process may gain after the warm-up
DEFAULTS = dict(requests=10_000, concurrency=64, fault_rate=0.01, abort_rate=0.05)
# Failure reasons by cause (what the backend and SGLang put in failure_exception()).
ABORT_WORDS = ("abort",)
FAULT_WORDS = ("partial_post", "out of range")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=DEFAULTS["requests"], help="requests in the run (default 10000)")
    p.add_argument("--quick", action="store_true", help=f"a short run: {QUICK_REQUESTS} requests")
    p.add_argument("--concurrency", type=int, default=DEFAULTS["concurrency"], help="requests open at once (64)")
    p.add_argument("--fault-rate", type=float, default=DEFAULTS["fault_rate"], help="share with an injected fault")
    p.add_argument("--abort-rate", type=float, default=DEFAULTS["abort_rate"], help="share aborted mid-flight")
    p.add_argument("--max-rss-growth-mb", type=float, default=50.0, help="allowed RSS growth per process")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--json", action="store_true", help="print the figures as JSON")


def plan_injections(n: int, fault_rate: float, abort_rate: float, seed: int) -> dict:
    """Which requests get which abort or request-level fault, and how many transport faults."""
    rng = random.Random(seed)
    order = list(range(n))
    rng.shuffle(order)
    aborts = round(n * abort_rate)
    faults = round(n * fault_rate)
    bad_pages = faults // 2
    take = iter(order)
    pick = lambda k: tuple(sorted(next(take) for _ in range(k)))  # noqa: E731
    prefill_abort = pick(aborts * 2 // 5)
    decode_abort_inflight = pick(aborts * 2 // 5)
    decode_abort = pick(aborts - len(prefill_abort) - len(decode_abort_inflight))
    return {
        "prefill_abort": prefill_abort,
        "decode_abort_inflight": decode_abort_inflight,
        "decode_abort": decode_abort,
        "bad_decode_pages": pick(bad_pages),
        "transport_faults": faults - bad_pages,
    }


def build_config(n: int, concurrency: int, inj: dict):
    from harness.pd.run import HarnessConfig, KVLayout, RoomShape

    return HarnessConfig(
        rooms=n,
        max_inflight=concurrency,
        layout=KVLayout(num_layers=2, total_kv_heads=4, head_dim=32, page_size=16, state_item_bytes=(64,)),
        shape=RoomShape(min_tokens=16, max_tokens=160, chunks=2),
        prefill_abort=inj["prefill_abort"],
        decode_abort=inj["decode_abort"],
        decode_abort_inflight=inj["decode_abort_inflight"],
        bad_decode_pages=inj["bad_decode_pages"],
        control=True,
        startup_timeout_s=180.0,
        transfer_timeout_s=max(300.0, n / 10.0),
        sglang_timeout_s=60.0,
        env={
            # One injected transport fault must fail its own request only: no fail-fast window
            # for the other requests to the same (healthy) decode peer.
            "SGLANG_MORI_PEER_FAIL_FAST_S": "0",
            # A failed request whose writes cannot be proven drained is held this long on decode.
            "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT": "5",
        },
    )


class _Driver:
    """The orchestrator side while the run goes: RSS at the start, transport faults spread over
    the run, RSS and leftover tables at the end."""

    def __init__(self, n: int, transport_faults: int):
        self.n, self.transport_faults = n, transport_faults
        self.rss_before, self.rss_after, self.leftovers = {}, {}, {}
        self.fds_before, self.fds_warm, self.fds_after = {}, {}, {}
        self.armed = 0
        self.error = None

    def on_ready(self, info) -> None:
        from harness.pd.control import rss_bytes

        self.rss_before = {n: rss_bytes(info.pids[n]) for n in ("prefill0", "decode0")}
        self.fds_before = {n: open_fds(info.pids[n]) for n in ("prefill0", "decode0")}

    def during(self, info) -> None:
        from harness.pd.control import controls, rss_bytes, wait_clean

        ctl = controls(info)
        # Sockets opened lazily (peer lanes, one PUSH socket per sending thread and peer) are in
        # place once the first tenth of the requests is done; from there on the count must hold.
        if info.wait_progress("decode0", "done", max(1, self.n // 10), max(120.0, self.n / 20)):
            self.fds_warm = {n: open_fds(info.pids[n]) for n in ("prefill0", "decode0")}
        step = max(1, self.n // (self.transport_faults + 1))
        for k in range(1, self.transport_faults + 1):
            if not info.wait_progress("prefill0", "done", k * step, max(120.0, self.n / 20)):
                break
            ctl["prefill0"].fault("partial_post", after_batches=1, times=1)
            self.armed += 1
        for name in ("prefill0", "decode0"):
            info.wait_progress(name, "done", self.n, max(300.0, self.n / 10))
        self.leftovers = wait_clean(ctl, 60.0)
        self.rss_after = {n: rss_bytes(info.pids[n]) for n in ("prefill0", "decode0")}
        self.fds_after = {n: open_fds(info.pids[n]) for n in ("prefill0", "decode0")}
        for c in ctl.values():
            c.close()


def open_fds(pid: int) -> int:
    """Open file descriptors of a process (sockets included)."""
    import os

    return len(os.listdir(f"/proc/{pid}/fd"))


def classify(failure: str, index: int, inj: dict) -> str:
    text = (failure or "").lower()
    if index in inj["prefill_abort"] + inj["decode_abort"] + inj["decode_abort_inflight"] or any(
        w in text for w in ABORT_WORDS
    ):
        return "aborted"
    if index in inj["bad_decode_pages"] or any(w in text for w in FAULT_WORDS):
        return "faulted"
    return "unexpected"


def soak(n: int, concurrency: int = 64, fault_rate: float = 0.01, abort_rate: float = 0.05,
         seed: int = 7, max_rss_growth_mb: float = 50.0) -> dict:
    """Run the soak; the figures (and `ok`)."""
    from harness.pd.run import run_transfer
    from harness.pd.results import FAILED, SUCCESS

    inj = plan_injections(n, fault_rate, abort_rate, seed)
    cfg = build_config(n, concurrency, inj)
    driver = _Driver(n, inj["transport_faults"])
    t0 = time.monotonic()
    result = run_transfer(cfg, on_ready=driver.on_ready, during=driver.during)
    wall = time.monotonic() - t0
    figures = {
        "requests": n,
        "concurrency": concurrency,
        "error": result.error,
        "wall_s": round(result.wall_s, 1),
        "session_s": round(wall, 1),
    }
    statuses = {}
    causes = {"aborted": 0, "faulted": 0, "unexpected": 0}
    unexpected = []
    for rep in result.ranks:
        for o in rep.rooms:
            statuses.setdefault(rep.side, {})[o.index] = o
    pre, dec = statuses.get("prefill", {}), statuses.get("decode", {})

    def settled(o) -> bool:
        return o is not None and (o.status == SUCCESS or (o.status == FAILED and bool(o.failure)))

    # Hung: a request that did not end Success or Failed-with-a-reason on both sides, or only
    # after HUNG_AFTER_S (then a far-off SGLang timeout, not the backend, ended it).
    slowest = max((o.latency or 0.0 for side in statuses.values() for o in side.values()), default=0.0)
    hung = sum(
        1
        for i in range(n)
        if not (settled(pre.get(i)) and settled(dec.get(i)))
        or max(pre[i].latency or 0.0, dec[i].latency or 0.0) > HUNG_AFTER_S
    )
    ok_both = sum(1 for i in range(n) if i in pre and i in dec and pre[i].status == SUCCESS and dec[i].status == SUCCESS)
    for i in range(n):
        o = dec.get(i) or pre.get(i)
        if o is None:
            continue
        if o.status == FAILED or (pre.get(i) is not None and pre[i].status == FAILED):
            failure = (dec.get(i).failure if dec.get(i) and dec[i].failure else "") + " " + (
                pre[i].failure if pre.get(i) and pre[i].failure else "")
            cause = classify(failure, i, inj)
            causes[cause] += 1
            if cause == "unexpected" and len(unexpected) < 5:
                unexpected.append(f"#{i}: {failure.strip()[:200]}")
    decode = result.side("decode")
    corrupted = sum(r.mismatch_count for r in decode) + sum(len(r.late_writes) for r in decode)
    mb = 1024 * 1024
    growth = {k: (driver.rss_after.get(k, 0) - v) / mb for k, v in driver.rss_before.items()}
    figures.update(
        {
            "succeeded": ok_both,
            "failed_aborted": causes["aborted"],
            "failed_faulted": causes["faulted"],
            "failed_unexpected": causes["unexpected"],
            "unexpected_examples": unexpected,
            "aborts_injected": len(inj["prefill_abort"]) + len(inj["decode_abort"]) + len(inj["decode_abort_inflight"]),
            "faults_injected": len(inj["bad_decode_pages"]) + driver.armed,
            "hung": hung,
            "slowest_request_s": round(slowest, 2),
            "checked_bytes": sum(r.checked_bytes for r in decode),
            "corrupted": corrupted,
            "verified": bool(decode) and all(r.verified and r.rechecked for r in decode),
            "leftovers": {k: {t: v for t, v in tables.items() if v} for k, tables in driver.leftovers.items()},
            "rss_before_mb": {k: round(v / mb, 1) for k, v in driver.rss_before.items()},
            "rss_after_mb": {k: round(v / mb, 1) for k, v in driver.rss_after.items()},
            "rss_growth_mb": {k: round(v, 1) for k, v in growth.items()},
            "fds_before": driver.fds_before,
            "fds_warm": driver.fds_warm,
            "fds_after": driver.fds_after,
            "requests_per_s": round(n / result.wall_s, 1) if result.wall_s else 0.0,
        }
    )
    figures["ok"] = (
        result.error is None
        and figures["verified"]
        and corrupted == 0
        and hung == 0
        and causes["unexpected"] == 0
        and ok_both + sum(causes.values()) == n
        and bool(driver.leftovers)
        and not any(figures["leftovers"].values())
        and len(growth) == 2
        and all(v < max_rss_growth_mb for v in growth.values())
        # sockets: none may pile up after the warm-up (a tenth of the requests)
        and len(driver.fds_after) == 2
        and len(driver.fds_warm) == 2
        and all(driver.fds_after[k] - driver.fds_warm[k] <= FD_SLACK for k in driver.fds_after)
    )
    return figures


def format_figures(f: dict) -> str:
    rss = ", ".join(
        f"{k} {f['rss_before_mb'].get(k, '?')} -> {f['rss_after_mb'].get(k, '?')} MB (+{f['rss_growth_mb'].get(k, '?')})"
        for k in ("prefill0", "decode0")
    )
    lines = [
        f"soak: {f['requests']} requests, concurrency {f['concurrency']}, {f['wall_s']} s "
        f"({f['requests_per_s']} req/s), session {f['session_s']} s",
        f"  succeeded            {f['succeeded']}",
        f"  failed (aborted)     {f['failed_aborted']}   (aborts injected {f['aborts_injected']})",
        f"  failed (faulted)     {f['failed_faulted']}   (faults injected {f['faults_injected']})",
        f"  failed (unexpected)  {f['failed_unexpected']}",
        f"  hung                 {f['hung']}   (slowest request {f['slowest_request_s']} s)",
        f"  corrupted            {f['corrupted']}   (checked {f['checked_bytes']} bytes)",
        f"  leftovers            {f['leftovers'] or 'none'}",
        f"  RSS                  {rss}",
        f"  open fds             " + ", ".join(
            f"{k} {f['fds_before'].get(k, '?')} (start) {f['fds_warm'].get(k, '?')} (after 10 %) "
            f"-> {f['fds_after'].get(k, '?')}" for k in ("prefill0", "decode0")),
        f"  result               {'PASS' if f['ok'] else 'FAIL'}" + (f"  error={f['error']}" if f["error"] else ""),
    ]
    lines += [f"    {u}" for u in f["unexpected_examples"]]
    return "\n".join(lines)


def run(args) -> int:
    n = QUICK_REQUESTS if args.quick else args.requests
    if n < 1 or args.concurrency < 1:
        print("--requests and --concurrency must be >= 1", file=sys.stderr)
        return 2
    figures = soak(n, args.concurrency, args.fault_rate, args.abort_rate, args.seed, args.max_rss_growth_mb)
    print(json.dumps(figures, indent=2) if args.json else format_figures(figures))
    return 0 if figures["ok"] else 1

