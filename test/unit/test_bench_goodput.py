"""scripts/bench_goodput.py: its statistics, and one run against a tiny fake streaming server."""

import importlib.util
import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "bench_goodput.py"
spec = importlib.util.spec_from_file_location("bench_goodput", SCRIPT)
bg = importlib.util.module_from_spec(spec)
sys.modules["bench_goodput"] = bg  # dataclasses look the module up by name
spec.loader.exec_module(bg)


def rec(ttft, itls, ok=True):
    return bg.RequestRecord(rate=1.0, sent_at=0.0, ok=ok, ttft=ttft, itls=list(itls))


# ---- statistics --------------------------------------------------------------------------------
def test_attainment_needs_both_slos_and_success():
    slo = bg.SLO(ttft_s=1.0, itl_s=0.05)
    assert bg.attains(rec(0.5, [0.01, 0.02]), slo)
    assert not bg.attains(rec(1.0, [0.01]), slo)  # strictly below
    assert not bg.attains(rec(0.5, [0.06, 0.06]), slo)
    assert not bg.attains(rec(0.5, [0.01], ok=False), slo)
    assert bg.attains(rec(0.2, []), slo)  # one chunk: no ITL to violate


def test_itl_statistic_choices():
    itls = [0.01] * 9 + [0.2]
    assert bg.itl_statistic(itls, "mean") == pytest.approx(0.029)
    assert bg.itl_statistic(itls, "max") == 0.2
    assert bg.itl_statistic(itls, "p90") == pytest.approx(0.029)  # interpolated between 0.01 and 0.2
    mean_slo, max_slo = bg.SLO(itl_s=0.05, itl_stat="mean"), bg.SLO(itl_s=0.05, itl_stat="max")
    assert bg.attains(rec(0.1, itls), mean_slo) and not bg.attains(rec(0.1, itls), max_slo)
    with pytest.raises(ValueError):
        bg.itl_statistic([0.1], "median")


def test_percentile():
    assert bg.percentile([], 50) is None
    assert bg.percentile([3, 1, 2], 50) == 2
    assert bg.percentile([0, 10], 99) == pytest.approx(9.9)


def test_timings_from_chunks():
    ttft, itls = bg.timings_from_chunks(10.0, [10.4, 10.45, 10.55])
    assert ttft == pytest.approx(0.4) and itls == pytest.approx([0.05, 0.1])
    assert bg.timings_from_chunks(1.0, []) == (None, [])


def test_summarize_counts_failures_against_attainment():
    slo = bg.SLO(ttft_s=1.0, itl_s=0.05)
    records = [rec(0.2, [0.01])] * 6 + [rec(1.5, [0.01])] * 2 + [rec(0.2, [0.09])] + [rec(None, [], ok=False)]
    row = bg.summarize(2.0, records, slo, duration_s=5.0)
    assert (row["sent"], row["ok"], row["errors"], row["attained"]) == (10, 9, 1, 6)
    assert row["attainment"] == pytest.approx(0.6)
    assert row["goodput_rps"] == pytest.approx(6 / 5.0)
    assert row["ttft_violations"] == 2 and row["itl_violations"] == 1
    assert row["ttft_p50_s"] == pytest.approx(0.2)


def test_goodput_rate_is_the_last_rate_before_attainment_drops():
    rows = [{"rate": r, "attainment": a} for r, a in [(1, 1.0), (2, 0.95), (4, 0.9), (8, 0.5), (16, 0.92)]]
    assert bg.goodput_rate(rows, 0.9) == 4  # 16 does not count after the miss at 8
    assert bg.goodput_rate(rows, 0.99) == 1
    assert bg.goodput_rate([{"rate": 1, "attainment": 0.2}], 0.9) is None


def test_poisson_arrivals_are_seeded_with_the_right_mean():
    a = bg.poisson_arrivals(4.0, 4000, seed=7)
    assert a == bg.poisson_arrivals(4.0, 4000, seed=7) and a[0] == 0.0
    gaps = [y - x for x, y in zip(a, a[1:])]
    assert sum(gaps) / len(gaps) == pytest.approx(0.25, rel=0.05)
    assert all(g >= 0 for g in gaps)


# ---- against a fake OpenAI-compatible streaming server ------------------------------------------
class FakeStream(BaseHTTPRequestHandler):
    """Streams `max_tokens` SSE chunks 5 ms apart; every third request waits 1.5 s before its
    first token (a TTFT violation at --ttft-slo 1.0; the margins hold on a loaded machine); requests whose prompt says 'fail' get 500."""

    protocol_version = "HTTP/1.0"  # close after the body: the stream ends when the socket does
    counter = 0
    lock = threading.Lock()
    bodies = []

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with FakeStream.lock:
            FakeStream.counter += 1
            n = FakeStream.counter
            FakeStream.bodies.append(body)
        if self.path != "/v1/completions" or not body.get("stream"):
            self.send_response(400)
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        time.sleep(1.5 if n % 3 == 0 else 0.02)
        for i in range(body["max_tokens"]):
            chunk = {"choices": [{"index": 0, "text": f" t{i}"}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
            time.sleep(0.005)
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *args):
        pass


@pytest.fixture()
def fake_server():
    FakeStream.counter = 0
    FakeStream.bodies = []
    srv = ThreadingHTTPServer(("127.0.0.1", 0), FakeStream)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_run_against_fake_streaming_server(fake_server, tmp_path):
    out = tmp_path / "out"
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--base-url", fake_server, "--rates", "5,20",
         "--num-requests", "6", "--max-duration", "10", "--request-timeout", "20",
         "--input-words", "20", "--output-tokens", "8", "--ttft-slo", "1.0", "--itl-slo", "0.5",
         "--out-dir", str(out)],
        capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "goodput rate" in r.stdout and "attain%" in r.stdout
    result = json.loads((out / "goodput.json").read_text())
    assert [row["rate"] for row in result["rows"]] == [5.0, 20.0]
    for row in result["rows"]:
        assert row["sent"] == 6 and row["ok"] == 6 and row["errors"] == 0
        # Exactly two of six requests waited 1.5 s for their first token.
        assert row["attained"] == 4 and row["ttft_violations"] == 2
        assert row["attainment"] == pytest.approx(4 / 6)
        for rr in row["records"]:
            assert rr["output_chunks"] == 8 and len(rr["itls"]) == 7
    assert result["goodput_rate"] is None  # 67% < the 90% target at every rate
    assert (out / "attainment.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "goodput.csv").read_text().splitlines()[0].startswith("rate,sent,ok")
    # What the server saw: streamed completions with the SGLang fixed-length extension.
    assert all(b["stream"] and b["ignore_eos"] and b["max_tokens"] == 8 for b in FakeStream.bodies)
    assert len({b["prompt"] for b in FakeStream.bodies}) == 12  # distinct prompts, no cache flattery


def test_unreachable_server_is_a_failed_run_not_a_crash(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--base-url", f"http://127.0.0.1:{port}", "--rates", "50",
         "--num-requests", "3", "--out-dir", str(tmp_path / "o")],
        capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert "0/3 attained, 3 errors" in r.stdout
