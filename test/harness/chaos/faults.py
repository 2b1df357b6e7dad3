"""The faults of the chaos run, one per run, each injected while transfers are in flight.

A fault's `inject` blocks for the fault's length and returns when the fault is over: the link is
up again, the stalled process continued, or the restarted process answers its readiness check
(so a restart's fault window includes its start-up). The recovery clock starts there.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

from harness.chaos.deployment import NetnsPD
from harness.chaos.hosts import Topology


@dataclass
class FaultContext:
    dep: NetnsPD
    topo: Topology
    deadline_s: float  # the transfer deadline the servers run with
    startup_timeout_s: float = 300.0


@dataclass(frozen=True)
class Fault:
    name: str
    label: str  # the table's row heading
    inject: Callable[[FaultContext], None]
    restarts: Optional[str] = None  # the role the fault restarts, if any

    @property
    def recovery_goal_s(self) -> float:
        """Goal for 'serving again' after the fault's end (issue 20): 10 s, or 30 s for a
        restarted process, whose start-up counts."""
        return 30.0 if self.restarts else 10.0


def _held(apply: Callable[[FaultContext], None], undo: Callable[[FaultContext], None],
          seconds: Callable[[FaultContext], float]):
    """A fault that is applied, held for its length, then undone (also if the hold is interrupted)."""
    def inject(ctx: FaultContext) -> None:
        length_s = seconds(ctx)
        apply(ctx)
        try:
            time.sleep(length_s)  # the fault's length: it stays in place this long
        finally:
            undo(ctx)
    return inject


def _link_down(seconds: Optional[float] = None):
    """The P-D link down for `seconds`, or for 1.5 x the transfer deadline."""
    return _held(lambda ctx: ctx.topo.cut(), lambda ctx: ctx.topo.restore(),
                 lambda ctx: seconds if seconds is not None else 1.5 * ctx.deadline_s)


def _throttle(rate: str, seconds: float):
    return _held(lambda ctx: ctx.topo.throttle(rate), lambda ctx: ctx.topo.unthrottle(), lambda ctx: seconds)


def _stall(role: str, seconds: float):
    return _held(lambda ctx: ctx.dep.stall(role), lambda ctx: ctx.dep.resume(role), lambda ctx: seconds)


def _restart(role: str):
    def inject(ctx: FaultContext) -> None:
        ctx.dep.kill(role)
        ctx.dep.start_role(role)
        ctx.dep.wait_role(role, ctx.startup_timeout_s)
    return inject


def _no_fault(ctx: FaultContext) -> None:
    """The baseline row: the same load and checks with nothing injected."""


FAULTS = (
    Fault("none", "no fault (baseline)", _no_fault),
    Fault("link_1s", "P-D link down 1 s", _link_down(1.0)),
    Fault("link_10s", "P-D link down 10 s", _link_down(10.0)),
    Fault("link_long", "P-D link down 1.5 x deadline", _link_down(None)),
    Fault("throttle_20s", "P-D link 1 Mbit/s for 20 s", _throttle("1mbit", 20.0)),
    Fault("prefill_stop_10s", "prefill SIGSTOP 10 s", _stall("prefill", 10.0)),
    Fault("prefill_restart", "prefill killed + restarted", _restart("prefill"), restarts="prefill"),
    Fault("decode_restart", "decode killed + restarted", _restart("decode"), restarts="decode"),
    Fault("router_restart", "router killed + restarted", _restart("router"), restarts="router"),
)
BY_NAME = {f.name: f for f in FAULTS}
