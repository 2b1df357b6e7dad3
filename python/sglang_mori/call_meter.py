"""Our Python per request, counted inside a real SGLang server (SGLANG_MORI_CALL_METER=<folder>).

Issue 28's goals count the scheduler process's CPU in our code per request: SGLang's calls into our
objects (sender and receiver construction, init, send, poll, clear, failure paths, the manager's
methods, the layer-wise hooks) plus every thread of ours. `bench hotpath` counts that in a rig; this
counts it in the server itself:

- every public method (and `__init__`) that SGLang can reach on our four classes, inherited ones
  included, is wrapped on OUR subclass (SGLang's own classes stay untouched) and timed with the
  calling thread's CPU clock; only the outermost call of a thread counts (a sender's poll that calls
  the manager's check_status is one call), and calls made on our own threads are left out (their
  thread's whole CPU is counted below);
- our own methods reached inside such a call (e.g. the manager's add_transfer_request inside SGLang's
  inherited `send`) are also timed apart, as `inner` figures that are already inside their outer call:
  what part of a call is our code and what part SGLang's inherited code;
- the layer-wise hooks count their own work, not the SGLang function they wrap (its time is
  subtracted);
- our threads' CPU (names starting `mori-`; softio's `softio-*` apart: the engine's stand-in) is read
  with each thread's CPU clock; a thread that ended keeps its last reading.

A daemon thread (`meter-call-writer`, its own CPU left out) writes one cumulative JSON snapshot per
scheduler process every 0.5 s to <folder>/<role>-<pid>.json (atomically: it survives any shutdown,
the last one up to 0.5 s old); `per_request(before, after)` turns two snapshots into figures per
request, requests being senders built (prefill) or receivers built (decode). Off (unset): nothing is
wrapped and no thread starts. On, each wrapped call costs about 1-5 us more (two reads of the thread
CPU clock, a system call, and the book-keeping); what one read costs inside the timed window is
measured at start (`clock_ns`) and taken off every call's figure.
"""

from __future__ import annotations

import functools
import json
import os
import re
import threading
import time
from typing import Callable, Dict, Iterable, Optional

PERIOD_S = 0.5
WRITER = "meter-call-writer"
OURS = re.compile(r"^mori-")
ENGINE = re.compile(r"^softio-")
# the class whose construction is one request, by the process's role
REQUEST_CLASS = {"prefill": "MoriKVSender", "decode": "MoriKVReceiver"}


def role_of(thread_name: str) -> str:
    """'mori-shard-3' -> 'mori-shard-N': threads of one role are summed."""
    return re.sub(r"\d+", "N", thread_name)


class Meter:
    def __init__(self, folder: str):
        self.folder = folder
        self.role = "unknown"
        self.calls: Dict[str, list] = {}  # "Class.method" -> [count, ns]
        self.callers: Dict[str, int] = {}  # calling thread role -> ns
        # our own methods reached inside an outer call ("what in send costs"): informational, inside
        # the outer call's figure already, never added to the totals
        self.inner: Dict[str, list] = {}
        self.thread_ns: Dict[int, tuple] = {}  # ident -> (role, last ns)
        self._local = threading.local()
        self._lock = threading.Lock()
        self._writer: Optional[threading.Thread] = None
        self.clock_ns = self._calibrate()
        self.inner_ns = self._calibrate_inner()

    # --- timing -----------------------------------------------------------------------------
    def _ours(self) -> bool:
        """Whether the calling thread is one of ours (decided once per thread: a name is set at start)."""
        ours = getattr(self._local, "ours", None)
        if ours is None:
            name = threading.current_thread().name
            ours = self._local.ours = bool(OURS.match(name) or ENGINE.match(name)) or name == WRITER
        return ours

    def _add(self, key: str, ns: int, inner_n: int = 0) -> None:
        caller = getattr(self._local, "role", None)
        if caller is None:
            caller = self._local.role = role_of(threading.current_thread().name)
        with self._lock:
            entry = self.calls.setdefault(key, [0, 0, 0])  # calls, ns, inner calls timed inside them
            entry[0] += 1
            entry[1] += ns
            entry[2] += inner_n
            self.callers[caller] = self.callers.get(caller, 0) + ns

    def _add_inner(self, key: str, ns: int) -> None:
        with self._lock:
            entry = self.inner.setdefault(key, [0, 0])
            entry[0] += 1
            entry[1] += ns

    def timed(self, key: str, fn: Callable) -> Callable:
        meter = self
        ours = getattr(fn, "__module__", "").startswith("sglang_mori")  # not inherited SGLang code

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            local = meter._local
            depth = getattr(local, "depth", 0)
            if depth and ours and not meter._ours():  # our code inside SGLang's call: timed apart
                local.depth = depth + 1
                local.inner_n = getattr(local, "inner_n", 0) + 1  # its cost to the outer call is taken off
                start = time.thread_time_ns()
                try:
                    return fn(*args, **kwargs)
                finally:
                    meter._add_inner(key, time.thread_time_ns() - start)
                    local.depth = depth
            if depth or meter._ours():
                return fn(*args, **kwargs)
            local.depth = 1
            local.inner_n = 0
            start = time.thread_time_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                local.depth = 0
                meter._add(key, time.thread_time_ns() - start, local.inner_n)

        wrapper.__sglang_mori_metered__ = True
        return wrapper

    def hook(self, key: str, hook_fn: Callable, original: Callable, *args, **kwargs):
        """An AROUND hook's own CPU: its call minus the SGLang function it wraps (the forward)."""
        if getattr(self._local, "depth", 0) or self._ours():
            return hook_fn(original, *args, **kwargs)
        inside = [0]

        def timed_original(*a, **k):
            self._local.depth = 0  # our calls made from inside SGLang's function count on their own
            t0 = time.thread_time_ns()
            try:
                return original(*a, **k)
            finally:
                inside[0] += time.thread_time_ns() - t0
                self._local.depth = 1

        self._local.depth = 1
        start = time.thread_time_ns()
        try:
            return hook_fn(timed_original, *args, **kwargs)
        finally:
            self._local.depth = 0
            self._add(key, time.thread_time_ns() - start - inside[0])

    def _calibrate(self, batches: int = 5, calls: int = 400) -> int:
        """What one timed call counts of the meter itself (two reads of the thread CPU clock, a system
        call, and the wrapper between them): a no-op timed through the same path, the lowest of a few
        batches' means. per_request() takes it off every call, so the figures hold our code."""
        if self._ours():
            return 0
        noop = self.timed("calibration", lambda: None)
        means = []
        for _ in range(batches):
            for _ in range(calls):
                noop()
            with self._lock:
                n, ns, _ = self.calls.pop("calibration")
                self.callers.clear()
            means.append(ns // n)
        return min(means)

    def _calibrate_inner(self, batches: int = 5, calls: int = 400) -> int:
        """What timing one inner call adds to its outer call (its clock reads and book-keeping): an outer
        no-op calling an inner one, against the outer no-op alone (clock_ns)."""
        if self._ours():
            return 0
        inner = self.timed("calibration-inner", _noop)
        outer = self.timed("calibration", lambda: inner())
        means = []
        for _ in range(batches):
            for _ in range(calls):
                outer()
            with self._lock:
                n, ns, _ = self.calls.pop("calibration")
                self.inner.pop("calibration-inner", None)
                self.callers.clear()
            means.append(ns // n)
        return max(0, min(means) - self.clock_ns)

    # --- wrapping ---------------------------------------------------------------------------
    def wrap_class(self, cls) -> None:
        """Wrap every public method SGLang can call on `cls` (its own and inherited), on `cls` only."""
        if cls.__dict__.get("__sglang_mori_metered__"):
            return
        for name in method_names(cls):
            fn = getattr(cls, name)
            setattr(cls, name, self.timed(f"{cls.__name__}.{name}", fn))
        if cls.__name__ == "MoriKVManager":
            init = cls.__init__

            @functools.wraps(init)
            def init_and_start(manager, *args, **kwargs):
                init(manager, *args, **kwargs)
                self.start(getattr(manager, "role", "unknown"))  # our manager's own field

            cls.__init__ = init_and_start
        cls.__sglang_mori_metered__ = True

    # --- threads and snapshots --------------------------------------------------------------
    def read_threads(self) -> None:
        for t in threading.enumerate():
            if t.name == WRITER or not (OURS.match(t.name) or ENGINE.match(t.name)):
                continue
            try:
                ns = time.clock_gettime_ns(time.pthread_getcpuclockid(t.ident))
            except (OSError, TypeError, ProcessLookupError):  # ended meanwhile
                continue
            self.thread_ns[t.ident] = (role_of(t.name), ns)

    def snapshot(self) -> Dict:
        self.read_threads()
        threads: Dict[str, int] = {}
        for role, ns in self.thread_ns.values():
            threads[role] = threads.get(role, 0) + ns
        with self._lock:
            calls = {k: list(v) for k, v in self.calls.items()}
            inner = {k: list(v) for k, v in self.inner.items()}
            callers = dict(self.callers)
        requests = calls.get(f"{REQUEST_CLASS.get(self.role, '?')}.__init__", [0, 0])[0]
        return {"pid": os.getpid(), "role": self.role, "time": time.time(), "requests": requests,
                "clock_ns": self.clock_ns, "inner_ns": self.inner_ns,
                "calls": calls, "inner": inner, "callers": callers, "threads": threads}

    def write(self) -> None:
        path = os.path.join(self.folder, f"{self.role}-{os.getpid()}.json")
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.snapshot(), f)
        os.replace(tmp, path)

    def start(self, role: str) -> None:
        """Called when the manager is built (the scheduler process): snapshots from now on."""
        self.role = role
        if self._writer is not None:
            return
        os.makedirs(self.folder, exist_ok=True)

        def loop():
            while True:
                try:
                    self.write()
                except OSError:
                    pass  # a full or removed folder: the figures are lost, never the server
                time.sleep(PERIOD_S)

        self._writer = threading.Thread(target=loop, name=WRITER, daemon=True)
        self._writer.start()


def _noop() -> None:
    """An inner call for the calibration (defined here: its module is ours)."""


def method_names(cls) -> Iterable[str]:
    """Public methods of `cls` and its bases (not object's), plus __init__."""
    seen = set()
    for klass in cls.__mro__:
        if klass is object:
            continue
        for name, value in vars(klass).items():
            if name in seen or not callable(value) or isinstance(value, (staticmethod, classmethod, type)):
                continue
            if name == "__init__" or not name.startswith("_"):
                seen.add(name)
    return sorted(seen)


_METER: Optional[Meter] = None


def folder_from_env(environ=None) -> str:
    from sglang_mori.config import ConfigError, MoriConfig

    try:
        return MoriConfig.from_env(os.environ if environ is None else environ).call_meter
    except ConfigError:
        return ""


def meter(environ=None) -> Optional[Meter]:
    """The process's meter when SGLANG_MORI_CALL_METER names a folder, else None."""
    global _METER
    if _METER is None:
        folder = folder_from_env(environ)
        if folder:
            _METER = Meter(folder)
    return _METER


# --- the rig's side: snapshots to figures per request ----------------------------------------

def read_snapshots(folder) -> Dict[str, Dict]:
    """{file stem: snapshot} of every scheduler process that wrote one."""
    out = {}
    try:
        names = sorted(os.listdir(folder))
    except FileNotFoundError:
        return out
    for name in names:
        if name.endswith(".json"):
            try:
                with open(os.path.join(folder, name)) as f:
                    out[name[:-5]] = json.load(f)
            except (OSError, ValueError):
                continue
    return out


def wait_fresh(folder, after: float, timeout_s: float = 3.0) -> Dict[str, Dict]:
    """Snapshots all written after `after` (time.time()), or what is there at the timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        snaps = read_snapshots(folder)
        if snaps and all(s["time"] >= after for s in snaps.values()) or time.monotonic() > deadline:
            return snaps
        time.sleep(0.1)


def _counts(after: Dict, before: Dict, field: str) -> Dict:
    """(calls, ns, inner calls) per key between two snapshots (older snapshots lack the third)."""
    b = before.get(field, {})
    out = {}
    for k, v in after.get(field, {}).items():
        v, w = list(v) + [0] * (3 - len(v)), list(b.get(k, [])) + [0] * (3 - len(b.get(k, [])))
        out[k] = (v[0] - w[0], v[1] - w[1], v[2] - w[2])
    return out


def _delta(after: Dict, before: Dict) -> Dict:
    calls = _counts(after, before, "calls")
    inner = _counts(after, before, "inner")
    b_thr = before.get("threads", {})
    threads = {k: v - b_thr.get(k, 0) for k, v in after.get("threads", {}).items()}
    clock = after.get("clock_ns", 0)  # the meter's own share of each call, taken off
    nested = after.get("inner_ns", 0)  # what timing an inner call added to its outer one, taken off too
    calls = {k: (n, max(0, ns - n * clock - i * nested)) for k, (n, ns, i) in calls.items()}
    inner = {k: (n, max(0, ns - n * clock)) for k, (n, ns, _) in inner.items()}
    return {"requests": after.get("requests", 0) - before.get("requests", 0), "calls": calls, "inner": inner,
            "threads": threads}


def per_request(before: Dict[str, Dict], after: Dict[str, Dict]) -> Dict[str, Dict]:
    """{role: figures} between two read_snapshots(): microseconds per request (the role's processes
    summed, divided by the requests they counted, so a TP rank is one process's figure)."""
    by_role: Dict[str, Dict] = {}
    for stem, snap in after.items():
        d = _delta(snap, before.get(stem, {}))
        r = by_role.setdefault(snap["role"], {"requests": 0, "calls": {}, "inner": {}, "threads": {}, "processes": 0})
        r["processes"] += 1
        r["requests"] += d["requests"]
        for field in ("calls", "inner"):
            for k, (n, ns) in d[field].items():
                c = r[field].setdefault(k, [0, 0])
                c[0] += n
                c[1] += ns
        for k, ns in d["threads"].items():
            r["threads"][k] = r["threads"].get(k, 0) + ns
    out = {}
    for role, r in by_role.items():
        n = r["requests"]
        if not n:
            out[role] = {"requests": 0, "processes": r["processes"]}
            continue
        us = lambda ns: round(ns / n / 1000, 1)  # noqa: E731
        calls = {k: us(ns) for k, (c, ns) in sorted(r["calls"].items(), key=lambda kv: -kv[1][1]) if c}
        ours = {k: us(ns) for k, ns in r["threads"].items() if OURS.match(k)}
        engine = {k: us(ns) for k, ns in r["threads"].items() if ENGINE.match(k)}
        calls_us = us(sum(ns for _, ns in r["calls"].values()))
        threads_us = us(sum(ns for k, ns in r["threads"].items() if OURS.match(k)))
        out[role] = {"requests": n, "processes": r["processes"], "scheduler_calls_us": calls_us,
                     "our_threads_us": threads_us, "total_us": round(calls_us + threads_us, 1),
                     "engine_threads_us": us(sum(ns for k, ns in r["threads"].items() if ENGINE.match(k))),
                     "calls_us": calls, "threads_us": ours, "engine_us": engine,
                     "calls_per_request": {k: round(c / n, 2) for k, (c, _) in r["calls"].items() if c},
                     # our own methods inside those calls (already in them): us per request, calls per request
                     "inner_us": {k: us(ns) for k, (c, ns) in sorted(r["inner"].items(), key=lambda kv: -kv[1][1]) if c},
                     "inner_per_request": {k: round(c / n, 2) for k, (c, _) in r["inner"].items() if c}}
    return out


def describe(figures: Dict[str, Dict]) -> str:
    """One line: each role's total = calls + threads per request, and its three largest calls."""
    parts = []
    for role in ("prefill", "decode"):
        f = figures.get(role)
        if not f or not f.get("requests"):
            continue
        top = ", ".join(f"{k.split('.', 1)[1]} {v}" for k, v in list(f["calls_us"].items())[:3])
        parts.append(f"{role} {f['total_us']} us/req = calls {f['scheduler_calls_us']} ({top}) + threads "
                     f"{f['our_threads_us']} [{f['requests']} req]")
    return "; ".join(parts) or "no requests metered"
