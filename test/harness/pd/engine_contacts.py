"""Which engines a rank's softio engine has been in contact with, read from the engine itself
after the rooms ran (our backend on softio only; None elsewhere).

softio dials a peer only on first contact (a session or a write), and its target keeps every
inbound connection by the initiator's engine key, so:

- a prefill rank's `sessions` are the decode engines it opened a session to;
- a decode rank's `inbound` are the prefill engines that connected to it.

Tests use these to show that a prefill rank that has nothing to send (an MLA dummy rank) never
touched a decode engine, from both ends.
"""

from __future__ import annotations

from typing import Optional


def _softio_backend(mgr):
    wrapper = getattr(mgr, "engine", None)
    inner = getattr(wrapper, "engine", None)
    core = getattr(inner, "_core", None)
    if core is None or not type(core).__module__.startswith("sglang_mori.softio"):
        return None, None
    backends = list(getattr(core, "backends", {}).values())
    return core, (backends[0] if backends else None)


def engine_contacts(mgr) -> Optional[dict]:
    """{"key": this engine, "sessions": [remote keys with a session], "inbound": [initiator keys
    connected to it]}, or None when the engine is not softio."""
    core, backend = _softio_backend(mgr)
    if core is None:
        return None
    sessions, inbound = set(), set()
    if backend is not None:
        sessions = {key[0] for key in list(backend._sessions)}  # (remote key, local id, remote id)
        with backend.server._lock:
            inbound = set(backend.server._inbound)
    return {"key": core.key, "sessions": sorted(sessions), "inbound": sorted(inbound)}
