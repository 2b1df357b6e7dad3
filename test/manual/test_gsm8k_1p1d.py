"""GSM8K accuracy through 1P1D on one node equals a standalone server's, within a tolerance.

Model: SGLANG_MORI_MANUAL_MODEL (a local path). Data: SGLANG_MORI_MANUAL_GSM8K (the GSM8K test
jsonl, local: nothing is downloaded on the node). Standalone runs on GPUs [0, TP); PD puts prefill on
[0, TP) and decode on [TP, 2 TP) through scripts/launch_pd.sh, once over XGMI and once over RDMA.
"""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
from manual_support import REPO, gpu_count, require_node

import gsm8k_eval

pytestmark = pytest.mark.manual
NEEDS = ("SGLANG_MORI_MANUAL_MODEL", "SGLANG_MORI_MANUAL_GSM8K")
NUM_QUESTIONS = 200
TOLERANCE = 0.03  # absolute accuracy; greedy decoding differs only by batch-shape rounding
START_TIMEOUT_S = 1800


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tp() -> int:
    return max(1, min(4, gpu_count() // 2))


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"server exited ({proc.returncode}); log {log}:\n{log.read_text()[-3000:]}")
        try:
            if requests.get(url + "/health", timeout=5).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(5)
    pytest.fail(f"server not healthy after {START_TIMEOUT_S}s; log {log}")


@pytest.fixture(scope="module")
def standalone_accuracy(tmp_path_factory):
    require_node(gpus=2, env=NEEDS)
    tp = _tp()
    port = _free_port()
    log = tmp_path_factory.mktemp("standalone") / "server.log"
    env = dict(os.environ, HIP_VISIBLE_DEVICES=",".join(str(i) for i in range(tp)))
    with open(log, "w") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "sglang.launch_server", "--model-path",
                                 os.environ["SGLANG_MORI_MANUAL_MODEL"], "--tp-size", str(tp),
                                 "--host", "127.0.0.1", "--port", str(port)],
                                env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_healthy(f"http://127.0.0.1:{port}", proc, log)
        rows = gsm8k_eval.load(os.environ["SGLANG_MORI_MANUAL_GSM8K"])
        result = gsm8k_eval.evaluate(f"http://127.0.0.1:{port}", rows, n=NUM_QUESTIONS)
        print(f"standalone TP{tp}: {result}")
        return result
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)


@pytest.mark.parametrize("transport", ["xgmi", "rdma"])
def test_pd_accuracy_matches_standalone(transport, standalone_accuracy, tmp_path):
    require_node(gpus=2, rdma=(transport == "rdma"), env=NEEDS)
    tp = _tp()
    logs = tmp_path / "pd"
    port, boot, router = _free_port(), _free_port(), _free_port()
    launch = [str(REPO / "scripts" / "launch_pd.sh"), "--log-dir", str(logs),
              "--python", sys.executable, "--model-path", os.environ["SGLANG_MORI_MANUAL_MODEL"],
              "--prefill-gpus", ",".join(str(i) for i in range(tp)),
              "--decode-gpus", ",".join(str(i) for i in range(tp, 2 * tp)),
              "--port", str(port), "--bootstrap-port", str(boot), "--router-port", str(router),
              "--health-timeout", str(START_TIMEOUT_S), "--detach",
              "--xgmi" if transport == "xgmi" else "--no-xgmi"]
    start = subprocess.run(launch, capture_output=True, text=True, timeout=START_TIMEOUT_S + 300)
    try:
        assert start.returncode == 0, start.stdout[-3000:] + start.stderr[-3000:]
        prefill_log = (logs / "prefill0.log").read_text()
        assert "sglang-mori prefill tp0: engine=mori" in prefill_log, "our backend did not start"
        rows = gsm8k_eval.load(os.environ["SGLANG_MORI_MANUAL_GSM8K"])
        pd = gsm8k_eval.evaluate(f"http://127.0.0.1:{router}", rows, n=NUM_QUESTIONS)
        print(f"1P1D TP{tp} over {transport}: {pd}; standalone: {standalone_accuracy}")
        assert pd["errors"] == 0, pd
        assert pd["accuracy"] >= standalone_accuracy["accuracy"] - TOLERANCE, (pd, standalone_accuracy)
        assert pd["invalid"] <= standalone_accuracy["invalid"] + TOLERANCE, (pd, standalone_accuracy)
    finally:
        subprocess.run([str(REPO / "scripts" / "launch_pd.sh"), "--stop", "--log-dir", str(logs)],
                       capture_output=True, text=True, timeout=120)
