#!/usr/bin/env python3
"""Goodput under TTFT/ITL SLOs across request rates, against any OpenAI-compatible server.

The method of the vLLM MoRI-IO blog (after DistServe): for each request rate, send requests with
Poisson arrivals, stream every response through /v1/completions, and record per request the time to
first token (TTFT) and the inter-token latencies (ITL). A request *attains* the SLO when it finished,
its TTFT is below --ttft-slo and its ITL statistic (--itl-stat, default the request's mean ITL) is
below --itl-slo. Per rate we report SLO attainment (attaining / sent) and goodput (attaining
requests per second of the run); over the sweep, the goodput rate is the highest rate whose attainment
reaches --attainment-target (90% by default).

    python scripts/bench_goodput.py --base-url http://127.0.0.1:8000 --rates 1,2,4,8 \
        --num-requests 100 --input-words 2000 --output-tokens 1000 --out-dir goodput-out

Bounded: at most --num-requests per rate, no new request after --max-duration seconds of a rate,
each request cut at --request-timeout, at most --max-concurrency open at once.
Writes goodput.json, goodput.csv and attainment.png (matplotlib, Agg) into --out-dir.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import math
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

# ---- statistics (pure, unit-tested) -------------------------------------------------------------


@dataclass
class RequestRecord:
    rate: float
    sent_at: float  # seconds since the rate's start
    ok: bool = False
    ttft: Optional[float] = None  # seconds
    itls: List[float] = field(default_factory=list)  # seconds between successive token chunks
    output_chunks: int = 0
    error: str = ""


@dataclass(frozen=True)
class SLO:
    ttft_s: float = 1.0
    itl_s: float = 0.050
    itl_stat: str = "mean"  # mean | p90 | p99 | max of the request's ITLs


def percentile(values: Sequence[float], q: float) -> Optional[float]:
    """Linear-interpolated percentile, q in [0, 100]; None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def itl_statistic(itls: Sequence[float], stat: str) -> float:
    """One request's ITL figure; 0 when it produced a single chunk (nothing to wait between)."""
    if not itls:
        return 0.0
    if stat == "mean":
        return statistics.fmean(itls)
    if stat == "max":
        return max(itls)
    if stat in ("p90", "p99"):
        return percentile(itls, float(stat[1:]))
    raise ValueError(f"unknown ITL statistic {stat!r}")


def attains(rec: RequestRecord, slo: SLO) -> bool:
    return (rec.ok and rec.ttft is not None and rec.ttft < slo.ttft_s
            and itl_statistic(rec.itls, slo.itl_stat) < slo.itl_s)


def timings_from_chunks(sent: float, chunk_times: Sequence[float]):
    """(TTFT, ITLs) from the arrival times of the chunks that carried text."""
    if not chunk_times:
        return None, []
    return chunk_times[0] - sent, [b - a for a, b in zip(chunk_times, chunk_times[1:])]


def summarize(rate: float, records: Sequence[RequestRecord], slo: SLO, duration_s: float) -> Dict:
    """One row of the table. Failed requests count as not attaining; goodput divides the attaining
    requests by the wall time of the rate's run (first send to last completion)."""
    sent = len(records)
    ok = [r for r in records if r.ok]
    good = sum(1 for r in records if attains(r, slo))
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    itl_per_req = [itl_statistic(r.itls, slo.itl_stat) for r in ok]
    return {
        "rate": rate,
        "sent": sent,
        "ok": len(ok),
        "errors": sent - len(ok),
        "attained": good,
        "attainment": good / sent if sent else 0.0,
        "goodput_rps": good / duration_s if duration_s > 0 else 0.0,
        "throughput_rps": len(ok) / duration_s if duration_s > 0 else 0.0,
        "duration_s": duration_s,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "itl_p50_s": percentile(itl_per_req, 50),
        "itl_p99_s": percentile(itl_per_req, 99),
        "ttft_violations": sum(1 for r in ok if r.ttft is None or r.ttft >= slo.ttft_s),
        "itl_violations": sum(1 for x in itl_per_req if x >= slo.itl_s),
    }


def goodput_rate(rows: Sequence[Dict], target: float) -> Optional[float]:
    """Highest swept rate whose attainment reaches `target`, counting only rates below the first
    that misses it (attainment is meant to fall with load; a lucky high rate after a miss does
    not count). None if even the lowest rate misses."""
    best = None
    for row in sorted(rows, key=lambda r: r["rate"]):
        if row["attainment"] + 1e-12 < target:
            break
        best = row["rate"]
    return best


def poisson_arrivals(rate: float, n: int, seed: int) -> List[float]:
    """Send offsets (seconds) of n requests with exponential gaps of mean 1/rate."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def make_prompt(words: int, seed: int) -> str:
    """A varied prompt of about `words` tokens, so prefix caches do not make runs look faster."""
    rng = random.Random(seed)
    vocab = ("time person year way day thing man world life hand part child eye woman place work "
             "week case point government company number group problem fact").split()
    return f"[{seed}] " + " ".join(rng.choice(vocab) for _ in range(max(1, words)))


# ---- the client ---------------------------------------------------------------------------------


async def one_request(session, args, rate: float, sent_at: float, prompt: str):
    import aiohttp

    rec = RequestRecord(rate=rate, sent_at=sent_at)
    body = {"model": args.model, "prompt": prompt, "max_tokens": args.output_tokens,
            "stream": True, "temperature": 0.0}
    if not args.no_ignore_eos:
        body["ignore_eos"] = True  # SGLang/vLLM extension: fixed output length per request
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    chunk_times: List[float] = []
    start = time.perf_counter()
    try:
        timeout = aiohttp.ClientTimeout(total=args.request_timeout)
        async with session.post(args.base_url.rstrip("/") + "/v1/completions", json=body,
                                headers=headers, timeout=timeout) as resp:
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return rec
            async for raw in resp.content:
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                try:
                    choices = json.loads(data).get("choices") or []
                except ValueError:
                    continue
                if choices and choices[0].get("text"):
                    chunk_times.append(time.perf_counter())
        rec.ttft, rec.itls = timings_from_chunks(start, chunk_times)
        rec.output_chunks = len(chunk_times)
        rec.ok = bool(chunk_times)
        if not rec.ok:
            rec.error = "stream ended without text"
    except asyncio.TimeoutError:
        rec.error = f"timeout after {args.request_timeout}s"
    except Exception as exc:  # connection refused, reset, bad payload: a failed request, not a crash
        rec.error = f"{type(exc).__name__}: {exc}"
    return rec


async def run_rate(args, rate: float, seed: int) -> Dict:
    import aiohttp

    offsets = poisson_arrivals(rate, args.num_requests, seed)
    sem = asyncio.Semaphore(args.max_concurrency)
    records: List[RequestRecord] = []

    async def fire(i: int, offset: float, session):
        async with sem:
            rec = await one_request(session, args, rate, offset,
                                    make_prompt(args.input_words, seed * 100003 + i))
        records.append(rec)

    connector = aiohttp.TCPConnector(limit=args.max_concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        t0 = time.perf_counter()
        tasks = []
        for i, offset in enumerate(offsets):
            if offset > args.max_duration:
                break
            delay = t0 + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(fire(i, offset, session)))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    slo = SLO(args.ttft_slo, args.itl_slo, args.itl_stat)
    row = summarize(rate, records, slo, duration)
    errors = sorted({r.error for r in records if r.error})
    row["error_samples"] = errors[:3]
    row["records"] = [asdict(r) for r in sorted(records, key=lambda r: r.sent_at)]
    return row


# ---- output -------------------------------------------------------------------------------------


def fmt_ms(x: Optional[float]) -> str:
    return "-" if x is None else f"{x * 1000:.0f}"


def table(rows: Sequence[Dict], slo: SLO) -> str:
    head = (f"{'rate':>6} {'sent':>5} {'ok':>5} {'attain%':>8} {'goodput':>8} {'ttft p50':>9} "
            f"{'ttft p99':>9} {'itl p50':>8} {'itl p99':>8} {'>ttft':>6} {'>itl':>5}")
    lines = [f"SLO: TTFT < {slo.ttft_s * 1000:.0f} ms, ITL ({slo.itl_stat}) < {slo.itl_s * 1000:.0f} ms;"
             " goodput in req/s, latencies in ms", head]
    for r in rows:
        lines.append(f"{r['rate']:>6g} {r['sent']:>5} {r['ok']:>5} {100 * r['attainment']:>7.1f}% "
                     f"{r['goodput_rps']:>8.2f} {fmt_ms(r['ttft_p50_s']):>9} {fmt_ms(r['ttft_p99_s']):>9} "
                     f"{fmt_ms(r['itl_p50_s']):>8} {fmt_ms(r['itl_p99_s']):>8} "
                     f"{r['ttft_violations']:>6} {r['itl_violations']:>5}")
    return "\n".join(lines)


def plot(rows: Sequence[Dict], target: float, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = [r["rate"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
    ax.plot(rates, [100 * r["attainment"] for r in rows], marker="o", label="SLO attainment")
    ax.axhline(100 * target, color="grey", linestyle="--", linewidth=1,
               label=f"target {100 * target:.0f}%")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("requests meeting TTFT and ITL SLOs (%)")
    ax.set_ylim(0, 105)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", required=True, help="server or router, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default="default", help="model name sent in requests")
    p.add_argument("--api-key", default="")
    p.add_argument("--rates", default="0.5,1,2,4,8", help="comma list of request rates (req/s)")
    p.add_argument("--num-requests", type=int, default=100, help="requests per rate (max)")
    p.add_argument("--max-duration", type=float, default=300.0, help="seconds of sending per rate (max)")
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--max-concurrency", type=int, default=256)
    p.add_argument("--input-words", type=int, default=1000, help="prompt length, about tokens")
    p.add_argument("--output-tokens", type=int, default=256)
    p.add_argument("--no-ignore-eos", action="store_true", help="for servers without ignore_eos")
    p.add_argument("--ttft-slo", type=float, default=1.0, help="seconds (default 1)")
    p.add_argument("--itl-slo", type=float, default=0.050, help="seconds (default 0.05)")
    p.add_argument("--itl-stat", choices=("mean", "p90", "p99", "max"), default="mean",
                   help="which of a request's ITLs must stay under --itl-slo")
    p.add_argument("--attainment-target", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default="goodput-out")
    p.add_argument("--title", default="")
    args = p.parse_args(argv)
    args.rate_list = [float(x) for x in args.rates.split(",") if x.strip()]
    if not args.rate_list or min(args.rate_list) <= 0:
        p.error("--rates needs positive numbers")
    if args.num_requests < 1 or args.max_concurrency < 1:
        p.error("--num-requests and --max-concurrency must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    slo = SLO(args.ttft_slo, args.itl_slo, args.itl_stat)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, rate in enumerate(args.rate_list):
        row = asyncio.run(run_rate(args, rate, args.seed + i))
        rows.append(row)
        print(f"rate {rate:g}: {row['attained']}/{row['sent']} attained, {row['errors']} errors"
              + (f" ({row['error_samples'][0]})" if row["error_samples"] else ""), flush=True)
    best = goodput_rate(rows, args.attainment_target)
    print()
    print(table(rows, slo))
    print(f"goodput rate (highest rate with >= {100 * args.attainment_target:.0f}% attainment): "
          + ("none of the swept rates" if best is None else f"{best:g} req/s"))
    summary = {"slo": asdict(slo), "attainment_target": args.attainment_target, "goodput_rate": best,
               "base_url": args.base_url, "input_words": args.input_words,
               "output_tokens": args.output_tokens, "rows": rows}
    (out / "goodput.json").write_text(json.dumps(summary, indent=1))
    with open(out / "goodput.csv", "w", newline="") as fh:
        keys = [k for k in rows[0] if k not in ("records", "error_samples")]
        writer = csv.DictWriter(fh, fieldnames=keys, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    title = args.title or f"{args.base_url}: TTFT<{args.ttft_slo:g}s, ITL<{args.itl_slo * 1000:g}ms"
    plot(rows, args.attainment_target, out / "attainment.png", title)
    print(f"wrote {out / 'goodput.json'}, {out / 'goodput.csv'}, {out / 'attainment.png'}")
    return 0 if any(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
