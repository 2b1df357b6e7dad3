"""What the reliability tests (test_reliability_*.py) share: a config with small deadlines and the
control channel on, a driver for gated rounds, and the end-of-run contract.

A reliability session is one harness run split into rounds (HarnessConfig.rounds). The test's
`during` hook arms a softio fault in a worker through the control socket, opens a round, waits for
its rooms to reach a state, clears the fault, and so on; at the end it waits until every manager
table is empty and collects decode's softio write log. After run_transfer returns, `check_end`
holds the run to what every case must show:

- every room ended Success or Failed on both sides (nothing hung), every failure has a reason;
- every successful room is byte-exact, and nothing was written outside the rooms' pages;
- no write landed in a room's pages after decode released them (write log vs release time, and
  the harness's snapshot re-check);
- no room, status, tracker entry or in-flight count is left in any manager;
- every worker still answers.
"""

from __future__ import annotations

import time
from typing import Dict, Iterable, List

from integration_support import config

from sglang_mori.testing.pd_harness import HarnessResult, decode_worker_name
from sglang_mori.testing.pd_harness_control import controls, late_writes_by_log, wait_clean, wait_until
from sglang_mori.testing.pd_harness_plan import build_plan
from sglang_mori.testing.pd_harness_results import FAILED, SUCCESS

TIMEOUT_MS = 2000  # SGLANG_MORI_TRANSFER_TIMEOUT_MS of every reliability session
SLACK_S = 8.0  # scheduling noise on a loaded 2-core host
CLEAN_TIMEOUT_S = 30.0

BASE_ENV = {
    "SGLANG_MORI_TRANSFER_TIMEOUT_MS": str(TIMEOUT_MS),
    "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "2",
    "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "2",
}


def reliability_config(**kw):
    env = {**BASE_ENV, **kw.pop("env", {})}
    decode_env = {"SGLANG_MORI_SOFTIO_RECORD_WRITES": "1", **kw.pop("decode_env", {})}
    return config(control=True, env=env, decode_env=decode_env, **kw)


class Session:
    """The test's handle on a running session (built inside the `during` hook)."""

    def __init__(self, info, cfg):
        self.info, self.cfg = info, cfg
        self.ctl = controls(info)
        self.plan = build_plan(cfg)
        self.ends: List[int] = []
        pos = 0
        for size in cfg.rounds or (cfg.rooms,):
            pos += size
            self.ends.append(pos)
        self.leftovers: Dict[str, Dict[str, int]] = {}
        self.write_logs: Dict[str, list] = {}
        self.marks: Dict[str, float] = {}  # named moments, relative to t0

    # --- rounds ---------------------------------------------------------------------------
    def indices(self, k: int) -> range:
        return range(self.ends[k - 1] if k else 0, self.ends[k])

    def room_ids(self, k: int) -> List[int]:
        return [self.plan.rooms[i].room for i in self.indices(k)]

    def open(self, k: int) -> None:
        for c in self.ctl.values():
            c.open_round(k)

    def expected(self, name: str, k: int) -> int:
        """Rooms of rounds 0..k that worker `name` runs (decode instance j: rooms i % n == j)."""
        if name.startswith("prefill"):
            return self.ends[k]
        j = int(name.split(".i")[1]) if ".i" in name else 0
        n = self.cfg.decode_instances
        return sum(1 for i in range(self.ends[k]) if i % n == j)

    def wait_done(self, k: int, timeout_s: float, sides: Iterable[str] = ("prefill", "decode"), skip=()) -> None:
        """Every room up to round k finished (decode: released) on every worker of `sides`."""
        for name in self.ctl:
            side = "prefill" if name.startswith("prefill") else "decode"
            if side in sides and name not in skip:
                ok = self.info.wait_progress(name, "done", self.expected(name, k), timeout_s)
                assert ok, f"round {k}: {name} progress {self.info.progress.get(name)} after {timeout_s} s"

    def mark(self, name: str) -> None:
        self.marks[name] = time.monotonic() - self.info.t0

    # --- worker state ---------------------------------------------------------------------
    def decode_rooms(self, name: str = "decode0") -> dict:
        return self.ctl[name].room_states()

    def wait_decode(self, predicate, timeout_s: float, what: str, name: str = "decode0"):
        return wait_until(lambda: predicate(self.decode_rooms(name)), timeout_s, what)

    def fault(self, worker: str, kind: str, **kwargs) -> None:
        self.ctl[worker].fault(kind, **kwargs)

    def run(self, body) -> None:
        """Run the test's steps; if one raises, clear the faults and open every round so the
        workers finish their rooms and the run ends now rather than at its deadline."""
        try:
            body(self)
        except BaseException:
            for name, c in self.ctl.items():
                try:
                    c.fault("clear")
                    c.call("fault", "resume_lane")
                except Exception:
                    pass
            for k in range(len(self.ends)):
                try:
                    self.open(k)
                except Exception:
                    pass
            raise

    def finish(self) -> None:
        """At the end of the hook: wait for empty tables, then collect the write logs."""
        self.leftovers = wait_clean(self.ctl, CLEAN_TIMEOUT_S)
        for name, c in self.ctl.items():
            if name.startswith("decode"):
                self.write_logs[name] = c.write_log()


def check_end(result: HarnessResult, session: Session, cfg) -> None:
    summary = result.summary()
    assert result.error is None, summary
    for rep in result.ranks:
        for o in rep.rooms:
            assert o.status in (SUCCESS, FAILED), f"{rep.side}{rep.rank} room#{o.index}: {o.status_name}\n{summary}"
            if o.status == FAILED:
                assert o.failure, f"{rep.side}{rep.rank} room#{o.index} failed without a reason"
    assert result.byte_exact(), summary
    assert all(r.rechecked for r in result.side("decode")), summary
    for rep in result.side("decode"):
        records = session.write_logs.get(decode_worker_name(rep.rank, rep.instance))
        assert records is not None, "no write log collected"
        late = late_writes_by_log(records, session.plan, rep.rooms, result.ready.t0, cfg.layout.page_size)
        assert not late, "writes after release:\n" + "\n".join(late[:10])
    for name, tables in session.leftovers.items():
        assert not any(tables.values()), f"{name} left behind {tables}"
    assert session.leftovers, "leftovers were never collected"
    assert result.alive_at_end and all(result.alive_at_end.values()), result.alive_at_end


def outcomes(result: HarnessResult, side: str, rank: int = 0) -> Dict[int, object]:
    (rep,) = [r for r in result.side(side) if r.rank == rank]
    return {o.index: o for o in rep.rooms}
