"""`sglang-mori doctor`: this host's honest answers, and fake sysfs / lib / env trees for the rest."""

import json
import os
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from sglang_mori.cli.main import main as cli_main
from sglang_mori.doctor import bootstrap, rdma, settings, software
from sglang_mori.doctor.host import HostView
from sglang_mori.doctor.result import Status, exit_code
from sglang_mori.doctor.runner import run_checks


# ---- fake host trees ---------------------------------------------------------------------------
class FakeHost:
    """Builds a sysfs/proc/boot/lib tree under tmp_path; `view(env)` gives the HostView on it."""

    def __init__(self, root: Path):
        self.root = root
        self.sys = root / "sys"
        self.proc = root / "proc"
        self.boot = root / "boot"
        self.lib = root / "lib"
        for d in (self.sys, self.proc, self.boot, self.lib):
            d.mkdir(parents=True, exist_ok=True)

    def write(self, path: Path, text: str):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")

    def module(self, *names):
        for n in names:
            (self.sys / "module" / n).mkdir(parents=True, exist_ok=True)

    def rdma_port(self, dev, port="1", state="4: ACTIVE", link="Ethernet", driver="mlx5_core",
                  roce_v2=True):
        p = self.sys / "class" / "infiniband" / dev / "ports" / port
        self.write(p / "state", state)
        self.write(p / "link_layer", link)
        self.write(p / "rate", "400 Gb/sec (4X NDR)")
        drv = self.sys / "bus" / "pci" / "drivers" / driver
        drv.mkdir(parents=True, exist_ok=True)
        dev_dir = self.sys / "class" / "infiniband" / dev / "device"
        dev_dir.mkdir(parents=True, exist_ok=True)
        if not (dev_dir / "driver").exists():
            (dev_dir / "driver").symlink_to(drv)
        if link == "Ethernet":
            self.write(p / "gid_attrs" / "types" / "0", "IB/RoCE v1")
            self.write(p / "gids" / "0", "fe80:0000:0000:0000:0000:0000:0000:0001")
            self.write(p / "gid_attrs" / "types" / "1", "RoCE v2" if roce_v2 else "IB/RoCE v1")
            self.write(p / "gids" / "1", "0000:0000:0000:0000:0000:ffff:0a00:0005")

    def gpus(self, n):
        for i in range(n):
            self.write(self.sys / "class" / "drm" / f"card{i}" / "device" / "vendor", "0x1002")
        self.write(self.sys / "class" / "drm" / "card0-DP-1" / "status", "disconnected")
        self.module("amdgpu")

    def lib_file(self, name, sub=""):
        self.write(self.lib / sub / name, "")

    def hugepages(self, total, free=None):
        d = self.sys / "kernel" / "mm" / "hugepages" / "hugepages-2048kB"
        self.write(d / "nr_hugepages", str(total))
        self.write(d / "free_hugepages", str(total if free is None else free))

    def kernel_config(self, *options):
        self.write(self.proc / "sys" / "kernel" / "osrelease", "6.8.0-test")
        self.write(self.boot / "config-6.8.0-test", "\n".join(f"{o}=y" for o in options))

    def view(self, env=None):
        return HostView(sys_root=self.sys, proc_root=self.proc, boot_root=self.boot,
                        lib_dirs=[self.lib], env=dict(env or {}), timeout_s=2.0)


@pytest.fixture()
def fake(tmp_path):
    return FakeHost(tmp_path / "host")


def by_name(results):
    return {r.name: r for r in results}


# ---- this machine ------------------------------------------------------------------------------
def test_this_host_reports_what_it_has(monkeypatch):
    """Honest on any host: absent exactly where the host lacks the thing."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MORI_", "SGLANG_MORI_"))}
    env["SGLANG_MORI_ENGINE"] = "soft"
    results = by_name(run_checks(HostView(env=env)))
    has_ib = Path("/sys/class/infiniband").is_dir() and any(Path("/sys/class/infiniband").iterdir())
    assert (results["rdma devices"].status is Status.ABSENT) == (not has_ib)
    if not has_ib:
        assert results["gpu mem registration"].status is Status.ABSENT
        assert results["hugepages"].status is Status.ABSENT
    try:
        import mori  # noqa: F401

        has_mori = True
    except ImportError:
        has_mori = False
    assert (results["mori"].status is Status.ABSENT) == (not has_mori)
    assert results["sglang"].status is Status.OK  # the venv pins 0.5.23
    for fam in ("mlx5", "ionic", "bnxt"):
        loaded = Path(f"/sys/module/{rdma.NIC_FAMILIES[fam][0]}").is_dir()
        assert (results[f"nic {fam}"].status is Status.ABSENT) == (not loaded)
    if not has_ib and not has_mori and not software.count_amd_gpus(HostView(env=env)):
        absent = [r for r in results.values() if r.status is Status.ABSENT]
        assert len(absent) >= 8  # "most checks" on a CPU-only machine
        assert results["libamdhip64"].status in (Status.ABSENT, Status.OK)


def test_default_engine_without_mori_fails_and_says_how_to_fix():
    probe = software.MoriProbe(found=False, importable=False)
    r = software.check_engine(HostView(env={}), probe, amd_gpus=0)
    assert r.status is Status.FAIL
    assert "SGLANG_MORI_ENGINE=soft" in r.fix
    soft = software.check_engine(HostView(env={"SGLANG_MORI_ENGINE": "soft"}), probe, amd_gpus=0)
    assert soft.status is Status.OK
    on_gpus = software.check_engine(HostView(env={"SGLANG_MORI_ENGINE": "soft"}), probe, amd_gpus=8)
    assert on_gpus.status is Status.WARN
    bad = software.check_engine(HostView(env={"SGLANG_MORI_ENGINE": "rdma"}), probe, amd_gpus=0)
    assert bad.status is Status.FAIL


def test_cli_exit_codes_on_this_host(capsys):
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MORI_", "SGLANG_MORI_"))}
    code = subprocess.run([sys.executable, "-m", "sglang_mori.cli.main", "doctor", "--json"],
                          env={**clean, "SGLANG_MORI_ENGINE": "soft"}, capture_output=True,
                          text=True, timeout=120)
    rows = json.loads(code.stdout)
    assert {r["status"] for r in rows} <= {"ok", "warn", "fail", "absent"}
    assert code.returncode == (1 if any(r["status"] == "fail" for r in rows) else 0)


# ---- RDMA ports --------------------------------------------------------------------------------
def test_port_active_ok_down_fail(fake):
    fake.rdma_port("mlx5_0", state="4: ACTIVE")
    fake.rdma_port("mlx5_1", state="1: DOWN")
    res = by_name(rdma.check_ports(fake.view(), rdma.list_ports(fake.view())))
    assert res["rdma mlx5_0/1"].status is Status.OK
    assert "ACTIVE" in res["rdma mlx5_0/1"].detail and "mlx5_core" in res["rdma mlx5_0/1"].detail
    assert res["rdma mlx5_1/1"].status is Status.FAIL
    assert "DOWN" in res["rdma mlx5_1/1"].detail
    assert exit_code(res.values()) == 1


def test_down_port_excluded_by_mori_rdma_devices_only_warns(fake):
    fake.rdma_port("mlx5_0")
    fake.rdma_port("mlx5_1", state="1: DOWN")
    for sel in ("mlx5_0", "^mlx5_1"):
        host = fake.view({"MORI_RDMA_DEVICES": sel})
        res = by_name(rdma.check_ports(host, rdma.list_ports(host)))
        assert res["rdma mlx5_1/1"].status is Status.WARN, sel
        assert exit_code(res.values()) == 0


def test_mori_rdma_devices_naming_missing_device_fails(fake):
    fake.rdma_port("ionic_0", driver="ionic")
    host = fake.view({"MORI_RDMA_DEVICES": "ionic_0,ionic_7"})
    res = by_name(rdma.check_ports(host, rdma.list_ports(host)))
    assert res["MORI_RDMA_DEVICES"].status is Status.FAIL
    assert "ionic_7" in res["MORI_RDMA_DEVICES"].detail


def test_roce_port_without_v2_gid_warns(fake):
    fake.rdma_port("bnxt_re0", driver="bnxt_en", roce_v2=False)
    host = fake.view()
    (r,) = rdma.check_ports(host, rdma.list_ports(host))
    assert r.status is Status.WARN and "RoCE v2" in r.detail


# ---- NIC drivers and providers ----------------------------------------------------------------
def test_nic_driver_states(fake):
    fake.module("mlx5_core")  # Ethernet only, no mlx5_ib
    fake.module("ionic", "ionic_rdma")  # loaded, provider missing
    fake.module("bnxt_en", "bnxt_re")
    fake.lib_file("libbnxt_re-rdmav34.so", sub="libibverbs")
    res = by_name(rdma.check_nic_drivers(fake.view()))
    assert res["nic mlx5"].status is Status.FAIL and "modprobe mlx5_ib" in res["nic mlx5"].fix
    assert res["nic ionic"].status is Status.FAIL and "libionic" in res["nic ionic"].detail
    assert res["nic bnxt"].status is Status.OK and "libbnxt_re-rdmav34.so" in res["nic bnxt"].detail


def test_nic_families_absent_when_nothing_loaded(fake):
    res = rdma.check_nic_drivers(fake.view())
    assert [r.status for r in res] == [Status.ABSENT] * 3


# ---- registration and hugepages ----------------------------------------------------------------
def test_registration_paths(fake):
    fake.rdma_port("mlx5_0")
    ports = rdma.list_ports(fake.view())
    fake.kernel_config("CONFIG_PCI_P2PDMA")  # no DMABUF_MOVE_NOTIFY
    r = rdma.check_registration(fake.view(), ports, amd_gpus=8)
    assert r.status is Status.FAIL and "amdgpu_peermem" in r.fix
    fake.kernel_config("CONFIG_PCI_P2PDMA", "CONFIG_DMABUF_MOVE_NOTIFY")
    assert rdma.check_registration(fake.view(), ports, 8).status is Status.OK
    off = rdma.check_registration(fake.view({"MORI_ENABLE_DMABUF_REG": "0"}), ports, 8)
    assert off.status is Status.FAIL and "MORI_ENABLE_DMABUF_REG" in off.detail
    fake.module("amdgpu_peermem", "nvidia_peermem")
    r = rdma.check_registration(fake.view({"MORI_ENABLE_DMABUF_REG": "0"}), ports, 8)
    assert r.status is Status.OK and "nvidia_peermem" in r.detail


def test_registration_unknown_kernel_config_warns(fake):
    fake.rdma_port("mlx5_0")
    r = rdma.check_registration(fake.view(), rdma.list_ports(fake.view()), amd_gpus=8)
    assert r.status is Status.WARN and "cannot tell" in r.detail


def test_hugepages(fake):
    fake.rdma_port("ionic_0", driver="ionic")
    fake.module("ionic", "ionic_rdma")
    ports = rdma.list_ports(fake.view())
    fake.hugepages(0)
    assert rdma.check_hugepages(fake.view(), ports).status is Status.FAIL  # Pollara aborts
    fake.hugepages(1024, 1000)
    r = rdma.check_hugepages(fake.view(), ports)
    assert r.status is Status.OK and "1024 x 2048kB (1000 free)" in r.detail
    assert rdma.check_hugepages(fake.view(), []).status is Status.ABSENT


# ---- GPUs and ROCm libraries ------------------------------------------------------------------
def test_gpus_and_rocm_libraries(fake):
    fake.gpus(8)
    fake.lib_file("libamdhip64.so.7")
    host = fake.view()
    assert software.count_amd_gpus(host) == 8
    assert software.check_amd_gpus(host, 8).status is Status.OK
    assert software.check_rocm_library(host, "libamdhip64").status is Status.OK
    assert software.check_rocm_library(host, "libhsa-runtime64").status is Status.ABSENT


# ---- XGMI and env settings ---------------------------------------------------------------------
def test_xgmi_inverted_semantics():
    one = settings.check_xgmi(HostView(env={"MORI_DISABLE_AUTO_XGMI": "1"}), 2, 8)
    zero = settings.check_xgmi(HostView(env={"MORI_DISABLE_AUTO_XGMI": "0"}), 2, 8)
    false = settings.check_xgmi(HostView(env={"MORI_DISABLE_AUTO_XGMI": "false"}), 2, 8)
    unset = settings.check_xgmi(HostView(env={}), 2, 8)
    assert zero.status is Status.OK and "auto-XGMI ON" in zero.detail
    assert one.status is Status.OK and "auto-XGMI OFF" in one.detail
    assert unset.status is Status.OK and "auto-XGMI OFF" in unset.detail
    assert false.status is Status.WARN and "does NOT enable XGMI" in false.detail
    # One node without RDMA and without XGMI: MORI-IO has no backend at all.
    stuck = settings.check_xgmi(HostView(env={"MORI_DISABLE_AUTO_XGMI": "1"}), 0, 8)
    assert stuck.status is Status.FAIL and "no active RDMA device" in stuck.detail
    xgmi_only = settings.check_xgmi(HostView(env={"MORI_DISABLE_AUTO_XGMI": "0"}), 0, 8)
    assert xgmi_only.status is Status.OK and "XGMI only" in xgmi_only.detail
    ours = settings.check_xgmi(HostView(env={"SGLANG_MORI_XGMI": "1", "MORI_DISABLE_AUTO_XGMI": "1"}), 0, 8)
    assert ours.status is Status.OK and "replacing" in ours.detail


def test_mori_io_overrides():
    assert settings.check_mori_io_overrides(HostView(env={})).status is Status.OK
    r = settings.check_mori_io_overrides(HostView(env={
        "MORI_IO_QP_PER_TRANSFER": "8", "SGLANG_MORI_QP_PER_TRANSFER": "4",
        "MORI_IO_ENABLE_NOTIFICATION": "1", "MORI_IO_QP_PER_TRANSFR": "2"}))
    assert r.status is Status.WARN
    assert "beats SGLANG_MORI_QP_PER_TRANSFER=4" in r.detail
    assert "poisons" in r.detail
    assert "MORI_IO_QP_PER_TRANSFR=2 (unknown" in r.detail


def test_host_address():
    res = settings.check_host_address(HostView(env={"SGLANG_HOST_IP": "node1.example"}))
    assert res[0].status is Status.FAIL
    assert settings.check_host_address(HostView(env={"SGLANG_HOST_IP": "0.0.0.0"}))[0].status is Status.FAIL
    assert settings.check_host_address(HostView(env={"SGLANG_HOST_IP": "10.1.2.3"}))[0].status is Status.OK
    assert settings.check_host_address(HostView(env={"SGLANG_MORI_HOST": "127.0.0.1"}))[0].status is Status.WARN
    # An invalid SGLANG_MORI_HOST is left to the config check, which names the rule.
    assert settings.check_host_address(HostView(env={"SGLANG_MORI_HOST": "::1"})) == []
    cfg = settings.check_config(HostView(env={"SGLANG_MORI_HOST": "::1"}))
    assert cfg[0].status is Status.FAIL and "SGLANG_MORI_HOST" in cfg[0].detail


def test_config_check():
    ok = by_name(settings.check_config(HostView(env={"SGLANG_MORI_TRANSFER_SHARDS": "16"})))
    assert ok["SGLANG_MORI_* config"].status is Status.OK
    assert "SGLANG_MORI_TRANSFER_SHARDS=16" in ok["SGLANG_MORI_* config"].detail
    bad = by_name(settings.check_config(HostView(env={"SGLANG_MORI_TRANSFER_SHARDS": "lots"})))
    assert bad["SGLANG_MORI_* config"].status is Status.FAIL
    stray = by_name(settings.check_config(HostView(env={"SGLANG_MORI_QP_PER_TRANSFR": "2",
                                                        "SGLANG_MORI_MANUAL_E2E": "1"})))
    assert stray["SGLANG_MORI_* names"].status is Status.WARN
    assert "SGLANG_MORI_QP_PER_TRANSFR" in stray["SGLANG_MORI_* names"].detail
    assert "MANUAL_E2E" not in stray["SGLANG_MORI_* names"].detail


# ---- mori probe in a child interpreter --------------------------------------------------------
def _fake_mori(root: Path, version: str, io_body: str):
    pkg = root / "mori"
    (pkg / "io").mkdir(parents=True)
    (pkg / "__init__.py").write_text(f"__version__ = {version!r}\n")
    (pkg / "io" / "__init__.py").write_text(io_body)
    return {**os.environ, "PYTHONPATH": str(root)}


def test_mori_probe_ok_old_and_broken(tmp_path):
    good = _fake_mori(tmp_path / "a", "1.2.4",
                      "class IOEngine:\n    def pop_peer_failure(self): return None\n")
    r = software.check_mori(software.probe_mori(HostView(env=good)))
    assert r.status is Status.OK and "1.2.4" in r.detail
    old = _fake_mori(tmp_path / "b", "1.1.0", "class IOEngine: pass\n")
    assert software.check_mori(software.probe_mori(HostView(env=old))).status is Status.WARN
    broken = _fake_mori(tmp_path / "c", "1.2.4",
                        "raise OSError('libamdhip64.so.7: cannot open shared object file')\n")
    probe = software.probe_mori(HostView(env=broken))
    r = software.check_mori(probe)
    assert r.status is Status.FAIL and "libamdhip64.so.7" in r.detail
    assert software.check_engine(HostView(env=broken), probe, 0).status is Status.FAIL


# ---- bootstrap ---------------------------------------------------------------------------------
class _Bootstrap(BaseHTTPRequestHandler):
    """Answers like CommonKVBootstrapServer (or, with body "", like SGLang's HTTP server)."""

    health_body = "OK"
    route_status = 200

    def do_GET(self):  # noqa: N802
        if self.path == "/health":
            self._reply(200, self.health_body)
        elif self.path.startswith("/route"):
            body = json.dumps({"attn_tp_size": 8, "pp_size": 1, "dp_size": 1, "page_size": 64}) \
                if self.route_status == 200 else "Prefill server not fully registered yet (3 workers registered)."
            self._reply(self.route_status, body)
        else:
            self._reply(404, "not found")

    def _reply(self, code, body):
        data = body.encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture()
def serve():
    servers = []

    def start(**attrs):
        handler = type("H", (_Bootstrap,), attrs)
        srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return f"127.0.0.1:{srv.server_address[1]}"

    yield start
    for srv in servers:
        srv.shutdown()
        srv.server_close()


def test_bootstrap_ok(serve):
    r = bootstrap.check_bootstrap(serve(), timeout_s=2)
    assert r.status is Status.OK and "attn_tp_size=8" in r.detail


def test_bootstrap_not_ready_warns(serve):
    r = bootstrap.check_bootstrap(serve(route_status=503), timeout_s=2)
    assert r.status is Status.WARN and "not all registered" in r.detail


def test_bootstrap_http_port_by_mistake_fails(serve):
    r = bootstrap.check_bootstrap(serve(health_body=""), timeout_s=2)
    assert r.status is Status.FAIL and "bootstrap-port" in r.fix


def test_bootstrap_closed_port_fails():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = bootstrap.check_bootstrap(f"127.0.0.1:{port}", timeout_s=2)
    assert r.status is Status.FAIL and "refused" in r.detail.lower()


def test_parse_address():
    assert bootstrap.parse_address("10.0.0.1:9000") == ("10.0.0.1", 9000)
    assert bootstrap.parse_address("http://h:1/") == ("h", 1)
    assert bootstrap.parse_address("[::1]:8998") == ("::1", 8998)
    assert bootstrap.parse_address("prefill-0") == ("prefill-0", 8998)


# ---- whole CLI on a fake healthy node ----------------------------------------------------------
def test_cli_on_fake_healthy_node(fake, serve, capsys, monkeypatch):
    fake.gpus(8)
    for i in range(2):
        fake.rdma_port(f"mlx5_{i}")
    fake.module("mlx5_core", "mlx5_ib", "amdgpu_peermem")
    fake.lib_file("libmlx5.so.1")
    fake.lib_file("libamdhip64.so.7")
    fake.lib_file("libhsa-runtime64.so.1")
    fake.hugepages(512)
    for k in list(os.environ):
        if k.startswith(("MORI_", "SGLANG_MORI_")):
            monkeypatch.delenv(k)
    monkeypatch.setenv("SGLANG_MORI_ENGINE", "soft")  # no real mori here; engine line warns on GPUs
    code = cli_main(["doctor", "--sysfs-root", str(fake.sys), "--proc-root", str(fake.proc),
                     "--boot-root", str(fake.boot), "--lib-dir", str(fake.lib),
                     "--bootstrap", serve()])
    out = capsys.readouterr().out
    lines = {ln.split()[1] if ln.split()[0] in ("ok", "warn", "fail", "absent") else "": ln
             for ln in out.splitlines()}
    assert code == 0, out
    assert lines["rdma"].startswith("ok")
    assert "8 AMD GPUs" in out
    assert "bootstrap" in out and "summary:" in out
    fake.rdma_port("mlx5_2", state="1: DOWN")
    code = cli_main(["doctor", "--sysfs-root", str(fake.sys), "--proc-root", str(fake.proc),
                     "--boot-root", str(fake.boot), "--lib-dir", str(fake.lib)])
    out = capsys.readouterr().out
    assert code == 1
    assert any(ln.startswith("fail") and "mlx5_2/1" in ln for ln in out.splitlines())
