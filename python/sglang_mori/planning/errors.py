"""Errors raised by the planner.

They are split by *when* the backend meets them, because it reacts differently:

- at registration (a peer announces its layout): `LayoutMismatchError`, `UnsupportedLayoutError`,
  `InvalidLayoutError` -> refuse the peer with the message, before any request depends on it;
- per chunk: `PlanError` -> fail that one request, never the process.

All derive from ValueError, so a caller that does not care can catch one type.
"""

from __future__ import annotations


class PlanningError(ValueError):
    """Base class of every planner error."""


class PlanError(PlanningError):
    """A chunk cannot be planned (bad indices, out of range): fail the request that sent them."""


class LayoutMismatchError(PlanningError):
    """Prefill and decode describe KV layouts that cannot exchange bytes; names both values."""


class UnsupportedLayoutError(PlanningError):
    """A layout (state type, TP split, ...) this backend does not transfer; names what and why."""


class InvalidLayoutError(PlanningError):
    """A layout description that contradicts itself (e.g. fewer lengths than buffers)."""


def mismatch(field: str, prefill: object, decode: object, why: str = "") -> LayoutMismatchError:
    """Build the one message shape operators grep for: `field: prefill=X decode=Y`."""
    suffix = f" ({why})" if why else ""
    return LayoutMismatchError(f"{field}: prefill={prefill} decode={decode}{suffix}")
