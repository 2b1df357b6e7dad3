"""`scripts/bench_backend.py transfer`: the full backend, prefill and decode in separate processes.

N requests of P prompt tokens over a KV pool shaped like a small Llama (layers x KV heads x head
dim, bf16) move from prefill to decode through SGLang's real disaggregation classes, driven as the
schedulers drive them, on softio. Reports requests/s, p50/p99 completion latency, GB/s and engine
operations per chunk. `--compare` runs the same workload in the same run through SGLang's built-in
mori backend (on softio, via a `mori` shim put on its path for that run only) and SGLang's Mooncake
backend over its TCP transport, and prints the ratios.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import threading
import time

BACKENDS = {
    "ours": "mori",  # sglang_mori through the plugin
    "sglang-mori-builtin": "mori-builtin",  # SGLang's own mori backend on softio (shim)
    "mooncake-tcp": "mooncake",
}


def add_arguments(p) -> None:
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=64, help="rooms open at once on each side")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--chunks", type=int, default=1, help="send() calls per request (chunked prefill)")
    p.add_argument("--compare", action="store_true", help="also run SGLang's built-in mori and mooncake")
    p.add_argument("--backends", default=None,
                   help=f"comma-separated subset of {','.join(BACKENDS)} (overrides --compare)")
    p.add_argument("--freeze-gc-all", action="store_true",
                   help="gc.freeze() in every backend's processes after start-up (ours does it by "
                        "default; this gives the others the same, as SGLang's /freeze_gc would)")
    p.add_argument("--no-verify", action="store_true", help="skip decode's byte check (faster)")
    p.add_argument("--timeout", type=float, default=600.0, help="deadline for one run, seconds")
    p.add_argument("--thread-cpu", action="store_true",
                   help="also print each side's CPU ms per request by thread role")
    p.add_argument("--json", action="store_true", help="print the results as one JSON object (per backend)")


def _config(args, backend: str):
    from harness.pd.run import HarnessConfig, KVLayout, RoomShape

    return HarnessConfig(
        backend=backend,
        layout=KVLayout(
            num_layers=args.layers,
            total_kv_heads=args.kv_heads,
            head_dim=args.head_dim,
            dtype="bfloat16",
            page_size=args.page_size,
        ),
        rooms=args.requests,
        max_inflight=args.concurrency,
        shape=RoomShape(min_tokens=args.prompt_tokens, max_tokens=args.prompt_tokens, chunks=args.chunks),
        verify=not args.no_verify,
        freeze_gc_all=args.freeze_gc_all,
        thread_cpu=args.thread_cpu,
        transfer_timeout_s=args.timeout,
        # Start-up (imports, managers) takes minutes on a loaded 2-core host: not part of the result.
        startup_timeout_s=300.0,
        sglang_timeout_s=min(args.timeout / 2, 300.0),
    )


def _progress(label: str, total: int):
    """A `during` hook drawing a progress bar of rooms done on decode."""
    from tqdm import tqdm

    def hook(info) -> None:
        bar = tqdm(total=total, desc=label, unit="req", leave=False, file=sys.stderr)
        end = time.monotonic() + 3600
        done = 0
        while done < total and time.monotonic() < end:
            now = sum(v.get("done", 0) for k, v in info.progress.items() if k.startswith("decode"))
            bar.update(now - done)
            done = now
            info.wait_progress("decode0", "done", done + 1, 0.5)
        bar.close()

    return hook


def run_one(args, label: str) -> dict:
    from harness.pd.run import run_transfer

    cfg = _config(args, BACKENDS[label])
    result = run_transfer(cfg, during=_progress(label, args.requests))
    ok = len(result.succeeded("decode"))
    lat = sorted(result.latencies("decode"))
    bytes_moved = sum(o.transfer_bytes or 0 for r in result.side("prefill") for o in r.rooms)
    # Transfer time: "go" to the last room done on decode (excludes decode's byte verification).
    done = [r.t_last_done for r in result.side("decode") if r.t_last_done is not None]
    wall = max(done) if done else float("nan")
    row = {
        "backend": label,
        "ok": ok,
        "requests": args.requests,
        "req_s": result.rooms_per_s(),
        "p50_ms": statistics.median(lat) * 1e3 if lat else float("nan"),
        "p99_ms": lat[min(len(lat) - 1, int(0.99 * len(lat)))] * 1e3 if lat else float("nan"),
        "gb_s": bytes_moved / wall / 1e9 if wall == wall and wall > 0 else float("nan"),
        "ops_per_chunk": _ops_per_chunk(args, label),
        "byte_exact": result.byte_exact() if not args.no_verify else None,
        # CPU of the scheduler-process stand-ins (harness loop + backend threads), both sides.
        "cpu_s_per_request": sum(r.cpu_s or 0.0 for r in result.ranks) / max(args.requests, 1),
        "engine_path": _engine_path(label, result),
        "error": result.error,
        "thread_cpu_ms_per_request": _thread_cpu(result, args.requests) if args.thread_cpu else None,
    }
    if ok < args.requests:
        row["error"] = (row["error"] or "") + f" | {args.requests - ok} requests failed: " + "; ".join(result.failures()[:3])
    return row


def _thread_cpu(result, requests: int) -> dict:
    """{"prefill"|"decode": {thread role: CPU ms per request}}, summed over each side's ranks."""
    out: dict = {}
    for r in result.ranks:
        side = out.setdefault(r.side, {})
        for role, seconds in (r.thread_cpu or {}).items():
            side[role] = side.get(role, 0.0) + seconds * 1e3 / max(requests, 1)
    return {side: dict(sorted(roles.items(), key=lambda kv: -kv[1])) for side, roles in out.items()}


def format_thread_cpu(rows: list) -> str:
    lines = []
    for r in rows:
        for side, roles in (r.get("thread_cpu_ms_per_request") or {}).items():
            total = sum(roles.values())
            lines.append(f"{r['backend']} {side}: {total:.2f} ms/req by thread")
            lines.extend(f"    {ms:7.2f}  {role}" for role, ms in roles.items() if ms >= 0.01)
    return "\n".join(lines)


def _engine_path(label: str, result) -> str:
    if label == "mooncake-tcp":
        return "mooncake-tcp"
    seen = {r.engine_path for r in result.side("prefill") if r.engine_path}
    if seen:
        return ",".join(sorted(seen))
    # The built-in backend's engine is softio too (through the shim): same path rule as ours.
    return "softio-tcp" if os.environ.get("SGLANG_MORI_SOFTIO_FORCE_TCP") == "1" else "softio (intra-host)"


def _ops_per_chunk(args, label: str) -> int:
    """Engine submissions per chunk per decode peer, from each backend's submission structure.

    Ours issues one batch_write per chunk and peer (all layers as pairs of one call). SGLang's
    built-in mori issues one per layer and per K/V; Mooncake one batch per chunk.
    """
    kv_buffers = 2 * args.layers
    return {"ours": 1, "sglang-mori-builtin": kv_buffers, "mooncake-tcp": 1}[label]


def as_json(rows: list) -> str:
    """One JSON object, backend -> its figures (for scripts)."""
    keys = {"requests": "requests", "ok": "ok", "requests_per_s": "req_s", "p50_ms": "p50_ms", "p99_ms": "p99_ms",
            "cpu_s_per_request": "cpu_s_per_request", "engine_path": "engine_path", "byte_exact": "byte_exact",
            "error": "error", "thread_cpu_ms_per_request": "thread_cpu_ms_per_request"}
    return json.dumps({r["backend"]: {out: r.get(key) for out, key in keys.items()} for r in rows})


def format_table(rows: list) -> str:
    head = (f"{'backend':22} {'ok':>9} {'req/s':>9} {'p50 ms':>9} {'p99 ms':>9} {'GB/s':>7} {'ops/chunk':>9} "
            f"{'exact':>6} {'cpu ms/req':>10}  path")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['backend']:22} {r['ok']:>4}/{r['requests']:<4} {r['req_s']:>9.1f} {r['p50_ms']:>9.1f} "
            f"{r['p99_ms']:>9.1f} {r['gb_s']:>7.3f} {r['ops_per_chunk']:>9} {str(r['byte_exact']):>6} "
            f"{r['cpu_s_per_request'] * 1e3:>10.2f}  {r['engine_path']}"
        )
    base = next((r for r in rows if r["backend"] == "ours"), None)
    if base and len(rows) > 1:
        for r in rows:
            if r is not base and r["req_s"] > 0:
                cpu = (f", {base['cpu_s_per_request'] / r['cpu_s_per_request']:.2f}x the CPU per request"
                       if r["cpu_s_per_request"] else "")
                lines.append(f"ours / {r['backend']}: {base['req_s'] / r['req_s']:.2f}x requests/s, "
                             f"{r['p50_ms'] / base['p50_ms']:.2f}x lower p50{cpu}")
    for r in rows:
        if r["error"]:
            lines.append(f"{r['backend']}: {r['error']}")
    return "\n".join(lines)


def run(args) -> int:
    labels = ["ours"] + (["sglang-mori-builtin", "mooncake-tcp"] if args.compare else [])
    if args.backends:
        labels = [b.strip() for b in args.backends.split(",") if b.strip()]
        unknown = [b for b in labels if b not in BACKENDS]
        if unknown:
            print(f"bench transfer: unknown backend(s) {unknown}; choose from {list(BACKENDS)}",
                  file=sys.stderr)
            return 2
    per_token = args.layers * 2 * args.kv_heads * args.head_dim * 2
    print(
        f"bench transfer: {args.requests} requests x {args.prompt_tokens} tokens, {args.layers} layers x "
        f"{args.kv_heads} KV heads x {args.head_dim} head_dim bf16 ({per_token * args.prompt_tokens / 2**20:.1f} MiB "
        f"per request), page {args.page_size}, {args.chunks} chunk(s), concurrency {args.concurrency}",
        flush=True,
    )
    rows = []
    for label in labels:
        t0 = time.monotonic()
        rows.append(run_one(args, label))
        print(f"  {label}: done in {time.monotonic() - t0:.1f} s", flush=True)
    if args.json:
        print(as_json(rows))
    else:
        print(format_table(rows))
        if args.thread_cpu:
            print(format_thread_cpu(rows))
    return 0 if all(r["ok"] == r["requests"] and not r["error"] for r in rows) else 1
