"""Every SGLANG_MORI_* setting, typed and validated once at start-up.

`MoriConfig.from_env()` reads the environment and raises `ConfigError` naming the variable, the
value and what is allowed, so a typo stops the server at launch instead of misbehaving later.
An unset or empty variable takes its default. `KNOBS` is the single table of settings: the code
reads only what is listed there, and docs/configuration.md is generated from it
(`python -m sglang_mori.config --markdown`).
"""

from __future__ import annotations

import ipaddress
import math
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, List, Mapping, Optional, Tuple


class ConfigError(ValueError):
    """An SGLANG_MORI_* variable holds a value we cannot use."""


# --- parsers: str -> value, raising ValueError("expected ...") -------------------------------

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_BOOL_SPELLINGS = "/".join(_TRUE + _FALSE) + " (case-insensitive)"


def _parse_int(text: str, low: Optional[int] = None, high: Optional[int] = None,
               also: Tuple[int, ...] = ()) -> int:
    if high is not None:
        expected = f"an integer in {low}..{high}"
    elif low is not None:
        expected = f"an integer >= {low}"
    else:
        expected = "an integer"
    if also:
        expected = f"{' or '.join(str(a) for a in also)}, or {expected}"
    try:
        value = int(text, 10)
    except ValueError:
        raise ValueError(f"expected {expected}") from None
    if value in also:
        return value
    if (low is not None and value < low) or (high is not None and value > high):
        raise ValueError(f"expected {expected}")
    return value


def int_at_least(low: int, also: Tuple[int, ...] = ()) -> Callable[[str], int]:
    return lambda text: _parse_int(text, low, None, also)


def int_between(low: int, high: int) -> Callable[[str], int]:
    return lambda text: _parse_int(text, low, high)


def positive_deadline_ms(text: str) -> int:
    try:
        value = int(text, 10)
    except ValueError:
        raise ValueError("expected an integer > 0 (milliseconds)") from None
    if value <= 0:
        raise ValueError(
            "expected an integer > 0 (milliseconds); the per-chunk transfer deadline cannot be "
            "disabled, because a transfer that never completes would hold its pages and a worker "
            "forever. Use a large value (e.g. 600000) for very slow links"
        )
    return value


def float_at_least_zero(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError("expected a number >= 0 (seconds)") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError("expected a finite number >= 0 (seconds)")
    return value


def boolean(text: str) -> bool:
    lowered = text.lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ValueError(f"expected a boolean: one of {_BOOL_SPELLINGS}")


def one_of(*choices: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        lowered = text.lower()
        if lowered not in choices:
            raise ValueError(f"expected one of {'|'.join(choices)}")
        return lowered

    return parse


def _arrival_flag(text: str) -> str:
    lowered = text.strip().lower()
    if lowered in _TRUE or lowered == "thread":
        return "thread"
    if lowered in _FALSE:
        return "off"
    if lowered == "process":
        return "process"
    raise ValueError("expected off, thread or process (1/true/yes/on: thread; 0/false/no: off)")


def _meter_folder(text: str) -> str:
    """A folder for SGLANG_MORI_CALL_METER; off/0/false/no: "" (off)."""
    return "" if text.strip().lower() in _FALSE else text.strip()


def ipv4_host(text: str) -> str:
    why = (
        "this host goes into our engine descriptor and is the address peers dial, so it must be "
        "one IPv4 address of this machine that they can reach"
    )
    try:
        address = ipaddress.IPv4Address(text)
    except ValueError:
        raise ValueError(
            f"expected an IPv4 literal such as 10.0.0.5, or empty for SGLang's local IP (no "
            f"hostnames, no IPv6); {why}"
        ) from None
    if address.is_unspecified or address.is_multicast or text == "255.255.255.255":
        raise ValueError(f"expected a unicast IPv4 address, not {text} (a wildcard or group); {why}")
    return str(address)


# --- the table ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Knob:
    name: str  # environment variable
    field: str  # MoriConfig attribute
    type: str  # for the docs: int, float, bool, choice, ipv4, path
    default: Any
    meaning: str
    parse: Callable[[str], Any]
    allowed: str  # for the docs


KNOBS: Tuple[Knob, ...] = (
    Knob("SGLANG_MORI_ENGINE", "engine", "choice", "mori",
         "Transfer engine module: `mori` is the real MORI-IO (`mori.io`, ROCm + RDMA NIC); `soft` "
         "is softio, the same API over TCP from CPU memory (tests, demos). Never falls back.",
         one_of("mori", "soft"), "mori | soft"),
    Knob("SGLANG_MORI_QP_PER_TRANSFER", "qp_per_transfer", "int", 4,
         "RDMA queue pairs per connection used by each transfer (RdmaBackendConfig.qp_per_transfer).",
         int_at_least(1), ">= 1"),
    Knob("SGLANG_MORI_POST_BATCH_SIZE", "post_batch_size", "int", -1,
         "Work requests per ibv_post_send chain (RdmaBackendConfig.post_batch_size); -1 lets MORI-IO "
         "choose.", int_at_least(1, also=(-1,)), "-1 (auto) or >= 1"),
    Knob("SGLANG_MORI_NUM_WORKERS", "num_workers", "int", 4,
         "MORI-IO engine worker threads (RdmaBackendConfig.num_worker_threads).",
         int_at_least(1), ">= 1"),
    Knob("SGLANG_MORI_TRANSFER_SHARDS", "transfer_shards", "int", 0,
         "Our transfer worker threads on the prefill side; a room always maps to one shard. Also "
         "bounds how many chunks are submitted concurrently. 0 (auto): half the CPUs this process "
         "may run on, 1..8 (more threads than cores only trade GIL and lock handoffs; measured in "
         "docs/benchmarks.md).", lambda text: _parse_int(text, 1, 256, also=(0,)),
         "0 (auto) or 1..256"),
    Knob("SGLANG_MORI_TRANSFER_TIMEOUT_MS", "transfer_timeout_ms", "int", 30000,
         "Deadline for one chunk transfer (submit, retries and completion). Always on: a transfer "
         "past it fails its request.", positive_deadline_ms, "> 0 (cannot be disabled)"),
    Knob("SGLANG_MORI_WAIT_POLL_MS", "wait_poll_ms", "int", 50,
         "Poll interval of the waits on transfer statuses: decode's status thread checks its room "
         "deadlines at least this often; prefill's completion thread waits at most this long (capped "
         "at 20 ms) on a running write before looking at every room again.", int_between(1, 10000),
         "1..10000"),
    Knob("SGLANG_MORI_ANNOUNCE_GRACE_MS", "announce_grace_ms", "int", 5,
         "Prefill: a request's last chunk tells decode its transfer started (TransferStarted, which "
         "starts decode's own transfer deadline) only if the chunk's writes are still running this "
         "long after they were posted; a chunk that succeeds or fails sooner sends decode only its "
         "Success or Failed, one message per request instead of two (issue 28). Earlier chunks "
         "announce at once. Small against decode's deadline (SGLANG_MORI_TRANSFER_TIMEOUT_MS plus "
         "5 s), which starts at most this much later than prefill's own (docs/design.md). 0: every "
         "chunk announces at once.", int_between(0, 1000), "0..1000"),
    Knob("SGLANG_MORI_MAX_INFLIGHT_PER_PEER", "max_inflight_per_peer", "int", 64,
         "Transfer statuses in flight per decode peer; submitting more waits (within the deadline).",
         int_at_least(1), ">= 1"),
    Knob("SGLANG_MORI_MAX_INFLIGHT_BYTES_PER_PEER", "max_inflight_bytes_per_peer", "int", 4 << 20,
         "Prefill: bytes of KV writes posted and not yet finished per decode peer; a write past it is "
         "held, not posted, until earlier ones finish (first come, first served), and dropped unsent "
         "if its room ends meanwhile (decode aborted it, it failed or timed out). A posted write "
         "cannot be withdrawn and a peer's writes share ordered lanes, so this bounds the bytes of "
         "aborted rooms a retry can find ahead of it after a slow link (docs/reliability.md, "
         "issue 29). A write larger than the bound is posted alone. Costs pipelining depth: a "
         "request's writes wait behind a busy peer's (within the transfer deadline), and the writes "
         "behind a held one on its transfer shard wait too. 0: no byte bound.",
         int_at_least(0), ">= 0 (bytes; 0 = unbounded)"),
    Knob("SGLANG_MORI_PEER_STALL_MS", "peer_stall_ms", "int", 500,
         "Prefill: the byte budget (SGLANG_MORI_MAX_INFLIGHT_BYTES_PER_PEER) binds only for a decode "
         "peer with writes in flight none of which finished for this long (a slow or dead link). A "
         "healthy link keeps finishing writes and is never held back, so chunks larger than the "
         "budget still overlap there. 0: the budget always binds.",
         int_at_least(0), ">= 0 (ms; 0 = always)"),
    Knob("SGLANG_MORI_MAX_QUEUED_CHUNKS", "max_queued_chunks", "int", 4096,
         "Bound of each transfer shard's queue; a chunk arriving at a full queue fails its request.",
         int_at_least(1), ">= 1"),
    Knob("SGLANG_MORI_INLINE_POST", "inline_post", "choice", "auto",
         "Prefill: a chunk whose room and transfer shard are idle (nothing of the room queued or "
         "being submitted, its shard's queue empty and its thread idle, no forward event to wait "
         "on, one destination whose sessions are open, its decode not stalled, the in-flight "
         "budget admitting it at once) is planned and posted on the thread that hands it over "
         "instead of waking its shard thread: the wake-up's GIL wait leaves a lone request's path "
         "(issue 28), and that thread pays the plan and the post. Anything that would wait hands "
         "the chunk to its shard as before. `on`: also on SGLang's scheduler thread (its send() "
         "then costs the plan and the engine call, 0.3-0.5 ms per 8K request on the CPU rig); "
         "`auto`: only where the thread is ours (the transfer process's reader, "
         "SGLANG_MORI_TRANSFER_PROCESS); `off`: every chunk goes through its shard's queue.",
         one_of("off", "on", "auto"), "off | on | auto"),
    Knob("SGLANG_MORI_SUBMIT_RETRY_MAX", "submit_retry_max", "int", 5,
         "Retries, with backoff and within the deadline, of transient 'SQ full' submit errors.",
         int_at_least(0), ">= 0"),
    Knob("SGLANG_MORI_PEER_FAIL_FAST_S", "peer_fail_fast_s", "float", 5.0,
         "After a peer fails, new requests to it fail at once for this long, unless it registers "
         "again with a new engine key.", float_at_least_zero, ">= 0 (seconds)"),
    Knob("SGLANG_MORI_DRAIN_FENCE_MARGIN_S", "drain_fence_margin_s", "float", 10.0,
         "Prefill: a failed room whose writes are still in flight is fenced this long before "
         "decode's SGLang frees its pages (SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT, "
         "30 s by default, read from prefill's environment: launch both servers with the same "
         "value) counted from the room's failure, but never sooner than half that timeout after "
         "the failure (the fence fails every write to that decode, so it waits for writes that are "
         "stuck, not ones still landing): the engine resets its connections to that decode, "
         "every write posted to it before fails and cannot land, then the abort is acked. The "
         "margin covers decode's abort reaching prefill late. softio only: MORI-IO has no fence, "
         "and there the room stays poisoned as before (docs/reliability.md).",
         float_at_least_zero, ">= 0 (seconds)"),
    Knob("SGLANG_MORI_HOST", "host", "ipv4", "",
         "IPv4 address put in our engine descriptor (what peers dial). Empty: SGLang's local IP.",
         ipv4_host, "IPv4 literal, or empty"),
    Knob("SGLANG_MORI_ENABLE_NOTIFICATION", "enable_notification", "bool", False,
         "MORI-IO target-side completion notifications (RdmaBackendConfig.enable_notification). "
         "Completion is signalled over our protocol either way.", boolean, _BOOL_SPELLINGS),
    Knob("SGLANG_MORI_GC_FREEZE", "gc_freeze", "bool", True,
         "Freeze the objects alive when our manager finishes start-up (`gc.freeze()`, as SGLang's "
         "`/freeze_gc` does) so full garbage collections skip them and do not stall transfer "
         "threads for hundreds of milliseconds.", boolean, _BOOL_SPELLINGS),
    Knob("SGLANG_MORI_POLL_READS", "poll_reads", "bool", True,
         "SGLang's poll of a room waiting for the other side's message (prefill: decode's "
         "destinations; decode: the Success or Failed status) reads our socket itself, on the "
         "scheduler's thread, so that poll sees the message without waiting for our reading thread "
         "to take the GIL (docs/design.md). Off: only our reading thread reads it, as before.",
         boolean, _BOOL_SPELLINGS),
    Knob("SGLANG_MORI_DECODE_ARRIVAL_FLAG", "decode_arrival_flag", "choice", "off",
         "Decode: how SGLang's poll of a room waiting for prefill learns that nothing arrived on our "
         "status socket (issue 28). `off`: it asks the socket every step (a system call, 12-27 us a "
         "step on an H200 host), and our status thread looks only as often as "
         "SGLANG_MORI_WAIT_POLL_MS while SGLang polls. `thread` (also 1/true/yes/on): our status "
         "thread waits in poll(2) on the socket and the poll reads the array poll(2) writes, but "
         "that thread wakes in Python on every arrival, which on one H200 cost more CPU than the "
         "step thread saved (docs/benchmarks.md, session 20). `process`: a small child process "
         "(stdlib Python, one per decode rank) waits in poll(2) and sets a shared byte; the poll "
         "reads the byte, and after a look that found the socket empty re-arms the child with one "
         "pipe write, so no thread of ours wakes per arrival (session 21). If the child cannot "
         "start or dies, polls ask the socket as with `off` (logged).",
         _arrival_flag, "off | thread | process (1/true/yes/on: thread; 0/false/no: off)"),
    Knob("SGLANG_MORI_XGMI", "xgmi", "bool", False,
         "Let MORI-IO create its XGMI backend for peers on the same node (sets "
         "MORI_DISABLE_AUTO_XGMI=0).", boolean, _BOOL_SPELLINGS),
    Knob("SGLANG_MORI_LAYERWISE", "layerwise", "choice", "off",
         "Layer-wise KV streaming on prefill: each layer's new full pages are written while the "
         "forward pass computes the next layers (hooks through SGLang's HookRegistry). `on` fails "
         "start-up on a deployment that cannot stream (PP, context parallel, staging, hybrid state "
         "pools, KV sharding, two-batch overlap) and refuses a decode with context parallelism at "
         "registration; `auto` streams where supported and sends chunk-wise elsewhere (it serves "
         "every deployment `off` serves); `off` is chunk-wise only. Batches that cannot stream fall back "
         "chunk-wise and are counted (sglang_mori_layerwise_fallbacks_total).",
         one_of("off", "on", "auto"), "off | on | auto"),
    Knob("SGLANG_MORI_LAYERWISE_MIN_TOKENS", "layerwise_min_tokens", "int", 256,
         "A request streams layer-wise in a forward pass only if that pass computes at least this "
         "many of its tokens; shorter extends go chunk-wise (fewer, larger writes).",
         int_at_least(0), ">= 0"),
    Knob("SGLANG_MORI_LAYERWISE_MIN_BATCH_TOKENS", "layerwise_min_batch_tokens", "int", 8192,
         "A batch streams layer-wise only if its forward computes at least this many tokens in "
         "all; shorter (launch-bound) forwards go chunk-wise, counted as `short_batch` (what "
         "streaming costs a forward of each size on an H100: docs/benchmarks.md, \"GPU rig\").",
         int_at_least(0), ">= 0"),
    Knob("SGLANG_MORI_LAYERWISE_GROUP", "layerwise_group", "int", 0,
         "Layers per layer-wise write. 0: halving groups (the first write covers a quarter of "
         "the layers, each later one half of the layers still to come, the last layer alone: "
         "about log2(layers)+2 writes per room and forward, one layer's KV left after it); "
         "n >= 1: a write every n layers.",
         lambda text: _parse_int(text, 1, 1024, also=(0,)), "0 (halving) or 1..1024"),
    Knob("SGLANG_MORI_TRANSFER_PROCESS", "transfer_process", "bool", False,
         "Prototype (issue 28), prefill only: one child process per rank owns the transfer engine "
         "and runs the transfer threads, so SGLang's scheduler process keeps only its calls into us "
         "(one hand-off record per chunk, statuses read from shared memory). The KV pools must be "
         "importable there (CUDA or HIP IPC, or CPU pools in /dev/shm) and the child must prove at "
         "start-up that its engine can post from them (a probe write from every pool, bytes "
         "checked); otherwise, and with layer-wise streaming, context parallelism, KV sharding, PP "
         "or SGLang's prefill_complete allocation, the switch is refused with the reason in a "
         "warning and the transfers stay in the scheduler's process (docs/design.md, \"A transfer "
         "process\"). Off: everything runs in the scheduler's process.", boolean, _BOOL_SPELLINGS),
    Knob("SGLANG_MORI_CALL_METER", "call_meter", "path", "",
         "Measurement (issue 28): a folder where each scheduler process writes, every 0.5 s, the CPU "
         "our code used: SGLang's calls into our manager, sender and receiver (and the layer-wise "
         "hooks) timed one by one on the calling thread, and our threads' CPU, with the requests "
         "counted (python/sglang_mori/call_meter.py; scripts/gpu_sglang/pd_latency.py --call-meter "
         "turns it into microseconds per request). Each metered call costs 1-5 us more CPU (the part inside "
         "the timed window is measured at start and taken off). Empty "
         "or `off`: nothing is wrapped and no thread starts.", _meter_folder, "a folder, or off"),
)

# --- the config ---------------------------------------------------------------------------

@dataclass(frozen=True)
class MoriConfig:
    engine: str = "mori"
    qp_per_transfer: int = 4
    post_batch_size: int = -1
    num_workers: int = 4
    transfer_shards: int = 0  # 0: auto_transfer_shards()
    transfer_timeout_ms: int = 30000
    wait_poll_ms: int = 50
    announce_grace_ms: int = 5
    max_inflight_per_peer: int = 64
    max_inflight_bytes_per_peer: int = 4 << 20
    peer_stall_ms: int = 500
    max_queued_chunks: int = 4096
    inline_post: str = "auto"
    submit_retry_max: int = 5
    peer_fail_fast_s: float = 5.0
    drain_fence_margin_s: float = 10.0
    host: str = ""
    enable_notification: bool = False
    gc_freeze: bool = True
    poll_reads: bool = True
    decode_arrival_flag: str = "off"  # off | thread | process
    xgmi: bool = False
    layerwise: str = "off"
    layerwise_min_tokens: int = 256
    layerwise_min_batch_tokens: int = 8192
    layerwise_group: int = 0
    transfer_process: bool = False
    call_meter: str = ""  # a folder, "" off

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "MoriConfig":
        """Read every knob; raise ConfigError for the first unusable value."""
        values = {}
        for knob in KNOBS:
            raw = environ.get(knob.name)
            if raw is None or not raw.strip():
                continue
            try:
                values[knob.field] = knob.parse(raw.strip())
            except ValueError as exc:
                raise ConfigError(f"{knob.name}={raw!r}: {exc}") from None
        return cls(**values)

    def describe(self) -> str:
        """One line for the start-up log."""
        return " ".join(f"{k.name}={getattr(self, k.field)!r}" for k in KNOBS)


def auto_transfer_shards(cpus: Optional[int] = None) -> int:
    """Shard threads when SGLANG_MORI_TRANSFER_SHARDS is 0: half the usable CPUs, 1..8.

    Submitting is Python under the GIL, so threads beyond the cores add handoffs, not
    parallelism: on a 2-core host 8 shards cost 1.5x the CPU per request of 1 and tripled p99
    (docs/benchmarks.md, "Session 6"). Hosts with many cores keep 8, which bounds how long one
    slow peer can hold up the rooms that share its shard.
    """
    if cpus is None:
        try:
            cpus = len(os.sched_getaffinity(0))  # the CPUs this process may use, not the host's
        except (AttributeError, OSError):  # pragma: no cover - not Linux
            cpus = os.cpu_count() or 1
    return max(1, min(8, cpus // 2))


def transfer_shard_count(cfg: "MoriConfig") -> int:
    return cfg.transfer_shards or auto_transfer_shards()


# --- MORI-IO's own variables that silently win over what we pass --------------------------

# MORI-IO variable -> the knob whose value it replaces
_OVERRIDDEN_BY_MORI = {
    "MORI_IO_QP_PER_TRANSFER": "SGLANG_MORI_QP_PER_TRANSFER",
    "MORI_IO_POST_BATCH_SIZE": "SGLANG_MORI_POST_BATCH_SIZE",
    "MORI_IO_NUM_WORKER_THREADS": "SGLANG_MORI_NUM_WORKERS",
    "MORI_IO_ENABLE_NOTIFICATION": "SGLANG_MORI_ENABLE_NOTIFICATION",
}
# Settings we leave at MORI-IO's defaults; an env value still changes the engine's behaviour.
_MORI_DEFAULTS_WE_RELY_ON = {
    "MORI_IO_POLL_CQ_MODE": "polling (MORI-IO default; we do not set it)",
    "MORI_IO_ENABLE_CHUNKING": "off (MORI-IO default; we do not set it)",
}


def mori_env_overrides(cfg: MoriConfig, environ: Mapping[str, str] = os.environ) -> List[str]:
    """Warnings for MORI-IO environment variables that override what we configured.

    MORI-IO applies its MORI_IO_* variables after the config we pass, so they win silently.
    """
    by_name = {k.name: k for k in KNOBS}
    warnings = []
    for mori_var, knob_name in _OVERRIDDEN_BY_MORI.items():
        if mori_var in environ:
            knob = by_name[knob_name]
            warnings.append(
                f"{mori_var}={environ[mori_var]!r} is set and overrides our configured "
                f"{knob_name}={getattr(cfg, knob.field)!r} (MORI-IO lets its environment "
                f"variables win); unset {mori_var} to use {knob_name}"
            )
    for mori_var, ours in _MORI_DEFAULTS_WE_RELY_ON.items():
        if mori_var in environ:
            warnings.append(
                f"{mori_var}={environ[mori_var]!r} is set and overrides our configured value "
                f"{ours}; unset it unless you mean to tune MORI-IO directly"
            )
    if "MORI_DISABLE_AUTO_XGMI" in environ:
        value = environ["MORI_DISABLE_AUTO_XGMI"]
        effect = "enables" if value == "0" else "disables"
        warnings.append(
            f"MORI_DISABLE_AUTO_XGMI={value!r} is set and {effect} auto-XGMI (inverted: only '0' "
            f"enables it); our configured SGLANG_MORI_XGMI={cfg.xgmi!r}"
            + (" sets it to '0' at start-up" if cfg.xgmi else " leaves it as is")
        )
    return warnings


# --- docs ---------------------------------------------------------------------------------

def markdown_table() -> str:
    def cell(text: str) -> str:
        return str(text).replace("|", "\\|")

    lines = [
        "| Variable | Type | Default | Allowed | Meaning |",
        "|---|---|---|---|---|",
    ]
    for k in KNOBS:
        default = k.default
        if isinstance(default, bool):
            default = str(default).lower()
        elif default == "":
            default = "(empty)"
        lines.append(
            f"| `{k.name}` | {k.type} | `{cell(default)}` | {cell(k.allowed)} | {cell(k.meaning)} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--markdown"]:
        sys.stdout.write(markdown_table())
        return 0
    if not argv:
        try:
            print(MoriConfig.from_env().describe())
        except ConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        for warning in mori_env_overrides(MoriConfig.from_env()):
            print(f"warning: {warning}", file=sys.stderr)
        return 0
    print("usage: python -m sglang_mori.config [--markdown]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
