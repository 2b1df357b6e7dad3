"""Entry point of every harness worker process: the bootstrap server, one prefill TP rank or one
decode TP rank.

Control protocol over the multiprocessing pipe (orchestrator <-> worker):
    worker -> ("ready", {...})     set up and listening
    orch   -> ("go", t0)           start the rooms; t0 is the shared monotonic time origin
    worker -> ("progress", counts)  room counts during the run (open/ready/sent/done)
    worker -> ("report", RankReport)
    orch   -> ("ping",)            worker answers ("pong", pid) while it serves the pipe
    orch   -> ("recheck",)         decode answers ("rechecked", {plan index: change}) for failed
                                   rooms whose pages changed after release
    orch   -> ("stop",)            worker exits
    worker -> ("error", traceback) anything raised in the worker
Every wait here has a deadline; the worker leaves with os._exit so that non-daemon threads of a
backend can never keep it alive after "stop".
"""

from __future__ import annotations

import os
import socket
import sys
import time
import traceback
import urllib.request
from typing import Optional

from harness.pd.config import HarnessConfig
from harness.pd.results import RankReport
from harness.pd.thread_cpu import ThreadCpu

# How long a worker serves pings after its report before leaving on its own.
LINGER_S = 600.0


_PRELOADED = False  # set by worker_main, reported in "ready"


def worker_main(
    role: str,
    rank: int,
    cfg: HarnessConfig,
    model_dir: str,
    bootstrap_port: int,
    conn,
    instance: int = 0,
    first_index: int = 0,
    pin: Optional[dict] = None,
    pp_rank: int = 0,
    pp_links=None,
) -> None:
    """`first_index`, `pin`: a decode server started in place of a dead one (see
    pd_harness.ReadyInfo.restart_decode) serves only the rooms from `first_index` on, and with
    `pin` binds the dead one's ports ({"rank_port", "engine_port"}). `rank` is the rank in the
    side's whole TP group (DP attention included); `pp_rank`, `pp_links`: a prefill PP stage and
    its pipes to the other stages of its (DP, TP) rank."""
    global _PRELOADED
    code = 0
    # Whether this process forked with SGLang already imported (the forkserver's preload); read
    # before any import below can load it.
    _PRELOADED = "sglang.srt.server_args" in sys.modules
    try:
        if role == "bootstrap":
            _run_bootstrap(cfg, model_dir, bootstrap_port, conn)
        else:
            _run_rank(role, rank, cfg, model_dir, bootstrap_port, conn, instance, first_index, pin, pp_rank, pp_links)
    except BaseException:
        code = 1
        try:
            conn.send(("error", traceback.format_exc()))
        except Exception:
            pass
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _serve_until_stop(conn, deadline: float, recheck=None) -> None:
    while time.monotonic() < deadline:
        if not conn.poll(0.5):
            continue
        msg = conn.recv()
        if msg[0] == "stop":
            return
        if msg[0] == "ping":
            conn.send(("pong", os.getpid()))
        if msg[0] == "recheck":
            conn.send(("rechecked", recheck() if recheck is not None else {}))


def _wait_go(conn, deadline: float) -> float:
    while time.monotonic() < deadline:
        if conn.poll(0.5):
            msg = conn.recv()
            if msg[0] == "go":
                return msg[1]
            if msg[0] == "stop":
                raise SystemExit(0)
            if msg[0] == "ping":
                conn.send(("pong", os.getpid()))
    raise TimeoutError("no 'go' from the orchestrator before the start-up deadline")


class _Progress:
    """Streams room counts to the orchestrator (at most every INTERVAL_S, and on change only), so
    a test hook can act at a known point of the run, e.g. once every room's KV has been sent.

    Called on every pass of the room loop: counts are computed at most every INTERVAL_S, and
    finished rooms (whose flags no longer change) are tallied once, so a pass costs O(open rooms)
    instead of O(all rooms), which with 1,000 rooms took the GIL from the threads under test.
    """

    INTERVAL_S = 0.05

    def __init__(self, conn):
        self.conn, self.last, self.sent_at = conn, None, 0.0
        self._active, self._finished = (), None
        self._tallied = self._ready = self._sent = 0

    def __call__(self, active, finished) -> None:
        self._active, self._finished = active, finished  # `finished` only ever grows
        if time.monotonic() - self.sent_at >= self.INTERVAL_S:
            self.flush()

    def _counts(self) -> dict:
        finished = self._finished
        for st in finished[self._tallied:]:
            self._ready += st.outcome.t_ready is not None
            self._sent += st.outcome.t_sent is not None
        self._tallied = len(finished)
        active = self._active
        return {
            "open": len(active) + len(finished),
            "ready": self._ready + sum(st.outcome.t_ready is not None for st in active),
            "sent": self._sent + sum(st.outcome.t_sent is not None for st in active),
            "done": len(finished),
        }

    def flush(self) -> None:
        if self._finished is None:
            return
        counts = self._counts()
        self.sent_at = time.monotonic()
        if counts != self.last:
            self.conn.send(("progress", counts))
            self.last = counts


def _registration_frames(mgr):
    """The frames this decode manager sends to register with a prefill rank, for replay tests;
    None for backends without a registration message (CommonKVManager raises NotImplementedError)."""
    try:
        return [bytes(f) for f in mgr.build_receiver_registration_message()]
    except NotImplementedError:
        return None


def _engine_port(mgr) -> Optional[int]:
    """The port of this manager's MORI-IO engine (None for backends without one)."""
    desc = getattr(getattr(mgr, "engine", None), "desc", None)
    return None if desc is None else int(desc.port)


def _unreachable_port(cfg: HarnessConfig) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((cfg.host, 0))
    return sock


def _run_bootstrap(cfg: HarnessConfig, model_dir: str, port: int, conn) -> None:
    from harness.pd.sglang_setup import kv_classes, setup_process

    setup_process(cfg, model_dir, "bootstrap", 0, port)
    server_cls = kv_classes(cfg.backend)[4]
    server = server_cls(host=cfg.host, port=port)
    url = f"http://{cfg.host}:{port}/health"
    deadline = time.monotonic() + cfg.startup_timeout_s
    while True:  # the server starts on its own thread; wait until it answers
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    break
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"bootstrap server on {url} did not come up")
        time.sleep(0.05)
    conn.send(("ready", {"pid": os.getpid(), "class": f"{type(server).__module__}.{type(server).__name__}",
                         "preloaded": _PRELOADED}))
    _serve_until_stop(conn, time.monotonic() + cfg.startup_timeout_s + cfg.transfer_timeout_s + LINGER_S)


def _run_rank(
    side: str, rank: int, cfg: HarnessConfig, model_dir: str, port: int, conn, instance: int,
    first_index: int = 0, pin: Optional[dict] = None, pp_rank: int = 0, pp_links=None,
) -> None:
    from harness.pd.sglang_setup import kv_classes, setup_process

    server_args = setup_process(cfg, model_dir, side, rank, port, pp_rank, pp_links)
    if pin:
        from harness.pd.pin import pin_ports

        pin_ports(cfg, pin)
    from sglang.srt.disaggregation.utils import DisaggregationMode

    from harness.pd.decode import run_decode_rooms
    from harness.pd.engine_contacts import engine_contacts
    from harness.pd.plan import build_plan, rooms_of_rank
    from harness.pd.pool import RankPool
    from harness.pd.prefill import run_prefill_rooms
    from harness.pd.verify import late_writes, verify_decode

    kv_args_cls, mgr_cls, sender_cls, receiver_cls, _ = kv_classes(cfg.backend)
    plan = build_plan(cfg)
    pool = RankPool(cfg, plan, side, rank, pp_rank)
    if side == "prefill":
        pool.fill_prefill()
    mode = DisaggregationMode.PREFILL if side == "prefill" else DisaggregationMode.DECODE
    mgr = mgr_cls(pool.kv_args(kv_args_cls), mode, server_args, cfg.layout.mla)
    if cfg.freeze_gc_all:
        import gc

        gc.collect()
        gc.freeze()
    # Reliability tests: rounds, and the control socket (before "ready", so on_ready can use it).
    from harness.pd.control import ManagerRef, RoundGate, start_control

    gate = RoundGate(cfg)
    holder = {"mgr": mgr}
    rebuild = (lambda: mgr_cls(pool.kv_args(kv_args_cls), mode, server_args, cfg.layout.mla)) if side == "decode" else None
    control = start_control(cfg, side, holder, pool, gate, rebuild)
    conn.send(
        (
            "ready",
            {
                "pid": os.getpid(),
                "endpoint": (mgr.local_ip, mgr.rank_port),
                "class": f"{type(mgr).__module__}.{type(mgr).__name__}",
                "registration": _registration_frames(mgr) if side == "decode" else None,
                "engine_port": _engine_port(mgr),
                "preloaded": _PRELOADED,
            },
        )
    )
    t0 = _wait_go(conn, time.monotonic() + cfg.startup_timeout_s)
    cpu0 = time.process_time()
    threads_cpu = ThreadCpu() if cfg.thread_cpu else None
    if control is not None:
        mgr = ManagerRef(holder)  # follows restart_engine

    def clock() -> float:
        return time.monotonic() - t0

    deadline = t0 + cfg.transfer_timeout_s
    addr = f"{cfg.host}:{port}"
    report = RankReport(side=side, rank=rank, pid=os.getpid(), instance=instance, dp_rank=pool.dp_rank, pp_rank=pp_rank)
    mine = rooms_of_rank(plan, cfg, side, pool.dp_rank, instance)
    mine = [r for r in mine if r.index >= first_index]
    statuses = _record_statuses(mgr) if side == "decode" and cfg.record_statuses else None
    # cfg.unreachable_bootstrap: a port this process keeps bound and never listens on, so a
    # connection to it is refused (and no other process can take the port meanwhile).
    dead = _unreachable_port(cfg) if side == "decode" and cfg.unreachable_bootstrap else None
    progress = _Progress(conn)
    snapshots: dict = {}
    if side == "prefill":
        report.rooms = run_prefill_rooms(
            pool, plan, mgr, sender_cls, addr, clock, deadline, progress, may_open=gate.may_open, rooms=mine
        )
    else:
        report.rooms = run_decode_rooms(
            pool, plan, mgr, receiver_cls, addr, clock, deadline, progress, snapshots, may_open=gate.may_open,
            rooms=mine, unreachable_addr=None if dead is None else f"{cfg.host}:{dead.getsockname()[1]}",
        )
    progress.flush()
    if statuses is not None:
        index = {r.room: r.index for r in plan.rooms}
        report.statuses = {index[room]: list(seen) for room, seen in list(statuses.items()) if room in index}
    if hasattr(mgr, "debug_snapshot"):  # ours: what its per-room tables still hold
        report.tables = _settled_tables(mgr)
    report.cpu_s = time.process_time() - cpu0
    if threads_cpu is not None:
        report.thread_cpu = threads_cpu.since()
    if side == "prefill":
        report.engine_path = _engine_path(mgr)
    report.engine_contacts = engine_contacts(mgr)
    done = [o.t_done for o in report.rooms if o.t_done is not None]
    report.t_last_done = max(done) if done else None
    if side == "decode" and cfg.verify:
        verify_decode(pool, plan, report.rooms, report, rooms=mine)
    conn.send(("report", report))
    # Stay up (manager threads keep serving) until the orchestrator has every report; then it may
    # ask decode to look again at the pages of released failed rooms.
    _serve_until_stop(conn, time.monotonic() + LINGER_S, lambda: late_writes(pool, plan, snapshots))


TABLES_SETTLE_S = 10.0


def _settled_tables(mgr) -> dict:
    """The manager's per-room table sizes once they are all zero, or as they are after
    TABLES_SETTLE_S. A room's Success is published before the completion thread returns its write's
    budget and forgets it (the next pass, microseconds later), so a snapshot taken the moment the
    last room polls Success can still count it; a leftover is what never drains."""
    deadline = time.monotonic() + TABLES_SETTLE_S
    tables = mgr.debug_snapshot()
    while any(tables.values()) and time.monotonic() < deadline:
        time.sleep(0.01)  # polling a state another thread changes; bounded by the deadline
        tables = mgr.debug_snapshot()
    return tables


def _record_statuses(mgr) -> dict:
    """bootstrap_room -> [(prefill_rank, status, carried aux)] of every RoomStatus this decode
    manager's status thread handles (our backend only: it wraps the service's handler)."""
    seen: dict = {}
    service = getattr(mgr, "service", None)
    if service is None or not hasattr(service, "on_status"):
        raise RuntimeError("record_statuses needs the mori backend's decode service")
    handle = service.on_status

    def on_status(msg):
        seen.setdefault(int(msg.room), []).append((int(msg.prefill_rank), int(msg.status), bool(msg.aux)))
        handle(msg)

    service.on_status = on_status  # looked up on the instance by the status thread
    return seen


def _engine_path(mgr):
    """The softio path prefill's writes took to its decode peers ("intra-host", "tcp"), if the
    engine is softio and the backend is ours (the built-in one's engine has no peer_keys())."""
    engine = getattr(mgr, "engine", None)
    inner = getattr(engine, "engine", None)
    if inner is None or not hasattr(engine, "peer_keys") or not type(inner).__module__.startswith("sglang_mori.softio"):
        return None
    from sglang_mori.softio.intrahost import peer_path

    paths = {peer_path(inner, key) for key in engine.peer_keys()} - {None}
    return ",".join(sorted(paths)) or None
