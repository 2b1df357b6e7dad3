"""scripts/launch_pd.sh --dry-run: the commands it would run for 1P1D, 2P2D, multi-node roles and the
CPU demo (flags, ports, HIP_VISIBLE_DEVICES, --disaggregation-transfer-backend mori)."""

import os
import shlex
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from harness import lifetime

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "launch_pd.sh"


def dry(*args, expect_rc=0):
    r = subprocess.run(["bash", str(SCRIPT), *args, "--dry-run"], capture_output=True, text=True,
                       timeout=60, cwd=REPO)
    assert r.returncode == expect_rc, r.stderr
    return r


def plan(*args):
    """name -> (url, env dict, argv list) from the dry-run output."""
    out = dry(*args).stdout.splitlines()
    result = {}
    for header, cmd in zip(out[::1], out[1:]):
        if not header.startswith("# ") or header.startswith("# build"):
            continue
        _, name, url = header.split()
        words = shlex.split(cmd)
        env = {}
        while "=" in words[0] and not words[0].startswith("-"):
            k, v = words.pop(0).split("=", 1)
            env[k] = v
        result[name] = (url, env, words)
    return result


def flag(argv, name):
    return argv[argv.index(name) + 1]


def test_one_node_1p1d():
    p = plan("--model-path", "/models/m", "--prefill-gpus", "0,1,2,3", "--decode-gpus", "4,5,6,7")
    assert set(p) == {"prefill0", "decode0", "router"}
    url, env, argv = p["prefill0"]
    assert env["HIP_VISIBLE_DEVICES"] == "0,1,2,3" and env["SGLANG_MORI_XGMI"] == "1"
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    assert flag(argv, "--disaggregation-transfer-backend") == "mori"
    assert flag(argv, "--disaggregation-mode") == "prefill"
    assert flag(argv, "--tp-size") == "4"
    assert flag(argv, "--port") == "30000" and url == "http://127.0.0.1:30000"
    assert flag(argv, "--disaggregation-bootstrap-port") == "8998"
    _, denv, dargv = p["decode0"]
    assert denv["HIP_VISIBLE_DEVICES"] == "4,5,6,7"
    assert flag(dargv, "--disaggregation-mode") == "decode" and flag(dargv, "--port") == "31000"
    assert "--disaggregation-bootstrap-port" not in dargv
    _, renv, rargv = p["router"]
    assert rargv[1:3] == ["-m", "sglang_router.launch_router"] and "--pd-disaggregation" in rargv
    i = rargv.index("--prefill")
    assert rargv[i + 1:i + 3] == ["http://127.0.0.1:30000", "8998"]
    assert flag(rargv, "--decode") == "http://127.0.0.1:31000"
    assert flag(rargv, "--prometheus-host") == "127.0.0.1" and flag(rargv, "--port") == "8000"


def test_one_node_2p2d_with_ranges_and_ib_device():
    p = plan("--model-path", "/m", "--prefill-gpus", "0-1:2,3", "--decode-gpus", "4,5:6-7",
             "--ib-device", "mlx5_0,mlx5_1", "--port", "40000", "--bootstrap-port", "9100",
             "--router-port", "9000", "--no-xgmi")
    assert set(p) == {"prefill0", "prefill1", "decode0", "decode1", "router"}
    gpus = {n: p[n][1]["HIP_VISIBLE_DEVICES"] for n in p if n != "router"}
    assert gpus == {"prefill0": "0,1", "prefill1": "2,3", "decode0": "4,5", "decode1": "6,7"}
    ports = {n: flag(p[n][2], "--port") for n in p}
    assert ports == {"prefill0": "40000", "prefill1": "40010", "decode0": "41000",
                     "decode1": "41010", "router": "9000"}
    assert [flag(p[n][2], "--disaggregation-bootstrap-port") for n in ("prefill0", "prefill1")] == ["9100", "9101"]
    for n in ("prefill0", "prefill1", "decode0", "decode1"):
        assert flag(p[n][2], "--tp-size") == "2"
        assert flag(p[n][2], "--disaggregation-ib-device") == "mlx5_0,mlx5_1"
        assert "SGLANG_MORI_XGMI" not in p[n][1]
    rargv = p["router"][2]
    prefills = [rargv[i + 1:i + 3] for i, w in enumerate(rargv) if w == "--prefill"]
    assert prefills == [["http://127.0.0.1:40000", "9100"], ["http://127.0.0.1:40010", "9101"]]
    assert [rargv[i + 1] for i, w in enumerate(rargv) if w == "--decode"] == \
        ["http://127.0.0.1:41000", "http://127.0.0.1:41010"]


def test_multi_node_roles():
    pre = plan("--role", "prefill", "--model-path", "/m", "--host", "10.0.0.1", "--gpus", "0-7",
               "--ib-device", "ionic_0")
    assert set(pre) == {"prefill0"}  # no router on a server node
    url, env, argv = pre["prefill0"]
    assert env["HIP_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7" and env["SGLANG_HOST_IP"] == "10.0.0.1"
    assert "SGLANG_MORI_XGMI" not in env  # across nodes: RDMA
    assert flag(argv, "--host") == "10.0.0.1" and flag(argv, "--tp-size") == "8"
    assert url == "http://10.0.0.1:30000"
    dec = plan("--role", "decode", "--model-path", "/m", "--host", "10.0.0.2", "--gpus", "0-7",
               "--tp", "4", "--decode-args", "--mem-fraction-static 0.8")
    _, denv, dargv = dec["decode0"]
    assert flag(dargv, "--disaggregation-mode") == "decode" and flag(dargv, "--tp-size") == "4"
    assert flag(dargv, "--mem-fraction-static") == "0.8"
    rt = plan("--role", "router", "--host", "10.0.0.3", "--prefill-addr", "10.0.0.1:30000@8998",
              "--prefill-addr", "10.0.0.4:30000", "--decode-addr", "10.0.0.2:30000")
    assert set(rt) == {"router"}
    rargv = rt["router"][2]
    prefills = [rargv[i + 1:i + 3] for i, w in enumerate(rargv) if w == "--prefill"]
    assert prefills == [["http://10.0.0.1:30000", "8998"], ["http://10.0.0.4:30000", "8998"]]
    assert flag(rargv, "--decode") == "http://10.0.0.2:30000" and flag(rargv, "--host") == "10.0.0.3"


def test_per_gpu_nic_mapping_and_paths_survive_quoting():
    mapping = '{"0": "mlx5_0", "1": "mlx5_1"}'
    p = plan("--role", "prefill", "--model-path", "/models/my model", "--host", "10.0.0.1",
             "--gpus", "0,1", "--ib-device", mapping)
    argv = p["prefill0"][2]
    assert flag(argv, "--disaggregation-ib-device") == mapping
    assert flag(argv, "--model-path") == "/models/my model"


def test_cpu_demo_recipe():
    p = plan("--cpu-demo")
    _, env, argv = p["prefill0"]
    assert env["SGLANG_MORI_ENGINE"] == "soft" and env["SGLANG_HOST_IP"] == "127.0.0.1"
    assert env["PYTHONPATH"].split(":")[0].endswith("cpu_stubs")
    assert Path(env["PYTHONPATH"].split(":")[0], "vllm").is_dir()
    assert "HIP_VISIBLE_DEVICES" not in env and "--tp-size" not in argv
    for f in ("--device", "--attention-backend", "--max-total-tokens"):
        assert f in argv
    assert flag(argv, "--attention-backend") == "torch_native"
    assert "--disable-overlap-schedule" in argv
    _, _, dargv = p["decode0"]
    assert flag(dargv, "--disaggregation-decode-retraction-backup") == "cpu_tensor"
    assert "--disable-overlap-schedule" not in dargv
    assert "# build tiny model:" in dry("--cpu-demo").stdout


def test_errors_are_explicit():
    r = dry("--prefill-gpus", "0", "--decode-gpus", "1", expect_rc=2)
    assert "--model-path is required" in r.stderr
    r = dry("--model-path", "/m", "--prefill-gpus", "0,x", "--decode-gpus", "1", expect_rc=2)
    assert "bad GPU list" in r.stderr
    r = dry("--role", "router", "--prefill-addr", "h:1", expect_rc=2)
    assert "--decode-addr" in r.stderr
    r = dry("--model-path", "/m", "--bogus", expect_rc=2)
    assert "unknown option --bogus" in r.stderr


def test_stop_without_pid_file(tmp_path):
    r = subprocess.run(["bash", str(SCRIPT), "--stop", "--log-dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "nothing recorded" in r.stderr


# ---- the real thing on this machine --------------------------------------------------------------
def _free_base():
    """Ports p, p+1000 (servers), b (bootstrap), r, r+1 (router, its metrics), all free on loopback."""
    import random
    import socket

    rng = random.Random()
    for _ in range(50):
        p, b, r = rng.randrange(20000, 28000, 10), rng.randrange(29000, 29900), rng.randrange(30000, 30900, 2)
        try:
            for port in (p, p + 1000, b, r, r + 1):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return p, b, r
    raise RuntimeError("no free ports")


def _recorded_groups(pid_file: Path, seen: set) -> set:
    try:
        lines = pid_file.read_text().splitlines()
    except FileNotFoundError:
        return set(seen)
    return set(seen) | {int(line.split()[0]) for line in lines if line.strip()}


def _run_adopting_servers(argv, pid_file: Path, timeout_s: float):
    """Run the launcher; tie each server it detaches (its own group, listed in pid_file as soon as
    it starts) to this test process (harness.lifetime), so that a killed test run ends them too.
    Returns the launcher's CompletedProcess and the groups adopted."""
    launcher = lifetime.spawn(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    pids: set = set()
    out: list = []
    # A reader thread keeps the pipes drained while we watch the pid file.
    reader = threading.Thread(target=lambda: out.extend(launcher.communicate()), daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout_s
    while reader.is_alive() and time.monotonic() < deadline:
        for pgid in _recorded_groups(pid_file, pids) - pids:
            lifetime.adopt(pgid)
            pids.add(pgid)
        reader.join(0.2)
    if reader.is_alive():
        os.killpg(launcher.pid, signal.SIGKILL)
        reader.join(30)
    lifetime.release(launcher.pid)
    for pgid in _recorded_groups(pid_file, pids) - pids:
        lifetime.adopt(pgid)
        pids.add(pgid)
    return subprocess.CompletedProcess(argv, launcher.returncode, *(out or ("", ""))), pids


@pytest.mark.e2e
def test_cpu_demo_serves_through_the_mori_backend(tmp_path):
    import json
    import sys
    import urllib.request

    port, boot, router = _free_base()
    logs = tmp_path / "logs"
    base = ["bash", str(SCRIPT), "--log-dir", str(logs)]
    start, servers = _run_adopting_servers(base + ["--cpu-demo", "--detach", "--port", str(port), "--bootstrap-port",
                                          str(boot), "--router-port", str(router), "--health-timeout", "400"],
                                  logs / "pids", timeout_s=600)
    try:
        assert start.returncode == 0, start.stdout + start.stderr
        assert f"router  http://127.0.0.1:{router}" in start.stdout
        req = urllib.request.Request(
            f"http://127.0.0.1:{router}/v1/completions", method="POST",
            headers={"Content-Type": "application/json"},
            data=json.dumps({"model": "default", "prompt": "the quick river", "max_tokens": 6,
                             "temperature": 0}).encode())
        with urllib.request.urlopen(req, timeout=120) as resp:
            out = json.loads(resp.read())
        assert out["usage"]["completion_tokens"] == 6
        # The KV went through our backend on the software engine, not SGLang's built-in mori.
        prefill_log = (logs / "prefill0.log").read_text()
        assert "sglang-mori prefill tp0: engine=soft" in prefill_log
        doctor = subprocess.run([sys.executable, "-m", "sglang_mori.cli.main", "doctor", "--bootstrap",
                                 f"127.0.0.1:{boot}"], capture_output=True, text=True, timeout=120,
                                env={**__import__("os").environ, "SGLANG_MORI_ENGINE": "soft"})
        assert any(line.startswith("ok") and "bootstrap" in line for line in doctor.stdout.splitlines())
        bench = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_goodput.py"),
                                "--base-url", f"http://127.0.0.1:{router}", "--rates", "2",
                                "--num-requests", "4", "--input-words", "20", "--output-tokens", "8",
                                "--ttft-slo", "5", "--itl-slo", "1", "--out-dir", str(tmp_path / "gp")],
                               capture_output=True, text=True, timeout=300)
        assert bench.returncode == 0, bench.stdout + bench.stderr
        row = json.loads((tmp_path / "gp" / "goodput.json").read_text())["rows"][0]
        assert row["ok"] == 4 and row["errors"] == 0
    finally:
        stop = subprocess.run(base + ["--stop"], capture_output=True, text=True, timeout=120)
        for pgid in servers:  # any that --stop missed stay tied to this process
            if not lifetime.group_members([pgid]):
                lifetime.release(pgid)
        assert stop.returncode == 0, stop.stderr
