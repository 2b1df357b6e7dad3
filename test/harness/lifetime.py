"""Every process the harness starts dies with the process that started it, however that one ends.

A test run that is killed (a timeout, Ctrl-C, SIGTERM from CI, SIGKILL) must not leave SGLang
servers spinning on the host's cores. Each child is started by `spawn()`:

- in its own session, so that its process group holds it and everything it forks (SGLang's
  scheduler and detokenizer; nothing in SGLang calls setsid), and one `killpg` ends all of it;
- registered with a watchdog: a small process in a session of its own that reads its stdin, a pipe
  whose only writer is this process. The kernel closes that pipe when this process ends for any
  reason, SIGKILL and os._exit included; the watchdog then reads EOF and ends every group still
  registered (SIGTERM, a short grace, SIGKILL). Being in its own session, a Ctrl-C on the terminal
  or a kill of this process's group does not reach it. This also covers SIGTERM without a handler
  here: its default action ends this process, which closes the pipe.
- under the parent-death signal (prctl PR_SET_PDEATHSIG, SIGKILL), the second line of defence if the
  watchdog is gone too. It is set by a small exec wrapper (no preexec_fn, which is unsafe while
  other threads run) that then checks its parent is still the one that started it. The kernel
  sends it when the *thread* that forked the child ends, so children are forked on the main thread
  or on a daemon thread kept for that purpose, never on a short-lived worker thread. It reaches the
  group leader only; SGLang's scheduler and detokenizer set the same signal on their own parent
  (sglang.srt.utils.common.kill_itself_when_parent_died), so the tree follows.

A normal exit with groups still registered ends them synchronously in an atexit hook, so that
nothing outlives a script that forgot to stop its servers. `release()` forgets a group that its
owner has already ended (ManagedProcess.stop does it), so that its id, once reused, is never hit.
"""

from __future__ import annotations

import atexit
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, Dict, Iterable, List, Optional, Sequence, TypeVar

T = TypeVar("T")

END_GRACE_S = 5.0

# argv[1]: the pid that must still be our parent after prctl (else it died first: exit at once);
# argv[2:]: the command to exec, which keeps our pid, our session and the parent-death signal.
_EXEC_WITH_PDEATHSIG = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None).prctl(1, signal.SIGKILL)\n"  # 1 = PR_SET_PDEATHSIG
    "if os.getppid() != int(sys.argv[1]):\n"
    "    os._exit(70)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)

# Reads "+pgid" / "-pgid" lines until EOF, then ends the groups left. Stdlib only, no site: starts fast.
_WATCHDOG = (
    "import os, signal, sys, time\n"
    "for s in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):\n"
    "    signal.signal(s, signal.SIG_IGN)\n"
    "groups = set()\n"
    "for line in sys.stdin:\n"
    "    (groups.add if line[0] == '+' else groups.discard)(int(line[1:]))\n"
    "def signal_all(sig):\n"
    "    left = set()\n"
    "    for g in groups:\n"
    "        try:\n"
    "            os.killpg(g, sig)\n"
    "            left.add(g)\n"
    "        except OSError:\n"
    "            pass\n"
    "    return left\n"
    "groups = signal_all(signal.SIGTERM)\n"
    "deadline = time.monotonic() + float(sys.argv[1])\n"
    "while groups and time.monotonic() < deadline:\n"
    "    time.sleep(0.1)\n"
    "    groups = signal_all(0)\n"
    "signal_all(signal.SIGKILL)\n"
)


def group_members(pgids: Iterable[int]) -> Dict[int, int]:
    """{pid: pgid} of every live (non-zombie) process on this host in one of `pgids`, from /proc."""
    wanted = set(pgids)
    found: Dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # gone meanwhile
        # Fields after the command name (which may hold spaces): state ppid pgrp ...
        state, _ppid, pgrp = stat.rsplit(")", 1)[1].split()[:3]
        if int(pgrp) in wanted and state != "Z":
            found[int(entry)] = int(pgrp)
    return found


class _Watchdog:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: Optional[subprocess.Popen] = None

    def start(self) -> None:
        with self._lock:
            self._start_locked()

    def _start_locked(self) -> None:
        if self._proc is None:
            # Forked on the caller's thread: the watchdog carries no parent-death signal.
            self._proc = subprocess.Popen(
                [sys.executable, "-S", "-E", "-c", _WATCHDOG, str(END_GRACE_S)],
                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True, close_fds=True)

    def tell(self, line: str) -> None:
        with self._lock:
            self._start_locked()
            try:
                os.write(self._proc.stdin.fileno(), line.encode())
            except (OSError, ValueError):
                pass  # the watchdog died (or was closed at exit); the parent-death signal remains

    def close(self) -> None:
        """EOF now: with no group left to end, the watchdog exits at once; reap it."""
        with self._lock:
            if self._proc is not None:
                self._proc.stdin.close()
                try:
                    self._proc.wait(timeout=END_GRACE_S + 5)
                except subprocess.TimeoutExpired:
                    pass

    @property
    def pid(self) -> Optional[int]:
        return self._proc.pid if self._proc else None


class _Forker:
    """Runs a fork on a thread that lives as long as the process (see the module docstring)."""

    def __init__(self) -> None:
        self._jobs: "queue.SimpleQueue" = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()

    def run(self, fn: Callable[[], T]) -> T:
        if threading.current_thread() is threading.main_thread():
            return fn()
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="harness-forker", daemon=True)
                self._thread.start()
        box: List[object] = []
        done = threading.Event()
        self._jobs.put((fn, box, done))
        done.wait()
        ok, value = box
        if not ok:
            raise value
        return value

    def _serve(self) -> None:
        while True:
            fn, box, done = self._jobs.get()
            try:
                box.extend((True, fn()))
            except BaseException as exc:  # handed to the caller
                box.extend((False, exc))
            done.set()


_watchdog = _Watchdog()
_forker = _Forker()
_live: Dict[int, Optional[subprocess.Popen]] = {}
_live_lock = threading.Lock()
_atexit_installed = False


def adopt(pgid: int, proc: Optional[subprocess.Popen] = None) -> None:
    """End group `pgid` with this process from now on (e.g. servers a detached launcher left)."""
    global _atexit_installed
    with _live_lock:
        _live[pgid] = proc
        if not _atexit_installed:
            atexit.register(_at_exit)
            _atexit_installed = True
    _watchdog.tell(f"+{pgid}\n")


def release(pgid: int) -> None:
    """Forget group `pgid`: its owner has ended it."""
    with _live_lock:
        _live.pop(pgid, None)
    _watchdog.tell(f"-{pgid}\n")


def spawn(argv: Sequence[str], **popen_kwargs) -> subprocess.Popen:
    """subprocess.Popen(argv) in a new session, tied to this process's life; its pid is its pgid."""
    if "start_new_session" in popen_kwargs or "preexec_fn" in popen_kwargs:
        raise ValueError("spawn() sets the session itself")
    # The wrapper would fail to exec a missing program only in the child: say so here, as Popen would.
    env_path = (popen_kwargs.get("env") or os.environ).get("PATH")
    if shutil.which(argv[0], path=env_path) is None:
        raise FileNotFoundError(f"no program {argv[0]!r} on PATH")
    wrapped = [sys.executable, "-S", "-E", "-c", _EXEC_WITH_PDEATHSIG, str(os.getpid()), *argv]
    # The watchdog starts before the child, so no child exists that it does not know of.
    _watchdog.start()
    proc = _forker.run(lambda: subprocess.Popen(wrapped, start_new_session=True, **popen_kwargs))
    adopt(proc.pid, proc)
    return proc


def end_all(grace_s: float = END_GRACE_S) -> None:
    """SIGTERM every registered group, wait up to grace_s for them to empty, SIGKILL what is left."""
    with _live_lock:
        groups = dict(_live)
    if not groups:
        return
    for pgid in groups:
        _killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in groups.values():
        if proc is not None:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
    while group_members(groups) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pgid in groups:
        _killpg(pgid, signal.SIGKILL)
        release(pgid)


def _at_exit() -> None:
    end_all()
    _watchdog.close()


def watchdog_pid() -> Optional[int]:
    return _watchdog.pid


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
