"""scripts/gpu_sglang/servers.py's PD front (PDClient.stream, what pd_latency.py times) and the
standalone client beside it, against two small HTTP servers on 127.0.0.1 that record what they got
and stream SGLang-shaped replies (`data: {...}` lines, then `data: [DONE]`)."""

from __future__ import annotations

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "gpu_sglang"))
import servers  # noqa: E402


class FakeServer:
    """POST /generate: records the raw body, then answers `status` with `tokens` tokens, streamed
    where the body asks for a stream."""

    def __init__(self, status: int = 200, tokens: int = 3):
        self.bodies, self.status, self.tokens = [], status, tokens
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_POST(self):
                outer.bodies.append(self.rfile.read(int(self.headers["Content-Length"])))
                if outer.status != 200:
                    text = b"bad request"
                    self.send_response(outer.status)
                    self.send_header("Content-Length", str(len(text)))
                    self.end_headers()
                    self.wfile.write(text)
                    return
                if not json.loads(outer.bodies[-1]).get("stream"):  # SGLang answers one JSON
                    text = json.dumps({"output_ids": list(range(outer.tokens)),
                                       "meta_info": {"completion_tokens": outer.tokens}}).encode()
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(text)))
                    self.end_headers()
                    self.wfile.write(text)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                lines = [json.dumps({"output_ids": list(range(n)), "meta_info": {"completion_tokens": n}})
                         for n in range(1, outer.tokens + 1)] + ["[DONE]"]
                for line in lines:
                    data = f"data: {line}\n\n".encode()
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.write(b"0\r\n\r\n")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def pair():
    made = []

    def make(prefill_status=200, decode_tokens=3):
        pre, dec = FakeServer(status=prefill_status, tokens=1), FakeServer(tokens=decode_tokens)
        made.extend([pre, dec])
        client = servers.PDClient(SimpleNamespace(url=pre.url), SimpleNamespace(url=dec.url), bootstrap_port=8998)
        return pre, dec, client
    yield make
    for s in made:
        s.close()


BODY = {"input_ids": list(range(10, 8202)), "sampling_params": {"max_new_tokens": 3}}


def test_both_servers_get_one_identical_body_with_the_room_and_stream_on(pair):
    pre, dec, client = pair()
    reply = client.stream(BODY)
    assert pre.bodies == dec.bodies and len(pre.bodies) == 1  # the very bytes, as the router forwards one body
    sent = json.loads(pre.bodies[0])
    assert sent["input_ids"] == BODY["input_ids"] and sent["stream"] is True
    assert sent["bootstrap_room"] == reply["room"] and sent["bootstrap_port"] == 8998
    assert reply["tokens"] == 3 and len(reply["itl_s"]) == 2 and reply["ttft_s"] > 0
    assert reply["first_at"] >= reply["sent_at"]


def test_the_body_is_encoded_once_per_pd_request(pair, monkeypatch):
    """The bug: the prefill request (a pool thread) and the decode stream (the caller) each encoded
    the 8K-token body, and the two encodings held the GIL in turn, delaying one send by the
    other's encoding; the Rust router encodes once and sends both."""
    pre, dec, client = pair()
    calls = []
    real_dumps = json.dumps

    def counting_dumps(obj, *args, **kwargs):
        if isinstance(obj, dict) and "input_ids" in obj:
            calls.append(threading.current_thread().name)
        return real_dumps(obj, *args, **kwargs)
    monkeypatch.setattr(json, "dumps", counting_dumps)
    client.stream(BODY)
    assert len(calls) == 1
    assert calls == [threading.current_thread().name]  # before either request is sent, on the caller


def test_standalone_client_sends_the_same_way(pair, monkeypatch):
    _, dec, _ = pair()
    reply = servers.generate_stream(dec.url, BODY)
    assert json.loads(dec.bodies[0]) == dict(BODY, stream=True)
    assert reply["tokens"] == 3 and reply["first_at"] >= reply["sent_at"]


def test_a_prefill_failure_is_kept_beside_decodes_reply(pair):
    _, _, client = pair(prefill_status=400)
    reply = client.stream(BODY)
    assert reply["tokens"] == 3
    assert reply["prefill_error"].startswith("HTTP 400") and "bad request" in reply["prefill_error"]


def test_an_unreachable_server_is_an_error_not_an_exception(pair):
    pre, dec, client = pair()
    dec.close()  # nothing listens on decode's port any more
    reply = client.stream(BODY)
    assert "error" in reply and "Connection" in reply["error"]
    assert len(pre.bodies) == 1  # prefill still got its request (the router sends both)


def test_the_clients_before_session_16_still_run_for_the_ab(pair):
    """client_before16.py: the old PD front (two encodings, two threads; prefill not streamed) and
    the old standalone client, kept so one GPU call can measure both fronts on the same servers."""
    import client_before16

    pre, dec, client = pair()
    reply = client_before16.stream_two_threads(client, BODY)
    assert reply["tokens"] == 3 and reply["first_at"] >= reply["sent_at"]
    assert "stream" not in json.loads(pre.bodies[0]) and json.loads(dec.bodies[0])["stream"] is True
    reply = client_before16.generate_stream_requests(dec.url, BODY)
    assert reply["tokens"] == 3 and len(reply["itl_s"]) == 2
