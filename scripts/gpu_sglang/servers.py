"""Real SGLang servers on the GPU machine and the PD front that stands in for sglang_router.

`PDClient` does for /generate what sglang_router does in PD mode (sglang_router's 30 MB wheel does not
fit beside sglang in one device call): the same body plus bootstrap_host / bootstrap_port / a random
63-bit bootstrap_room, POSTed to the prefill and the decode server at once; the decode reply (or
stream) is the answer.

The streamed path (`PDClient.stream`, what pd_latency.py times) encodes the body once and puts both
requests on the wire from one thread before reading either reply, as the Rust router does (one JSON
value for both, `tokio::join!` of the two sends): two requests encoded and sent by two Python
threads wait for each other's encoding on the GIL, which the router never does. The standalone
client (`generate_stream`) takes the same path (encode once, `send_post`, `read_stream`), so the
two TTFTs are measured alike.
"""

from __future__ import annotations

import http.client
import json
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Optional
from urllib.parse import urlsplit

import requests

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "test"))
from harness.procs import ManagedProcess, wait_until  # noqa: E402

HOST = "127.0.0.1"


def sampling(max_new_tokens: int) -> Dict:
    return {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}


class Server:
    def __init__(self, name: str, argv: List[str], env: Dict[str, str], logs: Path, port: int):
        self.name, self.port = name, port
        self.url = f"http://{HOST}:{port}"
        self.proc = ManagedProcess(name, argv, env, logs / f"{name}.log")
        self.ready_s: Optional[float] = None

    def start(self) -> "Server":
        self.proc.start()
        return self

    def wait_ready(self, deadline_s: float) -> None:
        def healthy() -> bool:
            try:
                return requests.get(f"{self.url}/health", timeout=2).status_code == 200
            except requests.RequestException:
                return False
        self.ready_s = wait_until(healthy, deadline_s, self.name, interval_s=1.0, alive=self.proc.alive)

    def metrics(self) -> Dict[str, float]:
        try:
            text = requests.get(f"{self.url}/metrics", timeout=5).text
        except requests.RequestException as exc:
            return {"error": str(exc)}
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line.startswith("sglang_mori_") and not line.startswith("#")}

    def stop(self) -> None:
        self.proc.stop()


def server_argv(model: str, port: int, gpu: int, mem: float, extra: List[str], tp: int = 1) -> List[str]:
    """Defaults (overlap scheduler, prefill and decode CUDA graphs) except the kernels SGLang has
    without sgl_kernel: Triton attention, torch sampling; with TP > 1, NCCL's all-reduce (SGLang's
    custom all-reduce is an sgl_kernel op)."""
    tp_flags = ["--tp-size", str(tp), "--disable-custom-all-reduce"] if tp > 1 else []
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", model,
            "--skip-tokenizer-init", "--host", HOST, "--port", str(port), "--base-gpu-id", str(gpu),
            "--attention-backend", "triton", "--sampling-backend", "pytorch",
            "--mem-fraction-static", str(mem), "--random-seed", "1234", "--enable-metrics",
            "--log-level", "info"] + tp_flags + extra


def generate(url: str, body: Dict, timeout_s: float = 300) -> Dict:
    r = requests.post(f"{url}/generate", json=body, timeout=timeout_s)
    if r.status_code != 200:
        return {"error": f"HTTP {r.status_code}: {r.text[:500]}"}
    return r.json()


class PDClient:
    """What sglang_router (mini_lb) does for one /generate: bootstrap fields, both servers at once."""

    def __init__(self, prefill: Server, decode: Server, bootstrap_port: int):
        self.prefill, self.decode, self.bootstrap_port = prefill, decode, bootstrap_port
        self.pool = ThreadPoolExecutor(max_workers=64)

    def with_bootstrap(self, body: Dict) -> Dict:
        return dict(body, bootstrap_host=HOST, bootstrap_port=self.bootstrap_port,
                    bootstrap_room=random.randint(0, 2**63 - 1))

    def stream(self, body: Dict) -> Dict:
        """As sglang_router's PD dispatch for a streamed /generate: one body (stream on, as the
        client sent it) to both servers, both sends made before either reply is read; prefill's
        reply is drained beside decode's stream."""
        start, sent_at = time.monotonic(), time.time()
        body = self.with_bootstrap(dict(body, stream=True))
        payload = encode(body)
        pre_conn = send_post(self.prefill.url, payload)
        dec_conn = send_post(self.decode.url, payload)
        pre = self.pool.submit(read_stream, pre_conn, start)
        reply = read_stream(dec_conn, start)
        pre_reply = pre.result()
        if "error" in pre_reply and "error" not in reply:
            reply = dict(reply, prefill_error=pre_reply["error"])
        return dict(reply, room=body["bootstrap_room"], sent_at=sent_at)

    def __call__(self, body: Dict) -> Dict:
        body = self.with_bootstrap(body)
        pre = self.pool.submit(generate, self.prefill.url, body)
        dec = self.pool.submit(generate, self.decode.url, body)
        pre_reply = pre.result()
        reply = dec.result()
        if "error" in pre_reply:  # kept beside decode's own error: the fault runs report both causes
            reply = dict(reply, prefill_error=pre_reply["error"])
        return reply


def encode(body: Dict) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


def send_post(url: str, payload: bytes, timeout_s: float = 300):
    """Connect and send POST /generate with an encoded JSON body; the reply is read later
    (read_stream). A connection that fails is returned as its error, for read_stream to report."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout_s)
    try:
        conn.request("POST", "/generate", body=payload, headers={"Content-Type": "application/json"})
    except (OSError, http.client.HTTPException) as exc:
        conn.close()
        return exc
    return conn


def read_stream(conn, start: float) -> Dict:
    """Read a streamed /generate reply: time to the first token (from `start`, time.monotonic) and
    the gaps after it, counted by meta_info.completion_tokens (whether a chunk's output_ids are
    cumulative or not)."""
    if isinstance(conn, Exception):
        return {"error": f"{type(conn).__name__}: {conn}"}
    ttft, last_t, done, itl, first_at = None, None, 0, [], None
    try:
        r = conn.getresponse()
        if r.status != 200:
            return {"error": f"HTTP {r.status}: {r.read()[:300].decode(errors='replace')}"}
        for line in r:
            line = line.strip()
            if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk:
                return {"error": json.dumps(chunk["error"])[:300]}
            # completion_tokens counts all tokens so far; else output_ids (cumulative in SGLang).
            tokens = chunk.get("meta_info", {}).get("completion_tokens") or len(chunk.get("output_ids") or [])
            now = time.monotonic()
            if tokens > done:
                if ttft is None:
                    ttft, first_at = now - start, time.time()
                else:
                    itl.extend([(now - last_t) / (tokens - done)] * (tokens - done))
                last_t, done = now, tokens
    except (OSError, http.client.HTTPException, ValueError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        conn.close()
    return {"ttft_s": ttft, "itl_s": itl, "tokens": done, "e2e_s": time.monotonic() - start, "first_at": first_at}


def generate_stream(url: str, body: Dict, timeout_s: float = 300) -> Dict:
    """Streaming /generate to one server, the way PDClient.stream sends to two: encoded once, sent,
    then read (read_stream)."""
    start, sent_at = time.monotonic(), time.time()
    reply = read_stream(send_post(url, encode(dict(body, stream=True)), timeout_s), start)
    return dict(reply, sent_at=sent_at)


def record_failure(result: Dict, name: str, servers: List["Server"], exc: Exception, tail_lines: int) -> None:
    """A run that broke keeps its cause and each server's log tail in its result, and prints both:
    the device call returns only $OUT and the output's end."""
    result["failed"] = f"{type(exc).__name__}: {exc}"
    result["log_tails"] = {s.name: s.proc.tail(tail_lines) for s in servers}
    print(f"[{name}] FAILED: {result['failed']}", flush=True)
    for s in servers:
        print(f"--- {s.name}\n{s.proc.tail(tail_lines)}", flush=True)
