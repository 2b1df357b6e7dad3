"""Typed outcomes of MORI-IO writes, for the backend above `engine/`.

MORI reports a transfer's fate as an integer code plus a free-text message, and a dead peer as an
event object. Everything that interprets those (which codes are terminal, which failures leave the
peer usable, which prove that no byte can still land) lives here, so nothing above `engine/` parses
an error string or compares a magic number.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

# mori.io StatusCode values (docs/research/mori_io_and_peers.md §1.4).
SUCCESS, INIT, IN_PROGRESS = 0, 1, 2
ERR_INVALID_ARGS, ERR_NOT_FOUND, ERR_RDMA_OP, ERR_BAD_STATE, ERR_GPU_OP = 11, 12, 13, 14, 15
# Codes above this are failures.
_FIRST_ERROR = 10
# Terminal codes after which no byte of the transfer can land: it succeeded, was never posted
# (INIT), or was refused before posting (bad arguments, unknown memory/peer, no route).
DRAINED_CODES = (SUCCESS, INIT, ERR_INVALID_ARGS, ERR_NOT_FOUND, ERR_BAD_STATE)

# Submission-side failures that say nothing about the peer's health: MORI's send queue was still
# full after our backoff, or a post could not allocate. The request fails; the peer stays usable.
_TRANSIENT_MARKERS = ("SQ full", "ibv_post_send")
# The one failure worth resubmitting after a short backoff.
_RETRYABLE_MARKER = "SQ full"


def is_failure(code: int) -> bool:
    return code > _FIRST_ERROR


class WriteState(enum.Enum):
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


class FailureKind(enum.Enum):
    """Why a write failed; `metric_reason` is the bounded label the metrics use."""

    TIMED_OUT = "timed_out"  # still running at its deadline: we gave up on it
    REFUSED = "refused"  # refused before posting, or the submission raised part-way
    TRANSIENT = "transient"  # send-queue pressure: this request fails, the peer stays usable
    TRANSPORT = "transport"  # the connection to the peer broke (retry limit, QP error)

    @property
    def metric_reason(self) -> str:
        return {"timed_out": "timeout", "refused": "submit_error", "transient": "submit_error",
                "transport": "peer_dead"}[self.value]

    @property
    def breaks_peer(self) -> bool:
        """Whether rooms to the same peer should fail fast for a while."""
        return self is FailureKind.TRANSPORT


def classify_failure(code: int, message: str) -> FailureKind:
    """A failed status's code and message -> its kind."""
    if code in (INIT, ERR_INVALID_ARGS, ERR_NOT_FOUND, ERR_BAD_STATE):
        return FailureKind.REFUSED
    if any(marker in message for marker in _TRANSIENT_MARKERS):
        return FailureKind.TRANSIENT
    return FailureKind.TRANSPORT


def is_retryable(status) -> bool:
    """A failed status that a resubmission after a backoff may cure (MORI's SQ full)."""
    return bool(status.Failed()) and _RETRYABLE_MARKER in status.Message()


@dataclass(frozen=True)
class PeerFailure:
    """A remote engine the transport declared dead (MORI's pop_peer_failure event)."""

    engine_key: str
    reason: str

    @classmethod
    def from_event(cls, event) -> "PeerFailure":
        # MORI's event exposes these as attributes; softio mirrors them. Older builds may lack
        # `detail`, so read what is there and keep the rest readable.
        key = str(getattr(event, "remote_engine_key", "") or "")
        reason = " ".join(str(x) for x in (getattr(event, "reason", "?"), getattr(event, "detail", "")) if x)
        # The key goes into the reason: a room failed by this event must say which peer died.
        return cls(engine_key=key, reason=f"peer failure of {key or '?'} reported by the engine: {reason}")
