"""The streamed clients as they were before session 16, kept for the same-call A/B of the PD front
(pd_latency.py --clients new,old; docs/benchmarks.md, "Session 16").

Before: the PD front encoded the body twice, the prefill request on a pool thread and the decode
stream in the caller, through `requests` (each encoding and request preparation GIL-bound Python,
so each send waited for the other's); prefill's body had no `stream`. The standalone client sent
through `requests` too. servers.PDClient.stream / servers.generate_stream are what replaced them.
"""

from __future__ import annotations

import json
import time
from typing import Dict

import requests

from servers import PDClient, generate


def stream_two_threads(client: PDClient, body: Dict) -> Dict:
    body = client.with_bootstrap(body)
    sent_at = time.time()
    pre = client.pool.submit(generate, client.prefill.url, body)
    reply = generate_stream_requests(client.decode.url, body)
    pre_reply = pre.result()
    if "error" in pre_reply and "error" not in reply:
        reply = dict(reply, prefill_error=pre_reply["error"])
    return dict(reply, room=body["bootstrap_room"], sent_at=sent_at)


def generate_stream_requests(url: str, body: Dict, timeout_s: float = 300) -> Dict:
    start, sent_at = time.monotonic(), time.time()
    ttft, last_t, done, itl, first_at = None, None, 0, [], None
    try:
        with requests.post(f"{url}/generate", json=dict(body, stream=True), timeout=timeout_s,
                           stream=True) as r:
            if r.status_code != 200:
                return {"error": f"HTTP {r.status_code}: {r.text[:300]}"}
            for line in r.iter_lines(chunk_size=None):
                if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                    continue
                chunk = json.loads(line[5:])
                if "error" in chunk:
                    return {"error": json.dumps(chunk["error"])[:300]}
                tokens = chunk.get("meta_info", {}).get("completion_tokens") or len(chunk.get("output_ids") or [])
                now = time.monotonic()
                if tokens > done:
                    if ttft is None:
                        ttft, first_at = now - start, time.time()
                    else:
                        itl.extend([(now - last_t) / (tokens - done)] * (tokens - done))
                    last_t, done = now, tokens
    except requests.RequestException as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"ttft_s": ttft, "itl_s": itl, "tokens": done, "e2e_s": time.monotonic() - start,
            "sent_at": sent_at, "first_at": first_at}
