"""Fault injection for softio engines, so the failure paths of the backend can be tested.

From the test process, call the functions below on an engine (a softio `IOEngine`). For engines in
other processes, set SGLANG_MORI_SOFTIO_FAULTS before the engine is created, to a JSON list of
objects naming a function of this module and its keyword arguments, e.g.

    [{"kind": "set_latency", "ms": 20}, {"kind": "stall_lane", "lane": 0}]

kill_engine and kill_peer act at once and so are only available as calls; kill_engine_after
is their deferred form for other processes.

Every fault acts on the engine it is set on, on the traffic that engine initiates (its lanes,
indexed 0..qp_per_transfer-1, as a misbehaving QP or NIC would); `peer=None` means any peer.
To make a target look dead or stuck, set kill_* on the target, or stall_lane on the initiator.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time

logger = logging.getLogger("sglang_mori.softio")

FAULTS_ENV = "SGLANG_MORI_SOFTIO_FAULTS"


class FaultPlan:
    """The faults armed on one engine. `active` is False when nothing is armed (the fast path)."""

    def __init__(self):
        self._cond = threading.Condition()
        self.active = False
        self._stalled: set = set()
        self._fail: dict = {}
        self._sq_full_seconds: float | None = None
        self._sq_full_until: float | None = None
        self.sq_backoff_override_s: float | None = None
        self._partial: list | None = None  # [after_batches, remaining times]
        self.latency_s = 0.0
        self.bandwidth = 0.0  # bytes per second, 0 = unlimited
        self._pace_next = 0.0
        self._kill_after: int | None = None  # frames this engine may still send before dying

    def _refresh(self) -> None:
        self.active = bool(self._stalled or self._fail or self._sq_full_seconds is not None
                           or self._sq_full_until is not None or self._partial
                           or self.latency_s > 0 or self.bandwidth > 0
                           or self._kill_after is not None)
        self._cond.notify_all()

    # ---- arming (under the condition's lock) ---------------------------------------------------
    def stall(self, lane: int, peer: str | None) -> None:
        with self._cond:
            self._stalled.add((peer, lane))
            self._refresh()

    def resume(self, lane: int | None, peer: str | None) -> None:
        with self._cond:
            if lane is None:
                self._stalled.clear()
            else:
                self._stalled.discard((peer, lane))
            self._refresh()

    def fail(self, lane: int, peer: str | None, times: int) -> None:
        with self._cond:
            self._fail[(peer, lane)] = self._fail.get((peer, lane), 0) + times
            self._refresh()

    def sq_full(self, seconds: float, backoff_s: float | None) -> None:
        with self._cond:
            self._sq_full_seconds = seconds
            self._sq_full_until = None
            self.sq_backoff_override_s = backoff_s
            self._refresh()

    def partial(self, after_batches: int, times: int) -> None:
        if after_batches < 1:
            raise ValueError("partial_post: after_batches must be >= 1 (batch 0 is always posted)")
        with self._cond:
            self._partial = [after_batches, times]
            self._refresh()

    def pacing(self, latency_s: float | None = None, bandwidth: float | None = None) -> None:
        with self._cond:
            if latency_s is not None:
                self.latency_s = max(0.0, latency_s)
            if bandwidth is not None:
                self.bandwidth = max(0.0, bandwidth)
            self._refresh()

    def kill_after(self, frames: int) -> None:
        if frames < 1:
            raise ValueError("kill_engine_after: frames must be >= 1")
        with self._cond:
            self._kill_after = frames
            self._refresh()

    def clear(self) -> None:
        with self._cond:
            self._kill_after = None
            self._stalled.clear()
            self._fail.clear()
            self._sq_full_seconds = self._sq_full_until = self.sq_backoff_override_s = None
            self._partial = None
            self.latency_s = 0.0
            self.bandwidth = 0.0
            self._refresh()

    # ---- hooks used by the data path -----------------------------------------------------------
    def wait_while_stalled(self, peer: str, lane: int, cancelled) -> None:
        """Hold a lane's sender while it is stalled (until resumed or the lane is torn down)."""
        with self._cond:
            while ((None, lane) in self._stalled or (peer, lane) in self._stalled) \
                    and not cancelled():
                self._cond.wait(0.2)

    def take_lane_failure(self, peer: str, lane: int) -> bool:
        with self._cond:
            for key in ((peer, lane), (None, lane)):
                left = self._fail.get(key, 0)
                if left > 0:
                    if left == 1:
                        del self._fail[key]
                    else:
                        self._fail[key] = left - 1
                    self._refresh()
                    return True
        return False

    def sq_full_until(self) -> float | None:
        """End of the SQ-full window; the window opens at the first reservation after arming."""
        with self._cond:
            now = time.monotonic()
            if self._sq_full_seconds is not None:
                self._sq_full_until = now + self._sq_full_seconds
                self._sq_full_seconds = None
            until = self._sq_full_until
            if until is not None and until <= now:
                self._sq_full_until = None
                self.sq_backoff_override_s = None
                self._refresh()
                return None
            return until

    def take_partial_post(self) -> int | None:
        """How many post-batches the next multi-batch transfer may post before it is rejected."""
        with self._cond:
            if not self._partial:
                return None
            after, left = self._partial
            self._partial = [after, left - 1] if left > 1 else None
            self._refresh()
            return after

    def kill_budget(self, frames: int) -> int | None:
        """How many of the next `frames` may still leave before kill_engine_after fires.

        None: no kill armed (send everything). A number not above `frames`: send that many,
        then the engine must die; the budget is then spent.
        """
        with self._cond:
            if self._kill_after is None:
                return None
            if self._kill_after > frames:
                self._kill_after -= frames
                return None
            # Spent: 0 stays armed so that every other lane of the dying engine sends nothing.
            allowed, self._kill_after = self._kill_after, 0
            return allowed

    def pace(self, nbytes: int) -> None:
        """Bandwidth cap shared by all lanes of the engine: sleep until this chunk's slot."""
        bandwidth = self.bandwidth
        if bandwidth <= 0:
            return
        with self._cond:
            now = time.monotonic()
            start = max(now, self._pace_next)
            self._pace_next = finish = start + nbytes / bandwidth
        delay = finish - now
        if delay > 0:
            time.sleep(delay)


# ---- public API ------------------------------------------------------------------------------

def _core(engine):
    core = getattr(engine, "_core", engine)
    if not hasattr(core, "faults"):
        raise TypeError("softio.faults works on softio IOEngine objects only")
    return core


def stall_lane(engine, lane: int, peer: str | None = None) -> None:
    """Frames for `lane` stop leaving this engine: transfers using it stay IN_PROGRESS."""
    _core(engine).faults.stall(lane, peer)


def resume_lane(engine, lane: int | None = None, peer: str | None = None) -> None:
    """Undo stall_lane (lane=None resumes every stalled lane)."""
    _core(engine).faults.resume(lane, peer)


def fail_lane(engine, lane: int, peer: str | None = None, times: int = 1) -> None:
    """The next post-batch on `lane` breaks that lane (ERR_RDMA_OP); other lanes keep writing.

    Like a QP in error state, the broken lane is not rebuilt: later transfers to the peer fail.
    """
    _core(engine).faults.fail(lane, peer, times)


def sq_full(engine, seconds: float, backoff_ms: float | None = None) -> None:
    """For `seconds` from the next submit, every SQ reservation blocks.

    A submit blocks up to the backoff (MORI_IO_SQ_BACKOFF_TIMEOUT_US, or `backoff_ms`) and then
    fails ERR_RDMA_OP "SQ full ..."; once the window is over, submits succeed again.
    """
    _core(engine).faults.sq_full(seconds, None if backoff_ms is None else backoff_ms / 1000.0)


def partial_post(engine, after_batches: int = 1, times: int = 1) -> None:
    """The next `times` transfers with more post-batches than `after_batches` post only the
    first `after_batches` and then fail ERR_RDMA_OP; the posted batches still land."""
    _core(engine).faults.partial(after_batches, times)


def set_latency(engine, ms: float) -> None:
    """Delay every post-batch by `ms` before it leaves (pipelined, not serialised)."""
    _core(engine).faults.pacing(latency_s=ms / 1000.0)


def set_bandwidth(engine, bytes_per_s: float) -> None:
    """Cap the bytes per second all lanes of this engine send together (0 = no cap)."""
    _core(engine).faults.pacing(bandwidth=float(bytes_per_s))


def clear(engine) -> None:
    """Disarm every fault (broken connections stay broken)."""
    _core(engine).faults.clear()


def kill_peer(engine, remote_key: str) -> None:
    """Abruptly close (RST) every connection between this engine and `remote_key`, both ways.

    Each side then sees the other as dead: in-flight transfers fail ERR_RDMA_OP, a
    PeerFailureEvent is queued, and there is no reconnect.
    """
    _core(engine).abort_peer(remote_key, "fault injection: kill_peer")


def kill_engine(engine) -> None:
    """Make this engine look dead to everybody: stop listening and RST every connection."""
    _core(engine).abort_all("fault injection: kill_engine")


def kill_engine_after(engine, frames: int) -> None:
    """kill_engine as soon as this engine has sent `frames` data frames (reads or writes).

    Meant for engines in other processes (SGLANG_MORI_SOFTIO_FAULTS): the engine dies in the
    middle of its own traffic, deterministically, without a control channel to the test.
    """
    _core(engine).faults.kill_after(frames)


_ENV_KINDS = {
    "stall_lane": stall_lane,
    "fail_lane": fail_lane,
    "sq_full": sq_full,
    "partial_post": partial_post,
    "set_latency": set_latency,
    "set_bandwidth": set_bandwidth,
    "kill_engine_after": kill_engine_after,
}


def apply_env_faults(core) -> None:
    """Arm the faults listed in SGLANG_MORI_SOFTIO_FAULTS (called at engine creation)."""
    raw = os.environ.get(FAULTS_ENV, "").strip()
    if not raw:
        return
    try:
        items = json.loads(raw)
        if isinstance(items, dict):
            items = [items]
        for item in items:
            item = dict(item)
            kind = item.pop("kind")
            if kind not in _ENV_KINDS:
                raise ValueError(f"unknown fault kind {kind!r} (known: {sorted(_ENV_KINDS)})")
            _ENV_KINDS[kind](core, **item)
    except (ValueError, TypeError, KeyError) as exc:
        raise RuntimeError(f"{FAULTS_ENV} is invalid: {exc}") from None
    logger.warning("softio engine %s: faults armed from %s: %s", core.key, FAULTS_ENV, raw)
