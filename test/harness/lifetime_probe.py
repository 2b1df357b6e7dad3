"""A harness process for the tests of harness.lifetime: start children the way tests do, report
them, then wait to be killed.

    python -m harness.lifetime_probe --out FILE --tree          # two fake servers, each with a child
    python -m harness.lifetime_probe --out FILE --server MODEL  # one real SGLang server (tiny model)

Once every child is up it writes {"probe": pid, "watchdog": pid, "pgids": [...]} to FILE (atomically)
and waits, at most --linger-s, for the test to kill it; a probe that is never killed stops its
children itself and exits 3, so that a broken test leaves nothing behind either.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, Sequence

from harness import launch, lifetime
from harness.deployment import Standalone
from harness.procs import ManagedProcess

# A fake server: forks a child that stays in its group, as SGLang's scheduler does; both sleep.
_FAKE_SERVER = "import os, time\nos.fork()\ntime.sleep(600)\n"


def _fake_servers(log_dir: Path) -> List[ManagedProcess]:
    first = _fake_server("fake-main", log_dir)
    # The second is started from a thread that ends once its child is up. The parent-death signal
    # follows the thread that forked: were the harness to fork on the caller's thread, this server
    # would die when that thread does.
    box: List[ManagedProcess] = []

    def start_then_end() -> None:
        box.append(_fake_server("fake-thread", log_dir))
        _wait_members([box[0]])  # its prctl has run: it is tied to whichever thread forked it

    t = threading.Thread(target=start_then_end)
    t.start()
    t.join()
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/self/task/{t.native_id}"):  # the kernel's exit of that thread
        if time.monotonic() > deadline:
            raise SystemExit("the starting thread did not exit within 10 s")
        time.sleep(0.01)
    procs = [first, *box]
    _wait_members(procs)
    return procs


def _fake_server(name: str, log_dir: Path) -> ManagedProcess:
    return ManagedProcess(name, [sys.executable, "-c", _FAKE_SERVER], os.environ, log_dir / f"{name}.log").start()


def _wait_members(procs: List[ManagedProcess]) -> None:
    deadline = time.monotonic() + 30
    while len(lifetime.group_members(p.pid for p in procs)) < 2 * len(procs):
        if time.monotonic() > deadline:
            raise SystemExit("the fake servers did not fork their children within 30 s")
        time.sleep(0.02)


class Probe:
    """The test's handle on a running probe (itself started by harness.lifetime, so that a killed
    test run leaves no probe either)."""

    def __init__(self, out: Path, args: Sequence[str], ready_s: float):
        argv = [sys.executable, "-m", "harness.lifetime_probe", "--out", str(out), *args]
        self.proc = lifetime.spawn(argv, env=harness_env(), stdin=subprocess.DEVNULL)
        self.pgids: List[int] = []
        deadline = time.monotonic() + ready_s
        while not out.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"the probe exited ({self.proc.returncode}) before it reported; logs "
                                   f"under {out.parent / 'probe-logs'}")
            if time.monotonic() > deadline:
                self.close()
                raise TimeoutError(f"the probe did not report within {ready_s:.0f} s")
            time.sleep(0.05)
        self.report = json.loads(out.read_text())
        self.pgids = self.report["pgids"]

    def members(self) -> Dict[int, str]:
        """{pid: command line} of every live process in the probe's children's groups."""
        return {pid: _cmdline(pid) for pid in lifetime.group_members(self.pgids)}

    def kill(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)
        self.proc.wait(timeout=60)  # SIGINT/SIGTERM: atexit ends the children first (bounded grace)
        lifetime.release(self.proc.pid)

    def left_after(self, deadline_s: float, pids: Sequence[int] = ()) -> Dict[int, str]:
        """What is still alive after waiting up to deadline_s for everything (or just `pids`) to end."""
        deadline = time.monotonic() + deadline_s
        while True:
            left = {pid: cmd for pid, cmd in self.members().items() if not pids or pid in pids}
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.05)

    def close(self) -> None:
        """End whatever is left (a failed test must not leave it running)."""
        for pgid in [self.proc.pid, *self.pgids]:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except OSError:
                pass
        self.proc.wait(timeout=30)
        lifetime.release(self.proc.pid)


def harness_env() -> Dict[str, str]:
    """This environment, with `harness` importable (pytest puts it on sys.path, not PYTHONPATH)."""
    paths = [str(Path(__file__).parent.parent), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:200]
    except OSError:
        return "?"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--tree", action="store_true")
    what.add_argument("--server", type=Path, metavar="MODEL_DIR")
    ap.add_argument("--linger-s", type=float, default=300.0)
    args = ap.parse_args()
    # Ctrl-C reaches a test run in a terminal as KeyboardInterrupt; a process started from a shell's
    # background job (a CI script run with `&`) inherits SIGINT ignored, and then never sees it.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    log_dir = args.out.parent / "probe-logs"
    if args.tree:
        stoppers = procs = _fake_servers(log_dir)
    else:
        server = Standalone(launch.ServerOptions(model_dir=args.server), log_dir, sleep_on_idle=True)
        server.start()
        server.wait_ready(300.0)
        procs, stoppers = list(server.procs.values()), [server]
    report = {"probe": os.getpid(), "watchdog": lifetime.watchdog_pid(), "pgids": [p.pid for p in procs]}
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(report))
    tmp.rename(args.out)
    time.sleep(args.linger_s)  # the test kills us here; nothing to synchronise with
    for s in stoppers:
        s.stop()
    return 3


if __name__ == "__main__":
    sys.exit(main())
