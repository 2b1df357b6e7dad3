"""Does an SGLang prefill bootstrap server answer?

CommonKVBootstrapServer (sglang/srt/disaggregation/common/conn.py) serves GET /health -> 200 "OK";
decode's heartbeat uses that route, so a failure here is what decode would see. Its
GET /route?...=-1 then returns the prefill topology once every prefill rank has registered (503
before). SGLang's HTTP server also answers /health with 200 but an empty body, which tells a
mistaken HTTP port apart from the bootstrap port.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from .result import CheckResult, Status

DEFAULT_BOOTSTRAP_PORT = 8998  # SGLang's --disaggregation-bootstrap-port default
TOPOLOGY_QUERY = "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"


def parse_address(address: str):
    """'host:port', '[v6]:port', 'http://host:port' or 'host' (default port)."""
    address = address.strip()
    if address.startswith("http://"):
        address = address[len("http://"):]
    address = address.rstrip("/")
    if address.startswith("["):
        host, _, rest = address[1:].partition("]")
        return host, int(rest.lstrip(":") or DEFAULT_BOOTSTRAP_PORT)
    host, sep, port = address.rpartition(":")
    if not sep:
        return address, DEFAULT_BOOTSTRAP_PORT
    return host, int(port)


def _get(url: str, timeout_s: float):
    """(status, body); HTTP error statuses are answers too, network errors raise."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status, resp.read(4096).decode(errors="replace").strip()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(4096).decode(errors="replace").strip()


def check_bootstrap(address: str, timeout_s: float = 3.0) -> CheckResult:
    name = "bootstrap"
    try:
        host, port = parse_address(address)
    except ValueError:
        return CheckResult(name, Status.FAIL, f"{address!r} is not HOST:PORT", "--bootstrap 10.0.0.1:8998")
    base = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    fix = ("start the prefill server (--disaggregation-mode prefill, --disaggregation-bootstrap-port "
           f"{port}) and open TCP {port} from the decode nodes")
    try:
        status, body = _get(base + "/health", timeout_s)
    except (urllib.error.URLError, OSError) as exc:
        return CheckResult(name, Status.FAIL, f"GET {base}/health failed: {getattr(exc, 'reason', exc)}", fix)
    if status != 200:
        return CheckResult(name, Status.FAIL, f"GET {base}/health -> {status}", fix)
    if body != "OK":
        return CheckResult(name, Status.FAIL,
                           f"{base} answers /health but not as a bootstrap server (body {body[:40]!r})",
                           "use the prefill's --disaggregation-bootstrap-port (default 8998), not its HTTP port")
    try:
        status, body = _get(base + TOPOLOGY_QUERY, timeout_s)
    except (urllib.error.URLError, OSError) as exc:
        return CheckResult(name, Status.WARN, f"/health OK but /route failed: {exc}", fix)
    if status == 503:
        return CheckResult(name, Status.WARN, f"{base} up, prefill ranks not all registered: {body}",
                           "wait for the prefill server to finish loading; check its log")
    if status != 200:
        return CheckResult(name, Status.WARN, f"{base} /health OK, topology query -> {status}")
    try:
        info = json.loads(body)
        topo = ", ".join(f"{k}={info[k]}" for k in ("attn_tp_size", "pp_size", "dp_size", "page_size")
                         if k in info)
    except (ValueError, TypeError):
        topo = "topology unreadable"
    return CheckResult(name, Status.OK, f"{base} up; prefill {topo}")
