"""HTTP calls to SGLang servers and the router, with the timings the tests and benchmarks report.

Only `requests` and the standard library: these run in the test process, the demo and the benchmark.
"""

from __future__ import annotations

import json
import socket
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional, Sequence
from urllib.parse import urlparse

import requests


def sampling(max_new_tokens: int, ignore_eos: bool = False) -> Dict:
    # Greedy: the only setting under which PD and standalone outputs must be token-identical.
    return {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": ignore_eos}


@dataclass
class Generation:
    """One /generate result; timings in seconds, measured at the client."""

    status: int
    output_ids: List[int] = field(default_factory=list)
    text: str = ""
    meta: Dict = field(default_factory=dict)
    error: str = ""
    e2e_s: float = 0.0
    ttft_s: Optional[float] = None  # streaming only: request sent -> first token chunk
    itl_s: List[float] = field(default_factory=list)  # streaming only: one gap per token after the first
    chunks: int = 0

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error

    @property
    def finish_type(self) -> Optional[str]:
        reason = self.meta.get("finish_reason")
        return reason.get("type") if isinstance(reason, dict) else reason


def generate(url: str, text: str, max_new_tokens: int, timeout_s: float = 120.0,
             ignore_eos: bool = False, extra: Optional[Dict] = None) -> Generation:
    payload = {"text": text, "sampling_params": sampling(max_new_tokens, ignore_eos), **(extra or {})}
    start = time.monotonic()
    try:
        r = requests.post(f"{url}/generate", json=payload, timeout=timeout_s)
    except requests.RequestException as exc:
        return Generation(status=0, error=f"{type(exc).__name__}: {exc}", e2e_s=time.monotonic() - start)
    elapsed = time.monotonic() - start
    if r.status_code != 200:
        return Generation(status=r.status_code, error=r.text[:2000], e2e_s=elapsed)
    body = r.json()
    return Generation(status=200, output_ids=body.get("output_ids", []), text=body.get("text", ""),
                      meta=body.get("meta_info", {}), e2e_s=elapsed)


def _sse_events(resp: requests.Response) -> Iterator[str]:
    """The data payloads of a server-sent-event stream, as SGLang and the router send them."""
    # chunk_size=None: hand over each piece as it arrives. With a fixed size, requests blocks until
    # that many bytes are buffered, which groups several tokens and falsifies TTFT and ITL.
    for line in resp.iter_lines(chunk_size=None, decode_unicode=False):
        if line.startswith(b"data:"):
            yield line[5:].strip().decode("utf-8", errors="replace")


def generate_stream(url: str, text: str, max_new_tokens: int, timeout_s: float = 120.0,
                    ignore_eos: bool = False) -> Generation:
    """Streaming /generate; SGLang sends cumulative output_ids in every chunk."""
    payload = {"text": text, "stream": True, "sampling_params": sampling(max_new_tokens, ignore_eos)}
    start = time.monotonic()
    result = Generation(status=0)
    last_token_t = None
    try:
        with requests.post(f"{url}/generate", json=payload, timeout=timeout_s, stream=True) as r:
            result.status = r.status_code
            if r.status_code != 200:
                result.error = r.text[:2000]
                return result
            for data in _sse_events(r):
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = json.dumps(chunk["error"])[:2000]
                    break
                now = time.monotonic()
                ids = chunk.get("output_ids", [])
                new_tokens = len(ids) - len(result.output_ids)
                if new_tokens > 0:
                    # A server that falls behind sends several tokens in one chunk (outputs are
                    # cumulative): spread the gap over them, so mean(itl_s) = (last - first) / (n - 1).
                    if last_token_t is None:
                        result.ttft_s = now - start
                        result.itl_s.extend([0.0] * (new_tokens - 1))
                    else:
                        result.itl_s.extend([(now - last_token_t) / new_tokens] * new_tokens)
                    last_token_t = now
                result.output_ids = ids
                result.text = chunk.get("text", result.text)
                result.meta = chunk.get("meta_info", result.meta)
                result.chunks += 1
    except requests.RequestException as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    result.e2e_s = time.monotonic() - start
    return result


def chat(url: str, content: str, max_tokens: int, timeout_s: float = 120.0) -> Dict:
    payload = {"model": "default", "messages": [{"role": "user", "content": content}],
               "max_tokens": max_tokens, "temperature": 0.0}
    r = requests.post(f"{url}/v1/chat/completions", json=payload, timeout=timeout_s)
    r.raise_for_status()
    return r.json()


def chat_stream(url: str, content: str, max_tokens: int, timeout_s: float = 120.0,
                include_usage: bool = False) -> Dict:
    """Streaming chat; returns the concatenated content, the finish reason and the chunk count.

    Also `ttft_s` (request sent -> first chunk with content), `itl_s` (gaps between later content
    chunks; a chunk may carry several tokens), `e2e_s`, with include_usage the final `usage`, and
    `error` (non-empty if the server reported one in the stream; the stream then ends there).
    """
    payload = {"model": "default", "messages": [{"role": "user", "content": content}],
               "max_tokens": max_tokens, "temperature": 0.0, "stream": True}
    if include_usage:
        payload["stream_options"] = {"include_usage": True}
    parts: List[str] = []
    finish, chunks, done, usage, error = None, 0, False, None, ""
    start = time.monotonic()
    ttft, last, itl = None, None, []
    with requests.post(f"{url}/v1/chat/completions", json=payload, timeout=timeout_s, stream=True) as r:
        r.raise_for_status()
        for data in _sse_events(r):
            if data == "[DONE]":
                done = True
                break
            chunks += 1
            event = json.loads(data)
            if "error" in event or event.get("object") == "error":  # SGLang reports failures in-stream
                error = json.dumps(event.get("error", event))[:2000]
                break
            usage = event.get("usage") or usage
            for choice in event.get("choices", []):
                piece = choice.get("delta", {}).get("content") or ""
                if piece:
                    now = time.monotonic()
                    if ttft is None:
                        ttft = now - start
                    else:
                        itl.append(now - last)
                    last = now
                parts.append(piece)
                finish = choice.get("finish_reason") or finish
    return {"content": "".join(parts), "finish_reason": finish, "chunks": chunks, "done": done,
            "ttft_s": ttft, "itl_s": itl, "e2e_s": time.monotonic() - start, "usage": usage,
            "error": error}


def generate_many(url: str, prompts: Sequence[str], max_new_tokens: int, concurrency: int,
                  timeout_s: float = 300.0, stream: bool = False, ignore_eos: bool = False
                  ) -> List[Generation]:
    """All prompts at once (up to `concurrency` in flight); results in prompt order."""
    fn = generate_stream if stream else generate
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        futures = [pool.submit(fn, url, p, max_new_tokens, timeout_s, ignore_eos) for p in prompts]
        return [f.result() for f in futures]


def open_stream_and_hang_up(url: str, text: str, max_new_tokens: int,
                            hang_up_when: Callable[[bytes], bool], timeout_s: float = 60.0) -> bytes:
    """Send a streaming /generate on a raw socket and close it abruptly, like a client that goes away.

    `hang_up_when(received_so_far)` is polled about every 20 ms; the socket is reset as soon as it
    returns True (e.g. once a `data:` event arrived, or once a server reports the request queued).
    Returns what was received before hanging up.
    """
    parsed = urlparse(url)
    body = json.dumps({"text": text, "stream": True,
                       "sampling_params": sampling(max_new_tokens, ignore_eos=True)}).encode()
    head = (f"POST /generate HTTP/1.1\r\nHost: {parsed.hostname}:{parsed.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    received = b""
    sock = socket.create_connection((parsed.hostname, parsed.port), timeout=timeout_s)
    try:
        sock.sendall(head + body)
        sock.settimeout(0.02)
        deadline = time.monotonic() + timeout_s
        while not hang_up_when(received):
            if time.monotonic() > deadline:
                raise TimeoutError(f"hang-up condition not met in {timeout_s} s; got {received[:300]!r}")
            try:
                data = sock.recv(65536)
            except socket.timeout:
                continue
            if not data:
                raise ConnectionError(f"server closed the stream early: {received[:500]!r}")
            received += data
    finally:
        # SO_LINGER 0: close with a reset, the harshest way a client can disappear.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
    return received


def get_json(url: str, timeout_s: float = 5.0) -> Dict:
    r = requests.get(url, timeout=timeout_s)
    r.raise_for_status()
    return r.json()


def requests_in_server(url: str) -> int:
    """Requests a server holds in any queue (running, waiting, PD bootstrap/transfer), from /v1/loads.

    That is the snapshot the scheduler last published, once per loop pass: it may still count a
    request whose response has already reached the client. Poll it for 0 with a deadline.
    """
    total = 0
    for load in get_json(f"{url}/v1/loads?include=all")["loads"]:
        total += load.get("num_running_reqs", 0) + load.get("num_waiting_reqs", 0)
        disagg = load.get("disaggregation") or {}
        total += sum(disagg.get(k, 0) for k in (
            "prefill_bootstrap_queue_reqs", "prefill_inflight_queue_reqs",
            "decode_prealloc_queue_reqs", "decode_transfer_queue_reqs", "decode_retracted_queue_reqs"))
    return total


def metric_total(url: str, name: str, **labels: str) -> float:
    """Sum of every series of Prometheus metric `name` on `url`/metrics whose labels include `labels`."""
    from prometheus_client.parser import text_string_to_metric_families

    r = requests.get(f"{url}/metrics", timeout=10)
    r.raise_for_status()
    want = set(labels.items())
    return sum(s.value for family in text_string_to_metric_families(r.text) for s in family.samples
               if s.name == name and want <= set(s.labels.items()))
