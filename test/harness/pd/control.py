"""A side channel from a test to the harness workers while they run (reliability tests, soak).

Enabled with `HarnessConfig.control=True`. Every prefill and decode worker then serves an abstract
UNIX socket named after its PID (`WorkerControl(pid)` connects to it), answering:

- `fault(name, **kwargs)`: call `sglang_mori.softio.faults.<name>` on this rank's engine (softio
  only), e.g. `fault("stall_lane", lane=1)` mid-run, `fault("clear")`, `fault("resume_lane")`;
- `open_round(k)`: let round k of `HarnessConfig.rounds` start on this rank;
- `leftovers()`: what the manager still holds per table (rooms, statuses, trackers, sockets), so a
  test can prove nothing is left behind once every room is terminal and drained;
- `peers()` (prefill): every decode peer the backend knows, with its rejection/failure reason and
  the in-flight count, plus the highest in-flight count seen since start;
- `write_log()` (decode): every write softio logged into this rank's KV/aux/state buffers, as
  (buffer kind, buffer index, first row, last row, landing time, writer key);
- `engine_endpoint()`, `engine_peers()`: where this rank's engine listens; the remote engines
  registered with it (prefill: which decode incarnations it still knows);
- `restart_engine()` (decode): kill this rank's engine (RST every connection, like a crashed
  process) and build a fresh manager with a new engine key in its place, on the same buffers.
  Later rounds run on the new manager.

The abstract socket lives in the network namespace, so tests run it inside
scripts/in_private_netns.sh like everything else. Nothing here runs unless a test asks for it.
"""

from __future__ import annotations

import os
import threading
import time
from multiprocessing.connection import Client, Listener
from typing import Callable, Dict, List, Optional

INFLIGHT_SAMPLE_S = 0.002


def control_address(pid: int) -> str:
    return f"\0sglang-mori-harness-control-{pid}"


# --- rounds ----------------------------------------------------------------------------------


class RoundGate:
    """Which rooms a worker may open: those of round 0 at once, round k once it was opened (by the
    test through the control channel, or on its own when the config has no control channel) and
    no room of an earlier round is still active on this rank."""

    def __init__(self, cfg):
        self.starts: List[int] = []
        pos = 0
        for size in cfg.rounds or (cfg.rooms,):
            self.starts.append(pos)
            pos += size
        self.controlled = bool(cfg.control)
        self._opened = {0}
        self._lock = threading.Lock()

    def round_of(self, index: int) -> int:
        k = 0
        for i, start in enumerate(self.starts):
            if index >= start:
                k = i
        return k

    def open(self, k: int) -> None:
        with self._lock:
            self._opened.add(k)

    def may_open(self, room, active) -> bool:
        k = self.round_of(room.index)
        if k == 0:
            return True
        if self.controlled:
            with self._lock:
                if k not in self._opened:
                    return False
        start = self.starts[k]
        return all(st.plan.index >= start for st in active)


# --- worker side -----------------------------------------------------------------------------


class ControlServer:
    """Serves one worker's control socket on a daemon thread."""

    def __init__(self, side: str, holder: dict, pool, gate: RoundGate, rebuild: Optional[Callable] = None):
        self.side = side
        self.holder = holder  # {"mgr": current manager}; restart_engine swaps it
        self.pool = pool
        self.gate = gate
        self.rebuild = rebuild
        self.max_inflight: Dict[str, int] = {}
        self.retired: List[object] = []  # managers replaced by restart_engine (kept alive, stopped)
        self.listener = Listener(control_address(os.getpid()), family="AF_UNIX")
        threading.Thread(target=self._serve, name="harness-control", daemon=True).start()
        if side == "prefill":
            threading.Thread(target=self._sample_inflight, name="harness-inflight", daemon=True).start()

    @property
    def mgr(self):
        return self.holder["mgr"]

    def _serve(self) -> None:
        while True:
            try:
                conn = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._client, args=(conn,), daemon=True).start()

    def _client(self, conn) -> None:
        try:
            while True:
                try:
                    cmd, args, kwargs = conn.recv()
                except (EOFError, OSError):
                    return
                try:
                    reply = ("ok", getattr(self, f"cmd_{cmd}")(*args, **kwargs))
                except Exception as exc:  # reported to the test, not fatal to the worker
                    reply = ("error", f"{type(exc).__name__}: {exc}")
                conn.send(reply)
        finally:
            conn.close()

    def _sample_inflight(self) -> None:
        while True:
            peers = _peer_registry(self.mgr)
            if peers is not None:
                for key, count in peers.budget.snapshot().items():
                    if count > self.max_inflight.get(key, 0):
                        self.max_inflight[key] = count
            time.sleep(INFLIGHT_SAMPLE_S)

    # --- commands ---------------------------------------------------------------------------
    def cmd_fault(self, name: str, **kwargs):
        from sglang_mori.softio import faults

        if name.startswith("_") or not callable(getattr(faults, name, None)):
            raise ValueError(f"no fault {name!r} in sglang_mori.softio.faults")
        getattr(faults, name)(self.mgr.engine.engine, **kwargs)
        return None

    def cmd_open_round(self, k: int):
        self.gate.open(k)
        return None

    def cmd_engine_key(self):
        return self.mgr.engine.key

    def cmd_engine_endpoint(self):
        """(host, port) this rank's engine listens on."""
        desc = self.mgr.engine.desc
        return (desc.host, int(desc.port))

    def cmd_engine_peers(self):
        """Keys of the remote engines registered with this rank's engine."""
        return self.mgr.engine.peer_keys()

    def cmd_leftovers(self):
        total: Dict[str, int] = {}
        for mgr in [*self.retired, self.mgr]:
            for name, n in leftovers(mgr).items():
                total[name] = total.get(name, 0) + n
        return total

    def cmd_leftover_detail(self):
        """What the non-empty tables hold (up to 10 keys each), and per-peer in-flight counts."""
        out = {}
        for i, mgr in enumerate([*self.retired, self.mgr]):
            for name, n in leftovers(mgr).items():
                if n:
                    out[f"{i}.{name}"] = n
            peers = _peer_registry(mgr)
            if peers is not None:
                out[f"{i}.peers"] = peers.budget.snapshot()
            out[f"{i}.room_ids"] = sorted(int(r) for r in list(mgr.request_status))[:10]
        return out

    def cmd_room_states(self):
        """bootstrap_room -> KVPoll value of every room this rank's manager still holds, and
        (decode) the rooms held for a deferred release ("held": armed, not yet released)."""
        mgr = self.mgr
        states = {int(r): int(s) for r, s in list(mgr.request_status.items())}
        # SGLang's decode-side table of rooms armed for a deferred release (test tooling reads it).
        held = sorted(int(r) for r in list(getattr(mgr, "_deferred_abort_ack_tracker", {})))
        return {"status": states, "held": held}

    def cmd_peers(self):
        peers = _peer_registry(self.mgr)
        out = []
        for key in peers.keys():
            p = peers.get(key)
            if p is None:
                continue
            out.append(
                {
                    "key": key,
                    "endpoint": tuple(p.endpoint),
                    "rejected": p.rejected,
                    "failed_reason": p.failed_reason,
                    "inflight": peers.budget.count(key),
                    # asking also ends an expired fail-fast window, as a new room would
                    "unusable": peers.unusable_reason(key),
                    "max_inflight": self.max_inflight.get(key, 0),
                }
            )
        return out

    def cmd_attempts(self):
        """(decode) bootstrap_room -> attempt id of its latest receiver."""
        from harness.pd.decode import ATTEMPTS

        return dict(ATTEMPTS)

    def cmd_protocol_rejections(self):
        return dict(getattr(self.mgr, "protocol_rejections", {}))

    def cmd_write_log(self):
        from sglang_mori.softio.write_log import get_write_log

        regions = {}
        for mgr in [*self.retired, self.mgr]:
            regions.update(_regions(mgr, self.pool))
        records = []
        for mgr in [*self.retired, self.mgr]:
            for r in get_write_log(mgr.engine.engine):
                where = regions.get(r.region_id)
                if where is None:
                    continue
                kind, index, row_bytes = where
                first = r.offset // row_bytes
                last = (r.offset + max(r.size, 1) - 1) // row_bytes
                records.append((kind, index, first, last, r.time, r.initiator_key))
        return records

    def cmd_restart_engine(self):
        if self.rebuild is None:
            raise ValueError("restart_engine is available on decode workers only")
        from sglang_mori.softio import faults

        old = self.mgr
        old_key = old.engine.key
        faults.kill_engine(old.engine.engine)  # every peer sees this engine die, as on a crash
        from sglang_mori.backend import sglang_compat

        old.service.stopped.set()  # its threads wind down; the test reads what it left
        sglang_compat.stop_heartbeat_checker(old)
        self.retired.append(old)
        self.holder["mgr"] = self.rebuild()
        return {"old_key": old_key, "new_key": self.mgr.engine.key}


def _regions(mgr, pool) -> Dict[int, tuple]:
    """softio region id -> (kind, buffer index, bytes per row) for this rank's buffers."""
    out = {}

    def add(descs, tensors, kind):
        for i, (desc, t) in enumerate(zip(descs, tensors)):
            if desc is not None:
                out[int(desc.id)] = (kind, i, int(t[0].nbytes))

    add(mgr.buffers.kv, pool.kv, "kv")
    add(mgr.buffers.aux, pool.aux, "aux")
    if mgr.buffers.state:
        add(mgr.buffers.state[0], pool.state, "state")
    return out


def _peer_registry(mgr):
    """The prefill service's decode peers (with their in-flight budget), or None on decode."""
    parts = getattr(getattr(mgr, "service", None), "p", None)
    return getattr(parts, "peers", None)


# debug_snapshot() names -> the short names the reliability tests read.
_ALIASES = {
    "prefill.rooms_with_writes": "tracker",
    "prefill.inflight_writes": "inflight",
    "prefill.queued_chunks": "queued_chunks",
    "decode.rooms": "decode_rooms",
}


def leftovers(mgr) -> Dict[str, int]:
    """Per table, how many entries this manager still holds (0 everywhere = nothing left), from
    the product's own debug_snapshot(): a renamed table cannot be skipped silently."""
    return {_ALIASES.get(name, name): int(n) for name, n in mgr.debug_snapshot().items()}


class ManagerRef:
    """Stands for "this rank's current manager" (restart_engine replaces it): attribute access
    goes to the current one; `.current` is the manager itself, for objects that must stay bound
    to the manager they were created with (receivers)."""

    def __init__(self, holder: dict):
        self.__dict__["_holder"] = holder

    @property
    def current(self):
        return self._holder["mgr"]

    def __getattr__(self, name):
        return getattr(self._holder["mgr"], name)


def start_control(cfg, side: str, holder: dict, pool, gate: RoundGate, rebuild=None) -> Optional[ControlServer]:
    if not cfg.control or side not in ("prefill", "decode"):
        return None
    return ControlServer(side, holder, pool, gate, rebuild)


# --- test side -------------------------------------------------------------------------------


class ControlError(RuntimeError):
    pass


class WorkerControl:
    """Client of one worker's control socket (connect by the worker's PID)."""

    def __init__(self, pid: int, timeout_s: float = 30.0):
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.conn = Client(control_address(pid), family="AF_UNIX")
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    raise ControlError(f"no control socket for pid {pid}") from None
                time.sleep(0.05)
        self.pid = pid
        self.lock = threading.Lock()

    def call(self, cmd: str, *args, timeout_s: float = 30.0, **kwargs):
        with self.lock:
            self.conn.send((cmd, args, kwargs))
            if not self.conn.poll(timeout_s):
                raise ControlError(f"pid {self.pid}: no answer to {cmd} within {timeout_s} s")
            status, value = self.conn.recv()
        if status != "ok":
            raise ControlError(f"pid {self.pid}: {cmd} failed: {value}")
        return value

    def fault(self, name: str, **kwargs) -> None:
        self.call("fault", name, **kwargs)

    def open_round(self, k: int) -> None:
        self.call("open_round", k)

    def leftovers(self) -> Dict[str, int]:
        return self.call("leftovers")

    def room_states(self) -> dict:
        return self.call("room_states")

    def peers(self) -> list:
        return self.call("peers")

    def write_log(self) -> list:
        return self.call("write_log")

    def engine_key(self) -> str:
        return self.call("engine_key")

    def engine_endpoint(self) -> tuple:
        return tuple(self.call("engine_endpoint"))

    def engine_peers(self) -> list:
        return self.call("engine_peers")

    def attempts(self) -> dict:
        return {int(k): v for k, v in self.call("attempts").items()}

    def restart_engine(self) -> dict:
        return self.call("restart_engine", timeout_s=120.0)

    def protocol_rejections(self) -> dict:
        return self.call("protocol_rejections")

    def close(self) -> None:
        self.conn.close()


def controls(info, names=None) -> Dict[str, WorkerControl]:
    """WorkerControl for every prefill/decode worker of a run (from its ReadyInfo)."""
    names = names or [n for n in info.pids if n.startswith(("prefill", "decode"))]
    return {n: WorkerControl(info.pids[n]) for n in names}


def wait_until(predicate: Callable[[], object], timeout_s: float, what: str, poll_s: float = 0.05):
    """Poll `predicate` until truthy; its value, or ControlError naming `what` at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise ControlError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(poll_s)


def wait_clean(ctl: Dict[str, WorkerControl], timeout_s: float) -> Dict[str, Dict[str, int]]:
    """Poll every worker until its manager holds nothing; the last leftovers seen (all zero on
    success; the test asserts on them)."""
    last: Dict[str, Dict[str, int]] = {}

    def clean() -> bool:
        for name, c in ctl.items():
            last[name] = c.leftovers()
        return all(not any(v for v in t.values()) for t in last.values())

    try:
        wait_until(clean, timeout_s, "empty manager tables", poll_s=0.1)
    except ControlError:
        for name, c in ctl.items():
            if any(last[name].values()):
                last[name]["detail"] = c.call("leftover_detail")
    return last


def late_writes_by_log(records, plan, outcomes, t0: float, page_size: int) -> List[str]:
    """Writes (from a decode write log) that landed in a room's pages or rows after decode
    released that room. `outcomes` are that decode rank's RoomOutcome list; times relative to t0."""
    ps = page_size
    released = {}
    for o in outcomes:
        if o.t_released is not None:
            released[o.index] = t0 + o.t_released
    if not released:
        return []
    rows: Dict[tuple, int] = {}  # (kind, row) -> plan index of the owning room
    for index in released:
        room = plan.rooms[index]
        for p in room.decode_pages.tolist():
            rows[("kv_page", int(p))] = index
        rows[("aux", int(room.decode_aux))] = index
        rows[("state", int(room.decode_state))] = index
    out = []
    for kind, buf, first, last, t, writer in records:
        keys = []
        if kind == "kv":
            keys = [("kv_page", p) for p in range(first // ps, last // ps + 1)]
        else:
            keys = [(kind, r) for r in range(first, last + 1)]
        for key in keys:
            index = rows.get(key)
            if index is not None and t > released[index]:
                out.append(
                    f"room#{index}: {kind}[{buf}] rows {first}..{last} written by {writer} "
                    f"{(t - released[index]) * 1e3:.1f} ms after decode released the room"
                )
                break
    return out


def rss_bytes(pid: int) -> int:
    """Resident set size of a process (Linux /proc)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise ControlError(f"no VmRSS for pid {pid}")
