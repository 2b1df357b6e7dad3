"""A child process that we own completely: its own session, its own log file, stopped by process group.

Every SGLang server spawns children (scheduler, detokenizer) and the router spawns threads; starting
each in a new session lets us signal exactly that tree by its process-group id, and nothing else on
the machine. harness.lifetime starts it, so that the tree also dies with this process however that
one ends (killed test runs used to leave servers running).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

from harness import lifetime

_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")


class ManagedProcess:
    def __init__(self, name: str, argv: Sequence[str], env: Mapping[str, str], log_path: Path):
        self.name = name
        self.argv = list(argv)
        self.env = dict(env)
        self.log_path = Path(log_path)
        self.proc: Optional[subprocess.Popen] = None

    def start(self) -> "ManagedProcess":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        # Append: a restarted server keeps its earlier log above the new one, which helps post-mortems.
        log = open(self.log_path, "ab")
        log.write(f"\n===== start {self.name}: {' '.join(self.argv)}\n".encode())
        log.flush()
        try:
            self.proc = lifetime.spawn(
                self.argv,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        finally:
            log.close()  # the child holds its own descriptor
        return self

    @property
    def pid(self) -> Optional[int]:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def exit_code(self) -> Optional[int]:
        return None if self.proc is None else self.proc.poll()

    def _signal_group(self, sig: int) -> None:
        # Our child is the leader of its own session, so its pid is the process-group id.
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def kill_hard(self) -> None:
        """SIGKILL the whole group at once: a crash, as in the fault-injection test."""
        if self.proc is None:
            return
        self._signal_group(signal.SIGKILL)
        self.proc.wait(timeout=30)
        lifetime.release(self.proc.pid)

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the group, then SIGKILL whatever is left after grace_s. Safe to call twice."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        # Children (scheduler, detokenizer) may outlive the leader; clear the group either way.
        self._signal_group(signal.SIGKILL)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        lifetime.release(self.proc.pid)

    def terminate(self) -> None:
        """SIGTERM the group and return at once (stop() then waits for it)."""
        if self.proc is not None and self.proc.poll() is None:
            self._signal_group(signal.SIGTERM)

    def tail(self, lines: int = 60, width: int = 400) -> str:
        """The last lines of the log, each cut to `width` (SGLang logs its args as one huge line)."""
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return f"<no log at {self.log_path}>"
        # The router colours its log; escape codes only clutter a test report.
        plain = _ANSI_ESCAPE.sub("", text)
        cut = [ln if len(ln) <= width else ln[:width] + " ..." for ln in plain.splitlines()[-lines:]]
        return "\n".join(cut)


def stop_together(procs: Sequence[ManagedProcess], grace_s: float = 15.0) -> None:
    """Stop several processes in one grace period: SIGTERM them all, wait for all, then stop() each
    (SIGKILL of what is left, reap, release). An SGLang server takes seconds to exit after SIGTERM;
    one after another, a deployment's servers took 15-25 s to stop."""
    for p in procs:
        p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        if p.proc is not None:
            try:
                p.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
    for p in procs:
        p.stop(grace_s=0.0)


def wait_until(
    predicate: Callable[[], bool],
    deadline_s: float,
    what: str,
    interval_s: float = 0.5,
    alive: Optional[Callable[[], bool]] = None,
    progress: Optional[Callable[[float], None]] = None,
) -> float:
    """Poll predicate until true; return the seconds it took, or raise TimeoutError at the deadline.

    `alive` is checked on every round so that a process that died during start-up fails at once with
    a clear message instead of after the full deadline. `progress(elapsed)` is called each round.
    """
    start = time.monotonic()
    while True:
        if predicate():
            return time.monotonic() - start
        elapsed = time.monotonic() - start
        if alive is not None and not alive():
            raise RuntimeError(f"{what}: process exited before it was ready ({elapsed:.1f} s)")
        if elapsed > deadline_s:
            raise TimeoutError(f"{what}: not ready after {deadline_s:.0f} s")
        if progress is not None:
            progress(elapsed)
        time.sleep(interval_s)
