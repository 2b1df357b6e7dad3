"""The engine conformance suite (test/engine) on real MORI-IO.

test/engine parametrizes its tests over the engines available; with SGLANG_MORI_MANUAL_E2E=1 and an
importable `mori.io` it adds `mori` next to `softio`. This test runs that suite and checks the mori
half really ran and passed (so a silently missing parameter cannot look like success).
"""

import os
import re
import subprocess
import sys

import pytest
from manual_support import REPO, require_node

pytestmark = pytest.mark.manual


def test_conformance_suite_on_real_mori(tmp_path):
    require_node(gpus=1, rdma=True)  # the suite builds RDMA engines on CPU memory
    env = dict(os.environ, SGLANG_MORI_MANUAL_E2E="1")
    env.pop("MORI_DISABLE_AUTO_XGMI", None)  # RDMA only, as the suite's conformance cases assume
    r = subprocess.run([sys.executable, "-m", "pytest", str(REPO / "test" / "engine"), "-v", "-rA",
                        "-p", "no:cacheprovider"], env=env, capture_output=True, text=True,
                       timeout=3600, cwd=REPO)
    (tmp_path / "engine-suite.log").write_text(r.stdout + r.stderr)
    print(r.stdout[-4000:])
    mori_passed = re.findall(r"^(\S+\[[^\]]*mori[^\]]*\]) PASSED", r.stdout, re.M)
    mori_failed = re.findall(r"^(\S+\[[^\]]*mori[^\]]*\]) (?:FAILED|ERROR)", r.stdout, re.M)
    assert r.returncode == 0, f"engine suite failed; log in {tmp_path}/engine-suite.log"
    assert not mori_failed, mori_failed
    assert len(mori_passed) >= 10, f"only {len(mori_passed)} tests ran on real mori: was it importable?"
