"""Three network hosts on one machine: private network namespaces joined by veth pairs and bridges.

    prefill 10.77.0.1 ─┬─ br-lan (10.77.0.0/24, the controller is 10.77.0.254) ─┬─ router 10.77.0.3
    decode  10.77.0.2 ─┘                                                         │  (and the client)
    prefill ── eth-pd ── br-pd ── eth-pd ── decode    (the prefill-decode link, KV and bootstrap)

Every host is one `unshare -n` process that holds its namespace; our servers enter it with
`nsenter --net=/proc/PID/ns/net` (no `ip netns`: that would leave files under the machine's
/run/netns). The prefill and decode hosts reach each other only over br-pd (a /32 route each way),
everyone else over br-lan, so the faults below cut or slow exactly the prefill-decode link:

- `cut()` sets both bridge ports of br-pd down: the hosts' eth-pd lose carrier, their routes stay
  (marked linkdown) and packets are dropped silently, as on a pulled cable; `restore()` brings it up.
- `throttle(rate)` puts a token-bucket filter (tc tbf) on both bridge ports, each direction.

All of it lives in the namespace this process runs in, which must itself be private
(scripts/in_private_netns.sh): nothing touches the machine's real network.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, TypeVar

from harness import lifetime

T = TypeVar("T")

SUBNET_PREFIX = "10.77.0."
CONTROLLER_ADDR = SUBNET_PREFIX + "254"
ADDRS = {"prefill": SUBNET_PREFIX + "1", "decode": SUBNET_PREFIX + "2", "router": SUBNET_PREFIX + "3"}
LAN_BRIDGE = "br-lan"
PD_BRIDGE = "br-pd"
PD_PORTS = ("pd-prefill", "pd-decode")  # the bridge-side ends of the prefill-decode link


class TopologyError(RuntimeError):
    pass


def unavailable_reason() -> str:
    """Why this process cannot build the hosts here ("" when it can)."""
    if os.environ.get("SGLANG_MORI_IN_NETNS") != "1":
        return "not inside a private network namespace (run through scripts/in_private_netns.sh)"
    for tool in ("ip", "tc", "nsenter", "unshare"):
        if subprocess.run(["sh", "-c", f"command -v {tool}"], capture_output=True).returncode != 0:
            return f"`{tool}` is not installed"
    probe = subprocess.run(["unshare", "-n", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"`unshare -n` is not permitted: {probe.stderr.strip()[:200]}"
    probe = subprocess.run(["ip", "link", "add", "chaos-probe", "type", "veth", "peer", "name", "chaos-probe2"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot create veth pairs: {probe.stderr.strip()[:200]}"
    subprocess.run(["ip", "link", "del", "chaos-probe"], capture_output=True)
    return ""


def _ip(*args: str, ns: Optional[str] = None) -> None:
    argv = (["nsenter", f"--net={ns}", "--"] if ns else []) + list(args)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise TopologyError(f"{' '.join(argv)}: {done.stderr.strip()}")


@dataclass
class Host:
    name: str
    addr: str
    holder: subprocess.Popen

    @property
    def netns(self) -> str:
        return f"/proc/{self.holder.pid}/ns/net"

    def prefix(self) -> List[str]:
        """Prepend to a command line to run it on this host (nsenter execs: same pid, same group)."""
        return ["nsenter", f"--net={self.netns}", "--"]

    def sh(self, *args: str) -> None:
        _ip(*args, ns=self.netns)


class Topology:
    """The three hosts and the two bridges; `close()` (idempotent) removes all of it."""

    def __init__(self) -> None:
        self.hosts: Dict[str, Host] = {}
        self.throttled = False

    # -- building ------------------------------------------------------------------------------
    def build(self) -> "Topology":
        reason = unavailable_reason()
        if reason:
            raise TopologyError(reason)
        try:
            for bridge in (LAN_BRIDGE, PD_BRIDGE):
                _ip("ip", "link", "add", bridge, "type", "bridge")
                _ip("ip", "link", "set", bridge, "up")
            _ip("ip", "addr", "add", f"{CONTROLLER_ADDR}/24", "dev", LAN_BRIDGE)
            for name, addr in ADDRS.items():
                self.hosts[name] = host = Host(name, addr, self._hold_namespace())
                host.sh("ip", "link", "set", "lo", "up")
                self._plug(host, f"lan-{name}", "eth-lan", LAN_BRIDGE)
                host.sh("ip", "addr", "add", f"{addr}/24", "dev", "eth-lan")
            for name, port in zip(("prefill", "decode"), PD_PORTS):
                self._plug(self.hosts[name], port, "eth-pd", PD_BRIDGE)
            for here, there in (("prefill", "decode"), ("decode", "prefill")):
                # More specific than the /24 on eth-lan: prefill <-> decode goes over br-pd only.
                self.hosts[here].sh("ip", "route", "add", f"{ADDRS[there]}/32", "dev", "eth-pd",
                                    "src", ADDRS[here])
        except BaseException:
            self.close()
            raise
        return self

    @staticmethod
    def _hold_namespace() -> subprocess.Popen:
        # A sleeping process in a fresh network namespace; the namespace lives as long as it does.
        # Tied to this process (harness.lifetime): a killed run must not leave the namespace behind.
        holder = lifetime.spawn(["unshare", "-n", "sleep", "86400"])
        ours = os.stat("/proc/self/ns/net").st_ino
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if os.stat(f"/proc/{holder.pid}/ns/net").st_ino != ours:
                    return holder
            except FileNotFoundError:
                pass
            if holder.poll() is not None:
                break
            time.sleep(0.01)  # unshare has not switched namespaces yet (a few ms)
        holder.kill()
        holder.wait(timeout=10)
        lifetime.release(holder.pid)
        raise TopologyError("the namespace holder did not enter a new network namespace")

    @staticmethod
    def _plug(host: Host, outer: str, inner: str, bridge: str) -> None:
        _ip("ip", "link", "add", outer, "type", "veth", "peer", "name", inner, "netns", str(host.holder.pid))
        _ip("ip", "link", "set", outer, "master", bridge)
        _ip("ip", "link", "set", outer, "up")
        host.sh("ip", "link", "set", inner, "up")

    # -- faults on the prefill-decode link -----------------------------------------------------
    def cut(self) -> None:
        for port in PD_PORTS:
            _ip("ip", "link", "set", port, "down")

    def restore(self) -> None:
        for port in PD_PORTS:
            _ip("ip", "link", "set", port, "up")

    def throttle(self, rate: str = "1mbit") -> None:
        for port in PD_PORTS:
            _ip("tc", "qdisc", "replace", "dev", port, "root", "tbf", "rate", rate, "burst", "16kb",
                "latency", "500ms")
        self.throttled = True

    def unthrottle(self) -> None:
        for port in PD_PORTS:
            subprocess.run(["tc", "qdisc", "del", "dev", port, "root"], capture_output=True, timeout=30)
        self.throttled = False

    # -- teardown ------------------------------------------------------------------------------
    def close(self) -> None:
        for host in self.hosts.values():
            if host.holder.poll() is None:
                os.killpg(host.holder.pid, signal.SIGKILL)  # its own session: just the holder
                host.holder.wait(timeout=10)
            lifetime.release(host.holder.pid)
        self.hosts.clear()  # veths inside a gone namespace vanish with it
        for bridge in (LAN_BRIDGE, PD_BRIDGE):
            subprocess.run(["ip", "link", "del", bridge], capture_output=True, timeout=30)

    def __enter__(self) -> "Topology":
        return self.build()

    def __exit__(self, *exc) -> None:
        self.close()


_CLONE_NEWNET = 0x40000000


def on_host(host: Host, fn: Callable[[], T]) -> T:
    """fn() run on `host`: in a thread of ours that joined the host's network namespace (setns
    changes only the calling thread), so a check costs no process start-up."""
    import ctypes
    import threading

    box: Dict[str, object] = {}

    def body() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(host.netns, os.O_RDONLY)
        try:
            if libc.setns(fd, _CLONE_NEWNET) != 0:
                box["error"] = OSError(ctypes.get_errno(), f"setns into {host.name}")
                return
        finally:
            os.close(fd)
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the caller's thread
            box["error"] = exc

    t = threading.Thread(target=body, name=f"on-{host.name}")  # never reused: it stays in that namespace
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]


def can_connect(host: Host, addr: str, port: int, timeout_s: float = 1.0) -> bool:
    """Whether a TCP connection from `host` to addr:port is answered (accepted, or refused: the
    peer's kernel answered) within timeout_s."""
    def attempt() -> bool:
        with socket.socket() as s:
            s.settimeout(timeout_s)
            try:
                s.connect((addr, port))
            except ConnectionRefusedError:
                pass
            except OSError:
                return False
        return True
    return on_host(host, attempt)


def run_on(host: Host, argv: Sequence[str], timeout_s: float = 30.0) -> subprocess.CompletedProcess:
    return subprocess.run(host.prefix() + list(argv), capture_output=True, text=True, timeout=timeout_s)
