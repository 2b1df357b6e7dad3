"""Checks of environment settings: auto-XGMI, MORI_IO_* overrides, advertised host address,
and the SGLANG_MORI_* knobs."""

from __future__ import annotations

import importlib
import ipaddress
from typing import List

from .host import HostView
from .result import CheckResult, Status

# MORI_IO_* variables amd-mori 1.2.4 reads; they override the config our backend passes in code.
KNOWN_MORI_IO = {
    "MORI_IO_ENABLE_NOTIFICATION", "MORI_IO_ENABLE_CHUNKING", "MORI_IO_CHUNK_BYTES",
    "MORI_IO_MAX_CHUNKS", "MORI_IO_NUM_NICS_PER_TRANSFER", "MORI_IO_QP_PER_TRANSFER",
    "MORI_IO_POST_BATCH_SIZE", "MORI_IO_NUM_WORKER_THREADS", "MORI_IO_POLL_CQ_MODE",
    "MORI_IO_QP_MAX_SEND_WR", "MORI_IO_QP_MAX_RECV_WR", "MORI_IO_QP_MAX_CQE",
    "MORI_IO_QP_MAX_MSG_SGE", "MORI_IO_QP_MAX_SGE", "MORI_IO_QP_MAX_INLINE_DATA",
    "MORI_IO_SQ_BACKOFF_TIMEOUT_US", "MORI_IO_CP_TIMEOUT_MS", "MORI_IO_RDMA_NIC_IDX",
    "MORI_IO_RAIL_AFFINITY", "MORI_IO_TC", "MORI_IO_SL", "MORI_IO_TC_DISABLE",
    "MORI_IO_ENABLE_ASYNC_EVENTS", "MORI_IO_QP_TIMEOUT", "MORI_IO_QP_RETRY_CNT",
    "MORI_IO_FAIL_ON_ASYNC_EVENT", "MORI_IO_XGMI_SCATTER_GATHER_THRESHOLD",
    "MORI_IO_FABRIC_DISABLE", "MORI_IO_FABRIC_VPOD_ID", "MORI_IO_LOG_LEVEL",
}
# MORI_IO_* override -> our knob it silently beats.
SHADOWS = {
    "MORI_IO_QP_PER_TRANSFER": "SGLANG_MORI_QP_PER_TRANSFER",
    "MORI_IO_POST_BATCH_SIZE": "SGLANG_MORI_POST_BATCH_SIZE",
    "MORI_IO_NUM_WORKER_THREADS": "SGLANG_MORI_NUM_WORKERS",
    "MORI_IO_ENABLE_NOTIFICATION": "SGLANG_MORI_ENABLE_NOTIFICATION",
}
FALSY_LOOKING = {"", "false", "no", "off", "n", "f"}
# SGLANG_MORI_* names read by our tests and scripts, not by the backend (docs/configuration.md).
TOOLING_VARS = {"SGLANG_MORI_MANUAL_E2E", "SGLANG_MORI_MANUAL_MODEL", "SGLANG_MORI_MANUAL_GSM8K",
                "SGLANG_MORI_IN_NETNS"}


def _truthy(text: str) -> bool:
    return text.strip().lower() in ("1", "true", "yes", "on")


def check_xgmi(host: HostView, rdma_ports: int, amd_gpus: int) -> CheckResult:
    """MORI_DISABLE_AUTO_XGMI is inverted: only the literal "0" turns auto-XGMI (and the XGMI-only
    fallback without RDMA devices) on; unset, "1", "false" all leave it off. Our SGLANG_MORI_XGMI=1
    makes the backend set it to "0" at start-up."""
    name = "xgmi"
    raw = host.env.get("MORI_DISABLE_AUTO_XGMI")
    ours = _truthy(host.env.get("SGLANG_MORI_XGMI", ""))
    single = "" if rdma_ports else "; no RDMA device, so XGMI only (single node)"
    if ours:
        note = "" if raw in (None, "0") else f" (replacing MORI_DISABLE_AUTO_XGMI={raw!r})"
        return CheckResult(name, Status.OK,
                           "SGLANG_MORI_XGMI=1: the backend sets MORI_DISABLE_AUTO_XGMI=0" + note
                           + ": auto-XGMI ON; same-node GPU pairs use XGMI" + single)
    if raw == "0":
        return CheckResult(name, Status.OK,
                           "MORI_DISABLE_AUTO_XGMI=0: auto-XGMI ON; same-node GPU pairs use XGMI" + single)
    shown = "unset" if raw is None else f"={raw!r}"
    if raw is not None and raw.strip().lower() in FALSY_LOOKING:
        return CheckResult(name, Status.WARN,
                           f"MORI_DISABLE_AUTO_XGMI{shown} does NOT enable XGMI: the variable is "
                           "inverted and only the literal \"0\" does",
                           "MORI_DISABLE_AUTO_XGMI=0 (or SGLANG_MORI_XGMI=1) for XGMI on one node; "
                           "unset it for RDMA only")
    if not rdma_ports and amd_gpus:
        return CheckResult(name, Status.FAIL,
                           f"MORI_DISABLE_AUTO_XGMI {shown}: auto-XGMI OFF and no RDMA device, so "
                           "MORI-IO fails with 'no active RDMA device'",
                           "single node: SGLANG_MORI_XGMI=1 (or MORI_DISABLE_AUTO_XGMI=0)")
    return CheckResult(name, Status.OK,
                       f"MORI_DISABLE_AUTO_XGMI {shown}: auto-XGMI OFF, transfers use RDMA "
                       "(only \"0\" turns XGMI on; SGLANG_MORI_XGMI=1 sets it for single-node PD)")


def check_mori_io_overrides(host: HostView) -> CheckResult:
    name = "MORI_IO_* overrides"
    found = sorted(k for k in host.env if k.startswith("MORI_IO_"))
    if not found:
        return CheckResult(name, Status.OK, "none set; the backend's SGLANG_MORI_* settings apply")
    notes = []
    for key in found:
        val = host.env[key]
        note = f"{key}={val}"
        if key not in KNOWN_MORI_IO:
            note += " (unknown to amd-mori 1.2.4: typo?)"
        if key in SHADOWS and SHADOWS[key] in host.env:
            note += f" (beats {SHADOWS[key]}={host.env[SHADOWS[key]]})"
        if key == "MORI_IO_ENABLE_NOTIFICATION" and val.strip().lower() not in FALSY_LOOKING | {"0"}:
            note += " (re-enables notifications: a failed notification poisons transfer statuses)"
        if key in ("MORI_IO_TC", "MORI_IO_SL"):
            note += " (needs end-to-end PFC, else bandwidth collapses)"
        notes.append(note)
    return CheckResult(name, Status.WARN, "override the backend's config: " + "; ".join(notes),
                       "unset them unless you mean to override (they win over SGLANG_MORI_*)")


def check_host_address(host: HostView) -> List[CheckResult]:
    """MORI's control plane takes an IPv4 literal (inet_addr): hostnames and IPv6 fail, and 0.0.0.0
    makes the peer dial its own loopback."""
    results = []
    for var in ("SGLANG_MORI_HOST", "SGLANG_HOST_IP"):
        val = (host.env.get(var) or "").strip()
        if not val:
            continue
        try:
            addr = ipaddress.ip_address(val)
        except ValueError:
            addr = None
        if var == "SGLANG_MORI_HOST" and (addr is None or addr.version != 4 or addr.is_unspecified):
            continue  # the SGLANG_MORI_* config check reports this one with config.py's message
        if addr is None or addr.version != 4:
            results.append(CheckResult(var, Status.FAIL, f"{val!r} is not an IPv4 literal",
                                       "use the IPv4 address of the NIC peers reach (no hostname, no IPv6)"))
        elif addr.is_unspecified:
            results.append(CheckResult(var, Status.FAIL, "0.0.0.0 makes peers dial their own loopback",
                                       "use this node's reachable IPv4 address"))
        elif addr.is_loopback:
            results.append(CheckResult(var, Status.WARN, f"{val}: loopback, single-node only",
                                       "use a routable address for multi-node PD"))
        else:
            results.append(CheckResult(var, Status.OK, val))
    return results


def check_config(host: HostView) -> List[CheckResult]:
    """SGLANG_MORI_* validity through sglang_mori.config (when this build has it)."""
    try:
        config = importlib.import_module("sglang_mori.config")
    except ModuleNotFoundError as exc:
        if exc.name != "sglang_mori.config":
            raise
        return [CheckResult("SGLANG_MORI_* config", Status.ABSENT, "sglang_mori.config not in this build")]
    env = dict(host.env)
    try:
        cfg = config.MoriConfig.from_env(env)
    except Exception as exc:  # the config's own validation error, whatever its type
        return [CheckResult("SGLANG_MORI_* config", Status.FAIL, f"{type(exc).__name__}: {exc}",
                            "fix the variable named above (`python -m sglang_mori.config --markdown`)")]
    known = _known_knobs(config)
    results = []
    stray = sorted(k for k in env if k.startswith("SGLANG_MORI_") and k not in known | TOOLING_VARS)
    if stray:
        results.append(CheckResult("SGLANG_MORI_* names", Status.WARN,
                                   "not read by sglang-mori: " + ", ".join(stray),
                                   "check the spelling against docs/configuration.md"))
    set_here = sorted(k for k in env if k in known)
    results.insert(0, CheckResult("SGLANG_MORI_* config", Status.OK,
                                  ("valid; set: " + ", ".join(f"{k}={env[k]}" for k in set_here))
                                  if set_here else f"valid; all defaults ({type(cfg).__name__})"))
    return results


def _known_knobs(config_module) -> set:
    return {knob.name for knob in config_module.KNOBS}
