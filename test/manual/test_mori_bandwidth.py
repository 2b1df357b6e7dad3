"""MORI-IO write bandwidth between two processes on this node, 4 KiB .. 64 MiB (mori_bandwidth.py),
over RDMA and over XGMI, GPU memory to GPU memory. Prints the table next to MORI's published CX7
figures and checks the written bytes; across two nodes run mori_bandwidth.py by hand (README.md)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from manual_support import require_node

pytestmark = pytest.mark.manual
SCRIPT = Path(__file__).with_name("mori_bandwidth.py")
# A floor far under line rate: below it the path is wrong (TCP, a far NIC, host bounce), not slow.
MIN_GBPS_AT_64MIB = 10.0


@pytest.mark.parametrize("transport", ["rdma", "xgmi"])
def test_bandwidth_sweep(transport, tmp_path):
    require_node(gpus=2, rdma=(transport == "rdma"))
    out = tmp_path / f"bw-{transport}.json"
    r = subprocess.run([sys.executable, str(SCRIPT), "--transport", transport, "--json", str(out)],
                       capture_output=True, text=True, timeout=1800)
    print(r.stdout)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["bytes_ok"], "the target's bytes differ from what was written"
    sizes = [row["size"] for row in result["rows"]]
    assert sizes[0] == 4 << 10 and sizes[-1] == 64 << 20
    last = result["rows"][-1]
    assert last["gbps"] >= MIN_GBPS_AT_64MIB, f"{transport}: {last['gbps']:.1f} GB/s at 64 MiB"
