"""What harness workers report back, and the summary the caller gets.

Plain dataclasses without SGLang imports, so a test or benchmark process can read results without
loading SGLang. Times are `time.monotonic()` seconds relative to the moment the orchestrator said
"go" (CLOCK_MONOTONIC is shared by all processes on one host).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

# KVPoll values (sglang.srt.disaggregation.base.conn.KVPoll) plus the harness's own "no terminal
# state before the deadline".
FAILED, BOOTSTRAPPING, WAITING_FOR_INPUT, TRANSFERRING, SUCCESS = 0, 1, 2, 3, 4
TIMED_OUT = -1
STATUS_NAMES = {
    FAILED: "Failed",
    BOOTSTRAPPING: "Bootstrapping",
    WAITING_FOR_INPUT: "WaitingForInput",
    TRANSFERRING: "Transferring",
    SUCCESS: "Success",
    TIMED_OUT: "TimedOut",
}


@dataclass
class RoomOutcome:
    index: int  # position in the plan
    room: int  # bootstrap_room
    status: int  # final KVPoll value, or TIMED_OUT
    failure: Optional[str] = None  # failure_exception() text, or why the harness gave up
    last_poll: Optional[int] = None  # last poll value seen (useful on TIMED_OUT)
    t_open: Optional[float] = None  # sender/receiver constructed
    t_ready: Optional[float] = None  # poll() first returned WaitingForInput
    t_sent: Optional[float] = None  # prefill: last send() call; decode: send_metadata()
    t_done: Optional[float] = None  # terminal status observed
    transfer_bytes: Optional[int] = None  # prefill: get_transfer_metric().transfer_total_bytes
    # Decode, failed rooms: how the held pages were released ("acked": every prefill rank that
    # could still write confirmed it drained; "unarmed": nothing to wait for; "timeout": SGLang's
    # release timeout) and when.
    release: Optional[str] = None
    t_released: Optional[float] = None
    # Prefill: the harness called abort() on this room (cfg.prefill_abort) before it concluded.
    aborted: bool = False

    @property
    def latency(self) -> Optional[float]:
        if self.t_open is None or self.t_done is None:
            return None
        return self.t_done - self.t_open

    @property
    def status_name(self) -> str:
        return STATUS_NAMES.get(self.status, str(self.status))


@dataclass
class RankReport:
    side: str  # "prefill" or "decode"
    rank: int
    pid: int
    instance: int = 0  # decode instance (cfg.decode_instances)
    dp_rank: int = 0  # attention-DP rank (cfg.prefill_dp / decode_dp)
    pp_rank: int = 0  # prefill PP stage (cfg.prefill_pp)
    worker: str = ""  # the orchestrator's name for the worker ("decode0.i1", "decode0.i1.r1", ...)
    rooms: List[RoomOutcome] = field(default_factory=list)
    error: Optional[str] = None  # traceback if the worker itself crashed
    # Decode only: byte checks.
    verified: bool = False
    checked_bytes: int = 0
    mismatch_count: int = 0
    mismatches: List[str] = field(default_factory=list)  # the first few, human readable
    # Decode: failed rooms whose pages changed after they were released (filled in by a re-check
    # once every prefill rank has reported): plan index -> what changed.
    late_writes: Dict[int, str] = field(default_factory=dict)
    rechecked: bool = False
    t_last_done: Optional[float] = None
    # CPU seconds this process (every thread: the scheduler loop stand-in and the backend's) used
    # from "go" to its last room's end; benchmarks divide it by the requests.
    cpu_s: Optional[float] = None
    # The same CPU by thread role (thread_cpu.role), when cfg.thread_cpu asks for it.
    thread_cpu: Optional[Dict[str, float]] = None
    # Prefill (mori backends on softio): the path its writes took to decode ("intra-host", "tcp").
    engine_path: Optional[str] = None
    # Decode with cfg.record_statuses: plan index -> [(prefill_rank, KVPoll status, carried aux)]
    # for every RoomStatus message the rank handled, in arrival order.
    statuses: Dict[int, List[tuple]] = field(default_factory=dict)
    # Ours: the manager's debug_snapshot() once every room of the rank finished (entries each
    # per-room table still holds; SGLang's request_status is empty once every room was cleared).
    tables: Optional[Dict[str, int]] = None
    # Ours on softio: this rank's engine key, the decode engines it opened sessions to (prefill) and
    # the prefill engines connected to it (decode), at the end of its rooms (engine_contacts.py).
    engine_contacts: Optional[dict] = None


@dataclass
class ReadyInfo:
    """Where everything listens once all workers are up (handed to test hooks)."""

    bootstrap_addr: str
    prefill_endpoints: List[tuple]  # (ip, zmq rank_port) per prefill TP rank
    decode_endpoints: List[tuple]
    pids: Dict[str, int]  # "bootstrap", "prefill0", "decode1", ...
    # Per decode rank: the frames it sends a prefill rank to register (None if the backend has no
    # such message), so fuzz tests can replay a genuine message.
    decode_registrations: List[Optional[List[bytes]]] = field(default_factory=list)
    manager_classes: Dict[str, str] = field(default_factory=dict)
    # Per worker: whether it forked with SGLang already imported (the forkserver's preload).
    preloaded: Dict[str, bool] = field(default_factory=dict)
    # Latest room counts per worker name ({"open", "ready", "sent", "done"}), kept current by the
    # orchestrator while the rooms run; read it from a `during` hook.
    progress: Dict[str, Dict[str, int]] = field(default_factory=dict)
    t0: Optional[float] = None  # time.monotonic() of "go"; room times are relative to it
    # Set by run_transfer for `during` hooks: restart_decode(victim, first_index, same_ports=True)
    # starts a new decode process in place of the dead worker `victim` (same TP rank and decode
    # instance; with same_ports, bound to the victim's ZMQ rank port and engine port), waits until
    # it is up, says "go" to it and returns its worker name (also added to `pids`). It serves the
    # victim's rooms from plan index `first_index` on, and reports like any decode worker.
    restart_decode: Optional[Callable[..., str]] = None

    def wait_progress(self, worker: str, key: str, at_least: int, timeout_s: float) -> bool:
        """Poll until progress[worker][key] >= at_least; False if the deadline passes first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.progress.get(worker, {}).get(key, 0) >= at_least:
                return True
            time.sleep(0.01)
        return False


@dataclass
class HarnessResult:
    ranks: List[RankReport]
    ready: Optional[ReadyInfo] = None
    error: Optional[str] = None  # orchestrator-level failure (start-up, deadline, lost worker)
    wall_s: float = 0.0  # from "go" to the last report
    alive_at_end: Dict[str, bool] = field(default_factory=dict)  # worker answered a final ping
    phase_s: Dict[str, float] = field(default_factory=dict)  # start-up milestones, from launch
    lost_workers: List[str] = field(default_factory=list)  # died before sending their report

    def side(self, side: str) -> List[RankReport]:
        return [r for r in self.ranks if r.side == side]

    def statuses(self, side: str) -> Dict[int, List[int]]:
        """plan index -> final status on every rank of that side."""
        out: Dict[int, List[int]] = {}
        for rep in self.side(side):
            for o in rep.rooms:
                out.setdefault(o.index, []).append(o.status)
        return out

    def succeeded(self, side: str) -> List[int]:
        return sorted(i for i, s in self.statuses(side).items() if all(x == SUCCESS for x in s))

    def all_succeeded(self, num_rooms: int) -> bool:
        full = list(range(num_rooms))
        return (
            self.error is None
            and all(r.error is None for r in self.ranks)
            and self.succeeded("prefill") == full
            and self.succeeded("decode") == full
        )

    def byte_exact(self) -> bool:
        """Decode checked its bytes, found no mismatch, and no released room changed later."""
        dec = self.side("decode")
        return bool(dec) and all(r.verified and r.mismatch_count == 0 and not r.late_writes for r in dec)

    def failures(self) -> List[str]:
        out = []
        for rep in self.ranks:
            for o in rep.rooms:
                if o.status != SUCCESS:
                    where = rep.worker or f"{rep.side}{rep.rank}{f'.i{rep.instance}' if rep.instance else ''}"
                    out.append(f"{where} room#{o.index}: {o.status_name}: {o.failure}")
        return out

    def latencies(self, side: str) -> List[float]:
        return [o.latency for r in self.side(side) for o in r.rooms if o.latency is not None]

    def rooms_per_s(self) -> float:
        done = [r.t_last_done for r in self.side("decode") if r.t_last_done is not None]
        rooms = len(self.succeeded("decode"))
        return rooms / max(done) if done and max(done) > 0 else 0.0

    def summary(self) -> str:
        """One paragraph for assertion messages and logs."""
        phases = " ".join(f"{k}={v:.1f}s" for k, v in self.phase_s.items())
        lines = [f"error={self.error!r} wall={self.wall_s:.2f}s {phases}"]
        for rep in self.ranks:
            counts: Dict[str, int] = {}
            for o in rep.rooms:
                counts[o.status_name] = counts.get(o.status_name, 0) + 1
            lat = [o.latency for o in rep.rooms if o.latency is not None]
            p50 = f"{statistics.median(lat) * 1e3:.1f}ms" if lat else "-"
            lines.append(
                f"  {rep.worker or rep.side + str(rep.rank) + (f'.i{rep.instance}' if rep.instance else '')} pid={rep.pid} {counts} p50={p50} "
                f"checked={rep.checked_bytes}B mismatches={rep.mismatch_count}"
                + (f" ERROR:\n{rep.error}" if rep.error else "")
            )
            lines.extend(f"    {m}" for m in rep.mismatches[:5])
            lines.extend(f"    late write: room#{i}: {m}" for i, m in list(rep.late_writes.items())[:5])
        lines.extend(f"  {f}" for f in self.failures()[:10])
        return "\n".join(lines)
