"""TransferStatus and WaitAll with MORI's lifecycle rules.

INIT -> IN_PROGRESS (set inside the submitting call) -> SUCCESS or an error code. `Update` never
replaces a failure (failures are sticky) but may replace a SUCCESS with a failure; `SetCode` writes
unconditionally. Engine threads complete statuses; waiters sleep on an Event that is only created
when somebody actually waits, so the common poll-only path costs one object and no lock.
"""

from __future__ import annotations

import threading
import time

from .enums import ERR_BEGIN, StatusCode

_SUCCESS = StatusCode.SUCCESS
_INIT = StatusCode.INIT
_IN_PROGRESS = StatusCode.IN_PROGRESS

# One lock for the rare transitions that need ordering with a waiter (creating the wake-up event,
# a terminal update). Uncontended in practice: it is held for a few attribute writes.
_TRANSITION_LOCK = threading.Lock()


class TransferStatus:
    __slots__ = ("_code", "_msg", "_event", "__weakref__")

    def __init__(self, _code=_INIT):
        self._code = _code  # `started`: IN_PROGRESS from birth, for a call that posts at once
        self._msg = ""
        self._event: threading.Event | None = None

    # ---- queries -------------------------------------------------------------------------------
    def Code(self) -> StatusCode:
        return self._code

    def Message(self) -> str:
        return self._msg

    def Init(self) -> bool:
        return self._code is _INIT

    def InProgress(self) -> bool:
        return self._code is _IN_PROGRESS

    def Succeeded(self) -> bool:
        return self._code is _SUCCESS

    def Failed(self) -> bool:
        return self._code > ERR_BEGIN

    # ---- updates -------------------------------------------------------------------------------
    def Update(self, code, message: str) -> None:
        code = StatusCode(code)
        with _TRANSITION_LOCK:
            if self._code > ERR_BEGIN:
                return
            self._msg = message
            self._code = code
            event = self._event
        if event is not None and code is not _IN_PROGRESS and code is not _INIT:
            event.set()

    def SetCode(self, code) -> None:
        code = StatusCode(code)
        with _TRANSITION_LOCK:
            self._code = code
            event = self._event
            if event is not None and (code is _IN_PROGRESS or code is _INIT):
                # Re-armed by the caller: a later waiter must sleep again.
                event.clear()
                event = None
        if event is not None:
            event.set()

    def SetMessage(self, message: str) -> None:
        self._msg = message

    # ---- waiting -------------------------------------------------------------------------------
    def Wait(self) -> None:
        self.WaitFor(-1)

    def WaitFor(self, timeout_ms: int = -1) -> StatusCode:
        code = self._code
        if code is not _IN_PROGRESS or timeout_ms == 0:
            return code
        with _TRANSITION_LOCK:
            if self._code is not _IN_PROGRESS:
                return self._code
            if self._event is None:
                self._event = threading.Event()
            event = self._event
        if timeout_ms < 0:
            while self._code is _IN_PROGRESS:
                event.wait(1.0)
            return self._code
        deadline = time.monotonic() + timeout_ms / 1000.0
        while self._code is _IN_PROGRESS:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            event.wait(remaining)
        return self._code

    def __repr__(self) -> str:
        return f"TransferStatus({self._code.name}, {self._msg!r})"

    # ---- engine side ---------------------------------------------------------------------------
    def _start(self) -> None:
        """Mark a freshly submitted transfer IN_PROGRESS (the backend does this synchronously).
        A status nobody waits on yet (no wake-up event) needs neither the lock nor SetCode's
        checks: one attribute write, since a batch starts one status per pair."""
        if self._event is None and self._code is _INIT:
            self._code = _IN_PROGRESS
        else:
            self.SetCode(_IN_PROGRESS)


def start_all(statuses) -> None:
    """_start() of statuses this call just created (nobody can wait on them yet)."""
    for status in statuses:
        status._start()


def started(count: int) -> list:
    """`count` new statuses, IN_PROGRESS: what start_all makes of fresh ones, for a call that
    creates its statuses only once it posts (device_routes.py), without a pass over them."""
    return [TransferStatus(_IN_PROGRESS) for _ in range(count)]


def succeed_all(statuses) -> None:
    """Update(SUCCESS, "") for every status of a finished batch, under one lock acquisition
    (a failure already recorded stays: failures are sticky)."""
    events = []
    with _TRANSITION_LOCK:
        for status in statuses:
            if status._code > ERR_BEGIN:
                continue
            status._msg = ""
            status._code = _SUCCESS
            if status._event is not None:
                events.append(status._event)
    for event in events:
        event.set()


def wait_all(statuses, timeout_ms: int = -1) -> StatusCode:
    """IOEngine::WaitAll: one deadline over the list, checked in list order."""
    if not statuses:
        return _SUCCESS
    if timeout_ms == 0:
        any_running = False
        for status in statuses:
            if status is None:
                continue
            rc = status.WaitFor(0)
            if rc is _IN_PROGRESS:
                any_running = True
            elif rc is not _SUCCESS:
                return rc  # failure wins over "still running"
        return _IN_PROGRESS if any_running else _SUCCESS
    if timeout_ms < 0:
        first_error = _SUCCESS
        for status in statuses:
            if status is None:
                continue
            rc = status.WaitFor(-1)
            if rc is not _SUCCESS and first_error is _SUCCESS:
                first_error = rc
        return first_error
    deadline = time.monotonic() + timeout_ms / 1000.0
    first_error = _SUCCESS
    for status in statuses:
        if status is None:
            continue
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return first_error if first_error is not _SUCCESS else _IN_PROGRESS
        rc = status.WaitFor(int(remaining * 1000.0))
        if rc is _IN_PROGRESS:
            return first_error if first_error is not _SUCCESS else _IN_PROGRESS
        if rc is not _SUCCESS and first_error is _SUCCESS:
            first_error = rc
    return first_error
