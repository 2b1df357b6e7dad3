"""Engine and backend configuration objects, and the environment overrides MORI applies to them.

The constructors take the same positional order and defaults as the pybind11 bindings of
amd-mori 1.2.4, because SGLang builds `RdmaBackendConfig` positionally.
"""

from __future__ import annotations

import dataclasses
import os

from .enums import PollCqMode


class IOEngineConfig:
    def __init__(self, host: str = "", port: int = 0):
        self.host = host
        self.port = port

    def __repr__(self) -> str:
        return f"IOEngineConfig(host={self.host!r}, port={self.port})"


class BackendConfig:
    """Base class, as in the bindings; never instantiated on its own."""


class RdmaBackendConfig(BackendConfig):
    def __init__(
        self,
        qp_per_transfer: int = 1,
        post_batch_size: int = -1,
        num_worker_threads: int = -1,
        poll_cq_mode: PollCqMode = PollCqMode.POLLING,
        enable_notification: bool = True,
        notif_per_qp: int = 1024,
        enable_transfer_chunking: bool = False,
        chunk_bytes: int = 65536,
        max_chunks_per_transfer: int = 64,
        num_nics_per_transfer: int = 1,
    ):
        self.qp_per_transfer = qp_per_transfer
        self.post_batch_size = post_batch_size
        self.num_worker_threads = num_worker_threads
        self.poll_cq_mode = poll_cq_mode
        self.enable_notification = enable_notification
        self.notif_per_qp = notif_per_qp
        self.enable_transfer_chunking = enable_transfer_chunking
        self.chunk_bytes = chunk_bytes
        self.max_chunks_per_transfer = max_chunks_per_transfer
        self.num_nics_per_transfer = num_nics_per_transfer
        # Read/write only (not constructor arguments); 0 means "MORI's default".
        self.max_send_wr = 0
        self.max_cqe_num = 0
        self.max_msg_sge = 0

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"RdmaBackendConfig({fields})"


class XgmiBackendConfig(BackendConfig):
    def __init__(self, num_streams: int = 64, num_events: int = 64):
        self.num_streams = num_streams
        self.num_events = num_events


class FabricBackendConfig(BackendConfig):
    def __init__(self, num_streams: int = 64, num_events: int = 64):
        self.num_streams = num_streams
        self.num_events = num_events


# softio's own switch: 1 keeps every peer on TCP lanes, even on this host; 0 (the default) lets a
# peer on this host use intra-host lanes (see intrahost.py), as MORI routes a pair on one node
# over XGMI.
FORCE_TCP_ENV = "SGLANG_MORI_SOFTIO_FORCE_TCP"

# MORI's defaults for the per-QP limits and the control plane.
DEFAULT_SQ_DEPTH = 8192
DEFAULT_MAX_SGE = 4
DEFAULT_SQ_BACKOFF_US = 5_000_000
DEFAULT_CP_TIMEOUT_MS = 5000


@dataclasses.dataclass(frozen=True)
class LaneSettings:
    """What the software backend actually runs with, after MORI's env-over-config rules."""

    lanes: int
    post_batch_size: int
    enable_notification: bool
    sq_depth: int
    max_sge: int
    sq_backoff_s: float
    cp_timeout_s: float | None  # None: no control-plane timeout (MORI_IO_CP_TIMEOUT_MS=0)
    force_tcp: bool = False  # no intra-host lanes, in either direction


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    return int(raw, 0)


def _env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    return raw.strip().lower() in ("1", "true", "on", "yes")


def resolve_lane_settings(config: RdmaBackendConfig) -> LaneSettings:
    """Apply the MORI_IO_* variables (like MORI, the environment wins over the code) and
    softio's own FORCE_TCP switch."""
    lanes = _env_int("MORI_IO_QP_PER_TRANSFER", int(config.qp_per_transfer))
    if lanes < 1:
        raise RuntimeError(f"Invalid RDMA config: qp_per_transfer must be >= 1 (got {lanes})")
    sq_depth = _env_int("MORI_IO_QP_MAX_SEND_WR", int(config.max_send_wr) or DEFAULT_SQ_DEPTH)
    max_sge = _env_int(
        "MORI_IO_QP_MAX_MSG_SGE",
        _env_int("MORI_IO_QP_MAX_SGE", int(config.max_msg_sge) or DEFAULT_MAX_SGE),
    )
    cp_ms = _env_int("MORI_IO_CP_TIMEOUT_MS", DEFAULT_CP_TIMEOUT_MS)
    return LaneSettings(
        lanes=lanes,
        post_batch_size=_env_int("MORI_IO_POST_BATCH_SIZE", int(config.post_batch_size)),
        enable_notification=_env_bool("MORI_IO_ENABLE_NOTIFICATION", bool(config.enable_notification)),
        sq_depth=max(1, sq_depth),
        max_sge=max(1, min(max_sge, DEFAULT_MAX_SGE)),
        sq_backoff_s=_env_int("MORI_IO_SQ_BACKOFF_TIMEOUT_US", DEFAULT_SQ_BACKOFF_US) / 1e6,
        cp_timeout_s=(cp_ms / 1000.0) if cp_ms > 0 else None,
        force_tcp=_env_bool(FORCE_TCP_ENV, False),
    )
