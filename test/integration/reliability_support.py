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

import os
import re
import signal
import time
from typing import Dict, Iterable, List, Tuple

from integration_support import config

from harness.pd.run import HarnessResult, KVLayout, RoomShape, decode_worker_name, run_transfer
from harness.pd.control import (
    WorkerControl,
    controls,
    late_writes_by_log,
    wait_clean,
    wait_until,
)
from harness.pd.plan import build_plan
from harness.pd.results import FAILED, SUCCESS

TIMEOUT_MS = 2000  # SGLANG_MORI_TRANSFER_TIMEOUT_MS of every reliability session
SLACK_S = 8.0  # scheduling noise on a loaded 2-core host
CLEAN_TIMEOUT_S = 30.0
TRANSFERRING = 3  # KVPoll.Transferring

BASE_ENV = {
    "SGLANG_MORI_TRANSFER_TIMEOUT_MS": str(TIMEOUT_MS),
    "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "2",
    "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "2",
}


def reliability_config(**kw):
    env = {**BASE_ENV, **kw.pop("env", {})}
    decode_env = {"SGLANG_MORI_SOFTIO_RECORD_WRITES": "1", **kw.pop("decode_env", {})}
    return config(control=True, env=env, decode_env=decode_env, **kw)


def two_decode_config(rounds, **env):
    """One prefill, two decode servers (room i goes to decode server i % 2), the rooms in `rounds`;
    the transfer deadline is long, so peer failures must be detected by the engine's report (or
    SGLang's heartbeat), not by the deadline. `env`: more settings for every worker."""
    return reliability_config(
        rooms=sum(rounds),
        rounds=rounds,
        decode_instances=2,
        layout=KVLayout(num_layers=2, total_kv_heads=4, head_dim=32, page_size=16),
        shape=RoomShape(min_tokens=32, max_tokens=128, chunks=2),
        env={"SGLANG_MORI_TRANSFER_TIMEOUT_MS": "30000", **env},
    )


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
        self.firsts: Dict[str, int] = {}  # restarted decode workers: first plan index they serve

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
        m = re.search(r"\.i(\d+)", name)
        j = int(m.group(1)) if m else 0
        n = self.cfg.decode_instances
        return sum(1 for i in range(self.firsts.get(name, 0), self.ends[k]) if i % n == j)

    def wait_done(self, k: int, timeout_s: float, sides: Iterable[str] = ("prefill", "decode"), skip=()) -> None:
        """Every room up to round k finished (decode: released) on every worker of `sides`."""
        for name in self.ctl:
            side = "prefill" if name.startswith("prefill") else "decode"
            if side in sides and name not in skip:
                ok = self.info.wait_progress(name, "done", self.expected(name, k), timeout_s)
                assert ok, f"round {k}: {name} progress {self.info.progress.get(name)} after {timeout_s} s"

    def restart_decode(self, victim: str, k: int, same_ports: bool = True) -> str:
        """Start a new decode process in place of the dead worker `victim` (see
        ReadyInfo.restart_decode); it serves the victim's rooms from round k on. Returns its name,
        with its control connection in self.ctl."""
        first = self.ends[k - 1] if k else 0
        name = self.info.restart_decode(victim, first, same_ports=same_ports)
        self.firsts[name] = first
        self.ctl[name] = WorkerControl(self.info.pids[name])
        return name

    def transferring(self, indices):
        """A predicate: every room of `indices` is Transferring on prefill0."""
        ids = [self.plan.rooms[i].room for i in indices]
        p = self.ctl["prefill0"]
        return lambda: all(p.room_states()["status"].get(r) == TRANSFERRING for r in ids)

    def kill_decode_mid_transfer(self, victim: str, k: int, indices, mark: str = "decode_killed") -> str:
        """Hold prefill0's lanes to decode worker `victim`, open round k, wait until the rooms of
        `indices` (the victim's) are on the wire, then SIGKILL the victim (moment `mark`).
        Returns the victim's engine key. The caller clears the fault."""
        key = self.ctl[victim].engine_key()
        for lane in range(4):
            self.ctl["prefill0"].fault("stall_lane", lane=lane, peer=key)
        self.open(k)
        wait_until(self.transferring(indices), 20, f"{victim}'s rooms transferring")
        self.mark(mark)
        os.kill(self.info.pids[victim], signal.SIGKILL)
        del self.ctl[victim]
        return key

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


def run_session(cfg, steps) -> Tuple[HarnessResult, Session]:
    """Run one harness session whose `during` hook is `steps(session)` (see Session.run); the
    result and the session, once the session collected the leftovers."""
    box: dict = {}

    def during(info) -> None:
        box["session"] = Session(info, cfg)
        box["session"].run(steps)

    result = run_transfer(cfg, during=during)
    session = box.get("session")
    assert session is not None and session.leftovers, result.summary()
    return result, session


def check_end(result: HarnessResult, session: Session, cfg, lost: Iterable[str] = ()) -> None:
    """The end-of-run contract; `lost`: workers the test killed (they never report)."""
    summary = result.summary()
    lost = sorted(lost)
    assert sorted(result.lost_workers) == lost, summary
    assert result.error == (f"workers died before reporting: {', '.join(result.lost_workers)}" if lost else None), summary
    for rep in result.ranks:
        for o in rep.rooms:
            assert o.status in (SUCCESS, FAILED), f"{rep.side}{rep.rank} room#{o.index}: {o.status_name}\n{summary}"
            if o.status == FAILED:
                assert o.failure, f"{rep.side}{rep.rank} room#{o.index} failed without a reason"
    assert result.byte_exact(), summary
    assert all(r.rechecked for r in result.side("decode")), summary
    for rep in result.side("decode"):
        records = session.write_logs.get(rep.worker or decode_worker_name(rep.rank, rep.instance))
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


_ROOM_PREFIX = re.compile(r"^KVTransferError: KVTransferError\(bootstrap_room=\d+\): ")


def rooms_report(pre: Dict[int, object], dec: Dict[int, object], indices: Iterable[int], width: int = 150) -> str:
    """One line per room: both sides' status, decode's release, prefill's reason (cut to `width`).
    Put first in an assertion message, so that a CI log cut after a few lines still says how
    each room of the round ended and why."""
    lines = []
    for i in indices:
        p, d = pre[i], dec[i]
        reason = _ROOM_PREFIX.sub("", p.failure or d.failure or "")[:width]
        when = "" if d.t_released is None else f"@{d.t_released:.2f}s"
        release = f" release={d.release}{when}" if d.release else ""
        lines.append(f"  room#{i} prefill={p.status_name} decode={d.status_name}{release}"
                     + (f": {reason}" if reason else ""))
    return "\n".join(lines)
