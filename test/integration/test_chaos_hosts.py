"""The chaos hosts (harness/chaos/hosts.py): three network namespaces whose prefill-decode link can
be cut, restored and throttled while the router's host keeps reaching both servers.

Runs where the test process is in a private network namespace (scripts/in_private_netns.sh, as
`make test` runs everything) and may create veth pairs; skipped, with the reason, elsewhere.
"""

import time

import pytest

from harness.chaos.hosts import ADDRS, Topology, can_connect, run_on, unavailable_reason

REASON = unavailable_reason()
pytestmark = pytest.mark.skipif(bool(REASON), reason=f"chaos hosts unavailable: {REASON}")

PORT = 9  # nothing listens: a refused connection proves the peer answered


def reachable(topo, src, dst, timeout_s=1.0):
    return can_connect(topo.hosts[src], ADDRS[dst], PORT, timeout_s)


def test_cut_and_throttle_touch_only_the_prefill_decode_link():
    with Topology() as topo:
        route = run_on(topo.hosts["prefill"], ["ip", "route", "get", ADDRS["decode"]]).stdout
        assert "dev eth-pd" in route, route  # prefill -> decode goes over the link, not the LAN
        assert reachable(topo, "prefill", "decode") and reachable(topo, "decode", "prefill")

        topo.cut()
        assert not reachable(topo, "prefill", "decode") and not reachable(topo, "decode", "prefill")
        assert reachable(topo, "router", "prefill") and reachable(topo, "router", "decode")
        # The route stays (a cable pull, not an unconfigured host): packets are dropped silently.
        assert "dev eth-pd" in run_on(topo.hosts["prefill"], ["ip", "route", "get", ADDRS["decode"]]).stdout

        topo.restore()
        deadline = time.monotonic() + 10
        while not reachable(topo, "prefill", "decode", 2.0):  # carrier comes back within a moment
            assert time.monotonic() < deadline, "the link did not come back"
        topo.throttle("1mbit")
        assert "tbf" in _qdisc()
        assert reachable(topo, "prefill", "decode")
        topo.unthrottle()
        assert "tbf" not in _qdisc()
    assert "br-pd" not in _links() and "br-lan" not in _links()


def _qdisc():
    import subprocess
    return subprocess.run(["tc", "qdisc", "show"], capture_output=True, text=True).stdout


def _links():
    import subprocess
    return subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout
