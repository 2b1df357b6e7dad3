"""The device path's fast route through `batch_write` (issue 28): a call whose pairs are all open
device sessions of one engine stream, all writing the same offset arrays (what the backend's
plans pass: one array per chunk shared by every layer's buffer), is posted with no Python per
pair beyond creating its status.

The route of each distinct list of (local, remote) descriptors is resolved once, by the general
path's rules (EngineCore.batch_transfer: the RDMA backend's cached session of each pair), and kept
while the backend's sessions are unchanged (`SoftRdmaBackend.sessions_generation`: a dropped or
released session bumps it). A cache entry holds the descriptor objects it was built from, so the
ids it is keyed by cannot be reused by other objects while it lives.

Anything else (a read, per-pair arrays, a pair not yet opened, a host session, a range out of
bounds, an empty range, a mapping already released) returns False before any status changed,
and the general path handles the call as before: this route only ever skips work, never a check.
On MORI-IO the same call is C++ that releases the GIL; softio's Python stands in for it.
"""

from __future__ import annotations

import itertools
import operator

import numpy as np

from .descriptors import MemoryDesc
from .device_path import DeviceSession
from .enums import BackendType
from .remote_mapping import begin_all
from .status import started

_MAX_ROUTES = 256  # distinct descriptor lists kept (chunk plans per peer); cleared when full
_SPARE_STATUS_COUNTS = 8  # call sizes (pairs per call) with a list of spare statuses stocked
# Per call, on the way to the device submit (issue 28): the ufuncs' reductions without the
# ndarray methods' Python wrappers, and "every entry is this very object" as one C-level pass.
_min = np.minimum.reduce
_max = np.maximum.reduce
_is = operator.is_
_repeat = itertools.repeat


def _all_are(items: list, first) -> bool:
    """Every entry of `items` is `first` itself (identity, never equality)."""
    return all(map(_is, items, _repeat(first)))


class _Route:
    __slots__ = ("generation", "backend", "descs", "engine", "local_ptr", "remote_base", "local_limit",
                 "remote_limit", "to_peer", "mappings")

    def __init__(self, generation, backend, descs, sessions):
        self.generation = generation
        self.backend = backend
        self.descs = descs  # kept alive: the key's ids stay theirs
        self.engine = sessions[0].engine
        self.local_ptr = np.array([s.local.ptr for s in sessions], dtype=np.int64)
        self.remote_base = np.array([s.remote_base for s in sessions], dtype=np.int64)
        self.local_limit = min(s.local.size for s in sessions)
        self.remote_limit = min(s.remote_size for s in sessions)
        self.to_peer = any(s.to_peer for s in sessions)
        self.mappings = tuple(dict.fromkeys(s.mapping for s in sessions if s.mapping is not None))


class DeviceRoutes:
    def __init__(self, core):
        self.core = core
        self._routes: dict = {}
        # A list of fresh statuses (IN_PROGRESS, never handed out) per call size, made after a
        # post for the next post of that size, so that a call of 61 pairs does not build its 61
        # status objects between its entry and its device submit (issue 28: softio's Python
        # before the submit). Each list is taken whole (dict.pop: one thread gets it); a list
        # two threads stocked at once loses one of them, which nothing requires.
        self._spare: dict = {}

    def post(self, locals_, local_offsets, remotes, remote_offsets, sizes, is_read: bool):
        """Post the whole call by the fast route: its statuses (one per pair, IN_PROGRESS), or
        None, nothing done, where the route does not apply."""
        if is_read:
            return None
        lo, ro, sz = local_offsets[0], remote_offsets[0], sizes[0]
        if not (type(lo) is np.ndarray and type(ro) is np.ndarray and type(sz) is np.ndarray):
            return None
        if not (_all_are(local_offsets, lo) and _all_are(remote_offsets, ro) and _all_are(sizes, sz)):
            return None
        if lo.ndim != 1 or lo.shape != ro.shape or lo.shape != sz.shape or len(sz) == 0:
            return None
        backend = self.core.backends.get(BackendType.RDMA)
        if backend is None:
            return None
        key = (tuple(map(id, locals_)), tuple(map(id, remotes)))
        route = self._routes.get(key)
        if route is None or route.generation != backend.sessions_generation or route.backend is not backend:
            route = self._resolve(backend, locals_, remotes)
            if route is None:
                return None
            if len(self._routes) >= _MAX_ROUTES:
                self._routes.clear()
            self._routes[key] = route
        count = len(sizes)
        statuses = self._spare.pop(count, None)
        if statuses is None:
            statuses = started(count)
        if not _post(route, lo, ro, sz, statuses):
            if count not in self._spare:
                self._spare[count] = statuses  # still fresh: nobody saw them
            return None
        self._stock(count)  # after the submit: the copies run meanwhile
        return statuses

    def _stock(self, count: int) -> None:
        spare = self._spare
        if count not in spare and len(spare) < _SPARE_STATUS_COUNTS:
            spare[count] = started(count)

    @staticmethod
    def _resolve(backend, locals_, remotes):
        """The route of these pairs if every one is an open device session of one engine, else None."""
        generation = backend.sessions_generation  # read first: a later change makes the route stale
        sessions = []
        for local, remote in zip(locals_, remotes):
            if not isinstance(local, MemoryDesc) or not isinstance(remote, MemoryDesc):
                return None
            if not backend.can_handle(remote):
                return None
            session = backend._sessions.get((remote._engine_key, local._id, remote._id))
            if type(session) is not DeviceSession:
                return None
            sessions.append(session)
        if not sessions or any(s.engine is not sessions[0].engine for s in sessions):
            return None
        return _Route(generation, backend, (tuple(locals_), tuple(remotes)), sessions)


def _post(route: _Route, lo: np.ndarray, ro: np.ndarray, sz: np.ndarray, statuses: list) -> bool:
    """Post the call's copies, completing `statuses` (fresh, IN_PROGRESS, one per pair) when
    they are done; True once posted; False, nothing done and `statuses` untouched, where the
    general path must handle the call."""
    lo = lo.astype(np.int64, copy=False)
    ro = ro.astype(np.int64, copy=False)
    sz = sz.astype(np.int64, copy=False)
    if _min(sz) <= 0 or _min(lo) < 0 or _min(ro) < 0:
        return False
    if _max(lo + sz) > route.local_limit or _max(ro + sz) > route.remote_limit:
        return False
    if not begin_all(route.mappings):
        return False  # one is released: the general path fails those pairs one by one
    # The table is built by the engine, for all pairs at once, where its copies read it.
    route.engine.submit_shared(route.remote_base, route.local_ptr, ro, lo, sz, list(statuses), route.to_peer,
                               route.mappings)
    return True
