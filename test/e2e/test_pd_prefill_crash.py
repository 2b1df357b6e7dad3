"""A prefill server that dies mid-transfer: decode fails the affected requests fast and recovers.

What it needs: a backend that reports a lost peer instead of waiting forever. With `mori` (ours)
the bound is SGLANG_MORI_TRANSFER_TIMEOUT_MS plus SGLang's heartbeat
(SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL x _MAX_FAILURE); the conftest sets both small. SGLang's
heartbeat is backend-independent, so the test also runs (and was validated) on mooncake_tcp.

Requests "in flight" are made deterministic: some go to the decode server only, with the live
prefill's bootstrap address and a room that prefill never gets a request for. Decode bootstraps,
hands prefill its page list and then waits for KV that cannot come; it is exactly the state of a
transfer cut off by a crash. More requests go through the router at the same time, at whatever
stage they happen to be. Then SIGKILL the prefill's process group.
"""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from harness import client
from harness.deployment import http_ok
from harness.failure_env import failure_deadline_s
from harness.procs import wait_until

pytestmark = pytest.mark.e2e

# A failed room must surface within this many seconds of the crash (about 20 s with the settings of
# failure_env); "not minutes": SGLang's defaults would take up to 300 s (its waiting timeout).
FAIL_DEADLINE_S = failure_deadline_s()
STUCK_ON_DECODE = 4
THROUGH_ROUTER = 6


def _timed(fn, *args, **kwargs):
    result = fn(*args, **kwargs)
    return result, time.monotonic()


def _decode_waiting_for_kv(url: str) -> int:
    load = client.get_json(f"{url}/v1/loads?include=disagg")["loads"][0]
    disagg = load.get("disaggregation") or {}
    return disagg.get("decode_prealloc_queue_reqs", 0) + disagg.get("decode_transfer_queue_reqs", 0)


@pytest.mark.restarts_prefill
def test_prefill_crash_fails_in_flight_requests_and_decode_recovers(standalone, pd):
    decode_pid = pd.procs["decode"].pid
    assert client.generate(pd.router_url, "before the crash", 8).ok

    rng = random.Random(4242)
    bootstrap = {"bootstrap_host": "127.0.0.1", "bootstrap_port": pd.bootstrap_port}
    long_prompt = "The lane writes every page of the layer into the decode buffer. " * 10
    with ThreadPoolExecutor(max_workers=STUCK_ON_DECODE + THROUGH_ROUTER) as pool:
        stuck = [
            pool.submit(_timed, client.generate, pd.decode_url, f"stuck {i}: " + long_prompt, 16,
                        timeout_s=FAIL_DEADLINE_S + 120,
                        extra={**bootstrap, "bootstrap_room": rng.getrandbits(62)})
            for i in range(STUCK_ON_DECODE)
        ]
        # Decode holds them, waiting for KV, before anything is killed.
        wait_until(lambda: _decode_waiting_for_kv(pd.decode_url) >= STUCK_ON_DECODE, 60,
                   "decode waits for KV of the stuck requests")
        routed = [
            pool.submit(_timed, client.generate, pd.router_url, f"routed {i}: " + long_prompt, 400,
                        timeout_s=FAIL_DEADLINE_S + 120, ignore_eos=True)
            for i in range(THROUGH_ROUTER)
        ]
        killed_at = time.monotonic()
        pd.kill_prefill()
        stuck_results = [f.result() for f in stuck]
        routed_results = [f.result() for f in routed]

    for gen, done_at in stuck_results:
        assert not gen.ok, "a request whose KV can never arrive reported success"
        assert done_at - killed_at <= FAIL_DEADLINE_S, (
            f"decode failed the request {done_at - killed_at:.1f} s after the crash "
            f"(deadline {FAIL_DEADLINE_S:.0f} s): {gen.error[:300]}")
    for gen, done_at in routed_results:
        # Each either finished (it was already decoding) or failed; none may hang.
        assert done_at - killed_at <= FAIL_DEADLINE_S + 30, f"routed request hung: {gen.status}"
    slowest = max(done - killed_at for _, done in stuck_results)
    print(f"\nstuck requests failed within {slowest:.1f} s of the crash; routed outcomes: "
          f"{[r.status for r, _ in routed_results]}")

    # Decode survives: same process, a real generation on its health endpoint, nothing left queued.
    assert pd.procs["decode"].alive() and pd.procs["decode"].pid == decode_pid
    assert http_ok(f"{pd.decode_url}/health_generate", timeout_s=30)
    wait_until(lambda: client.requests_in_server(pd.decode_url) == 0, 60, "decode drains failed rooms")

    # A new prefill on the same ports; the router and decode pick it up without a restart.
    startup_s = pd.restart_prefill()
    print(f"new prefill up in {startup_s:.0f} s")
    routed_s = wait_until(lambda: client.generate(pd.router_url, "after the crash", 8, timeout_s=30).ok, 120,
                          "router serves through the new prefill")
    print(f"router serves through it {routed_s:.0f} s later")
    prompts = [f"recovered {i}: " + long_prompt[: 30 * (i + 1)] for i in range(4)]
    ours = client.generate_many(pd.router_url, prompts, 16, concurrency=4)
    refs = client.generate_many(standalone.url, prompts, 16, concurrency=4)
    assert all(r.ok for r in ours), [(r.status, r.error[:200]) for r in ours]
    assert [r.output_ids for r in ours] == [r.output_ids for r in refs]
    assert pd.procs["decode"].pid == decode_pid
