"""Multi-process PD KV-transfer harness: SGLang's real disaggregation classes (ours through the
plugin, or SGLang's Mooncake) in separate processes on CPU tensors, driven like the schedulers
drive them, with byte-exact checks on decode.

    from harness.pd.run import HarnessConfig, KVLayout, run_transfer
    result = run_transfer(HarnessConfig(backend="mori", prefill_tp=2, decode_tp=1, rooms=64))
    assert result.all_succeeded(64) and result.byte_exact(), result.summary()

Processes: one bootstrap server, one per prefill rank (cfg.prefill_dp DP ranks x cfg.prefill_tp
attention-TP ranks x cfg.prefill_pp PP stages), one per decode rank (cfg.decode_dp x cfg.decode_tp,
of each decode instance, cfg.decode_instances; room i goes to instance i % decode_instances). With
DP attention each room runs on one DP rank per side (plan.RoomPlan.prefill_dp / decode_dp). The orchestrator
(the caller's process) never imports SGLang. Optional hooks let a test act on the running system:
`on_ready(ReadyInfo)` runs after every worker is up and before "go"; `during(ReadyInfo)` runs on a
thread while the rooms transfer (ReadyInfo.progress / wait_progress follow the rooms). Every worker
is stopped (by PID, escalating to SIGKILL) when the run ends, whatever happened.

Modules: pd_harness_config (HarnessConfig, KVLayout, RoomShape, AuxBufferSpec), _plan (which
pages/slots each room uses, from the seed), _pattern (the bytes), _pool (CPU tensors + KVArgs),
_sglang (per-process SGLang set-up), _prefill / _decode / _loop (the scheduler call sequences),
_verify (byte checks), _worker (process entry), _results (RoomOutcome, RankReport, HarnessResult),
_control (optional control socket for reliability tests).

Result: HarnessResult.ranks holds one RankReport per prefill/decode rank with a RoomOutcome per
room (final KVPoll status or TIMED_OUT, failure text, t_open/t_ready/t_sent/t_done relative to
"go", prefill's transfer bytes, decode's release of failed rooms); decode reports add the byte
check (verified, checked_bytes, mismatch_count, mismatches, late_writes). Helpers:
all_succeeded(n), byte_exact(), failures(), latencies(side), rooms_per_s(), summary().
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import signal
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

from harness.pd.config import AuxBufferSpec, HarnessConfig, KVLayout, RoomShape
from harness.pd.results import HarnessResult, RankReport, ReadyInfo
from harness.pd.sglang_setup import write_model_dir

__all__ = [
    "AuxBufferSpec",
    "HarnessConfig",
    "HarnessResult",
    "KVLayout",
    "ReadyInfo",
    "RoomShape",
    "run_transfer",
]

VERIFY_MARGIN_S = 60.0  # after the transfer deadline, time for decode's byte checks
STOP_GRACE_S = 5.0

Hook = Callable[[ReadyInfo], None]


class HarnessError(RuntimeError):
    pass


def decode_worker_name(rank: int, instance: int = 0) -> str:
    """'decode<rank>' for the first decode instance, 'decode<rank>.i<instance>' for the others."""
    return f"decode{rank}" if instance == 0 else f"decode{rank}.i{instance}"


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# The folder that holds the `harness` package (test/): the forkserver must be able to import it.
_HARNESS_ROOT = str(Path(__file__).resolve().parents[2])
PRELOAD_MODULE = "harness.pd.preload"


def _context(method: str):
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload([PRELOAD_MODULE])
        _start_forkserver()
    return ctx


def _start_forkserver() -> None:
    """Start the forkserver (once per process) with the harness importable.

    Python 3.11's forkserver is handed the parent's sys.path but never applies it, and it skips a
    preload module that fails to import without a word: under pytest (whose `pythonpath = test`
    edits sys.path, not PYTHONPATH) the preload never happened and every worker imported SGLang
    itself, about 15 s of each harness run's start-up on two cores. The server inherits this
    process's environment when it starts, so PYTHONPATH carries the harness root for that moment
    only; workers report whether they forked with SGLang loaded (ready["preloaded"]).
    """
    from multiprocessing import forkserver

    before = os.environ.get("PYTHONPATH")
    parts = [p for p in (before or "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join([_HARNESS_ROOT, *parts])
    try:
        forkserver.ensure_running()
    finally:
        if before is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = before


class _Worker:
    def __init__(
        self, ctx, name: str, role: str, rank: int, cfg, model_dir: str, port: int, instance: int = 0,
        first_index: int = 0, pin: Optional[dict] = None, pp_rank: int = 0, pp_links=None,
    ):
        from harness.pd.worker import worker_main

        self.name, self.role, self.rank, self.instance = name, role, rank, instance
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=worker_main,
            args=(role, rank, cfg, model_dir, port, child, instance, first_index, pin, pp_rank, pp_links),
            name=f"pd-harness-{name}",
            # Also reaped by multiprocessing's exit handler if the caller dies between our
            # try/finally and the join (e.g. KeyboardInterrupt); workers start only threads.
            daemon=True,
        )
        self.proc.start()
        child.close()
        self.ready: Optional[dict] = None
        self.report: Optional[RankReport] = None
        self.rechecked: Optional[dict] = None

    def stop(self) -> None:
        try:
            self.conn.send(("stop",))
        except (OSError, EOFError):
            pass

    def reap(self, deadline: float) -> None:
        self.proc.join(max(0.0, deadline - time.monotonic()))
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if not self.proc.is_alive():
                break
            try:
                os.kill(self.proc.pid, sig)
            except ProcessLookupError:
                break
            self.proc.join(STOP_GRACE_S)
        self.conn.close()


def _collect(
    workers: List[_Worker],
    kind: str,
    deadline: float,
    progress: Optional[Dict[str, dict]] = None,
    lost: Optional[List[str]] = None,
    joiners: Optional[List[_Worker]] = None,
) -> None:
    """Wait for message `kind` from every worker in the list; raise on error/deadline, and on a
    death unless `lost` is given (then the dead worker's name is appended and the rest awaited).
    Progress messages met on the way update `progress`. Workers appended to `joiners` meanwhile
    (restart_decode, once they are up) are awaited too."""
    waiting = {w.conn: w for w in workers}
    joined = 0

    def died(w: _Worker, why: str) -> None:
        if lost is None:
            raise HarnessError(why)
        lost.append(w.name)
        del waiting[w.conn]

    while waiting:
        if joiners is not None and len(joiners) > joined:
            for w in joiners[joined:]:
                waiting[w.conn] = w
            joined = len(joiners)
        left = deadline - time.monotonic()
        if left <= 0:
            names = ", ".join(w.name for w in waiting.values())
            raise HarnessError(f"no {kind!r} from {names} before the deadline")
        for conn in mpc.wait(list(waiting), timeout=min(left, 1.0)):
            w = waiting[conn]
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                w.proc.join(1.0)
                died(w, f"worker {w.name} died (exit code {w.proc.exitcode})")
                continue
            if msg[0] == "error":
                raise HarnessError(f"worker {w.name} failed:\n{msg[1]}")
            if msg[0] == "progress" and progress is not None:
                progress[w.name] = msg[1]
            elif msg[0] == kind:
                setattr(w, kind, msg[1])
                del waiting[conn]
        for conn, w in list(waiting.items()):
            if not w.proc.is_alive() and not conn.poll():
                died(w, f"worker {w.name} exited (code {w.proc.exitcode}) before {kind!r}")


def _ping_all(workers: List[_Worker], timeout: float) -> Dict[str, bool]:
    alive = {}
    for w in workers:
        ok = False
        try:
            w.conn.send(("ping",))
            end = time.monotonic() + timeout
            while time.monotonic() < end and w.conn.poll(max(0.0, end - time.monotonic())):
                msg = w.conn.recv()
                if msg[0] == "pong":
                    ok = True
                    break
        except (OSError, EOFError):
            ok = False
        alive[w.name] = ok and w.proc.is_alive()
    return alive


def run_transfer(cfg: HarnessConfig, *, on_ready: Optional[Hook] = None, during: Optional[Hook] = None) -> HarnessResult:
    """Run one harness session to completion and return what every rank reported.

    Never raises for transfer problems (those are in the result); raises ValueError for an invalid
    config. Start-up failures, lost workers and missed deadlines land in `result.error`.
    """
    cfg.validate()
    ctx = _context(cfg.start_method)
    workers: List[_Worker] = []
    result = HarnessResult(ranks=[])
    hook_error: List[BaseException] = []
    with tempfile.TemporaryDirectory(prefix="pd-harness-") as tmp:
        model_dir = str(write_model_dir(cfg, Path(tmp) / "model"))
        port = _free_port(cfg.host)
        t_start = time.monotonic()
        try:
            # All at once: on two cores the imports dominate start-up, and a prefill manager that
            # registers before the bootstrap server listens retries on its own (SGLang's
            # _register_topology_row backs off from 1 s).
            boot = _Worker(ctx, "bootstrap", "bootstrap", 0, cfg, model_dir, port)
            workers.append(boot)
            decode = [
                _Worker(ctx, decode_worker_name(r, i), "decode", r, cfg, model_dir, port, i)
                for i in range(cfg.decode_instances)
                for r in range(cfg.decode_tp * cfg.decode_dp)
            ]
            prefill = _prefill_workers(ctx, cfg, model_dir, port)
            workers += decode + prefill
            _collect(workers, "ready", time.monotonic() + cfg.startup_timeout_s)
            result.phase_s["all_ready"] = time.monotonic() - t_start
            result.ready = ReadyInfo(
                bootstrap_addr=f"{cfg.host}:{port}",
                prefill_endpoints=[tuple(w.ready["endpoint"]) for w in prefill],
                decode_endpoints=[tuple(w.ready["endpoint"]) for w in decode],
                pids={w.name: w.ready["pid"] for w in workers},
                decode_registrations=[w.ready.get("registration") for w in decode],
                manager_classes={w.name: w.ready.get("class", "") for w in workers},
                preloaded={w.name: bool(w.ready.get("preloaded")) for w in workers},
            )
            if on_ready is not None:
                on_ready(result.ready)
            t0 = result.ready.t0 = time.monotonic()
            for w in prefill + decode:
                w.conn.send(("go", t0))
            joiners: List[_Worker] = []  # decode workers started by restart_decode, once up
            result.ready.restart_decode = _restarter(ctx, cfg, model_dir, port, result.ready, workers, joiners)
            thread = None
            if during is not None:
                thread = threading.Thread(target=_guard(during, result.ready, hook_error), daemon=True)
                thread.start()
            lost = result.lost_workers
            report_deadline = t0 + cfg.transfer_timeout_s + VERIFY_MARGIN_S
            _collect(
                prefill + decode, "report", report_deadline,
                progress=result.ready.progress, lost=lost, joiners=joiners,
            )  # fmt: skip
            result.wall_s = time.monotonic() - t0
            if thread is not None:
                thread.join(cfg.transfer_timeout_s)
                if thread.is_alive():
                    raise HarnessError("the 'during' hook did not return before the deadline")
            late_joiners = [w for w in joiners if w.report is None and w.name not in lost]
            if late_joiners:  # started after every other worker had reported
                _collect(late_joiners, "report", report_deadline, progress=result.ready.progress, lost=lost)
            if hook_error:
                raise HarnessError(f"the 'during' hook raised: {hook_error[0]!r}") from hook_error[0]
            # Every prefill rank has concluded every room: a failed room released on decode must
            # not have changed since its release.
            survivors = [w for w in decode + joiners if w.name not in lost]
            for w in survivors:
                w.conn.send(("recheck",))
            _collect(survivors, "rechecked", time.monotonic() + VERIFY_MARGIN_S)
            for w in survivors:
                w.report.late_writes, w.report.rechecked = w.rechecked, True
            result.alive_at_end = _ping_all([w for w in workers if w.name not in lost], 10.0)
            if lost:
                result.error = f"workers died before reporting: {', '.join(lost)}"
        except HarnessError as exc:
            result.error = str(exc)
        finally:
            for w in workers:
                w.stop()
            end = time.monotonic() + STOP_GRACE_S
            for w in workers:
                w.reap(end)
        for w in workers:
            if w.report is not None:
                w.report.worker = w.name
        result.ranks = [w.report for w in workers if w.report is not None]
    return result


def prefill_worker_name(rank: int, pp_rank: int = 0, pp_size: int = 1) -> str:
    """'prefill<rank>' (rank in the whole TP group, DP attention included), '.pp<stage>' with PP."""
    return f"prefill{rank}" if pp_size == 1 else f"prefill{rank}.pp{pp_rank}"


def _prefill_workers(ctx, cfg: HarnessConfig, model_dir: str, port: int) -> List[_Worker]:
    """One worker per prefill (DP, TP, PP) rank. The PP stages of one TP rank get pipes to each
    other for their PP group's broadcast (sglang_setup.PipePPGroup): stage 0 one per later stage."""
    workers = []
    for r in range(cfg.prefill_tp * cfg.prefill_cp * cfg.prefill_dp):
        pairs = [ctx.Pipe() for _ in range(cfg.prefill_pp - 1)]
        for p in range(cfg.prefill_pp):
            links = [a for a, _ in pairs] if p == 0 else [pairs[p - 1][1]]
            name = prefill_worker_name(r, p, cfg.prefill_pp)
            workers.append(_Worker(ctx, name, "prefill", r, cfg, model_dir, port, pp_rank=p, pp_links=links))
        for a, b in pairs:  # the workers hold their own copies now
            a.close()
            b.close()
    return workers


def _restarter(ctx, cfg: HarnessConfig, model_dir: str, port: int, info: ReadyInfo, workers, joiners):
    """ReadyInfo.restart_decode for this run (see there). Runs on the hook's thread: it reads only
    the new worker's pipe until that worker is up, then hands it to the orchestrator's loop."""
    count = [0]

    def restart_decode(victim: str, first_index: int, same_ports: bool = True, timeout_s: Optional[float] = None) -> str:
        old = next((w for w in workers if w.name == victim), None)
        if old is None or old.role != "decode":
            raise ValueError(f"no decode worker named {victim!r}")
        if old.proc.is_alive():
            raise ValueError(f"{victim} is still running; kill it first")
        pin = None
        if same_ports:
            pin = {"rank_port": old.ready["endpoint"][1], "engine_port": old.ready.get("engine_port")}
        count[0] += 1
        name = f"{decode_worker_name(old.rank, old.instance)}.r{count[0]}"
        w = _Worker(ctx, name, "decode", old.rank, cfg, model_dir, port, old.instance, first_index, pin)
        workers.append(w)  # stopped and reaped with the others, whatever happens next
        _collect([w], "ready", time.monotonic() + (timeout_s or cfg.startup_timeout_s))
        info.pids[name] = w.ready["pid"]
        info.decode_endpoints.append(tuple(w.ready["endpoint"]))
        w.conn.send(("go", info.t0))
        joiners.append(w)
        return name

    return restart_decode


def _guard(fn: Hook, info: ReadyInfo, errors: List[BaseException]) -> Callable[[], None]:
    def run() -> None:
        try:
            fn(info)
        except BaseException as exc:  # reported by the orchestrator, not lost on the thread
            errors.append(exc)

    return run
