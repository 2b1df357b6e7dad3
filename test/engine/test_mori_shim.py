"""The `mori` shim: SGLang's own mori backend imports and runs its idioms on softio."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import sglang_mori.softio

SOFTIO_ONLY = True
SHIM = Path(__file__).resolve().parents[1] / "harness" / "mori_shim"

# Run in a fresh interpreter: the shim must not leak `mori` into this test process.
SCRIPT = textwrap.dedent("""
    import numpy as np
    import mori, mori.io, mori.cpp
    import sglang_mori.softio as softio
    assert mori.io.IOEngine is softio.IOEngine
    assert mori.cpp.TransferStatus is softio.TransferStatus
    import sglang.srt.disaggregation.mori.conn as conn
    from mori.io import (BackendType, EngineDesc, IOEngine, IOEngineConfig, MemoryLocationType,
                         PollCqMode, RdmaBackendConfig, StatusCode)

    def make(key):
        # As MoriKVManager._init_engine does it: positional config, notifications off.
        engine = IOEngine(key, IOEngineConfig(host="127.0.0.1", port=0))
        engine.create_backend(BackendType.RDMA,
                              RdmaBackendConfig(4, -1, 4, PollCqMode.POLLING, False))
        assert engine.get_engine_desc().port > 0
        return engine

    prefill, decode = make("io-prefill-shim"), make("io-decode-shim")
    src = np.arange(1 << 16, dtype=np.uint8)
    dst = np.zeros(1 << 16, dtype=np.uint8)
    src_desc = prefill.register_memory(src.ctypes.data, src.nbytes, 0, MemoryLocationType.GPU)
    dst_desc = decode.register_memory(dst.ctypes.data, dst.nbytes, 0, MemoryLocationType.GPU)
    blob = conn._pack_mem_desc_list([dst_desc])
    prefill.register_remote_engine(EngineDesc.unpack(decode.get_engine_desc().pack()))
    (remote,) = conn._unpack_mem_desc_list(blob)
    statuses = prefill.batch_write([src_desc], [[0, 8192]], [remote], [[4096, 0]],
                                   [[4096, 4096]], [prefill.allocate_transfer_uid()])
    assert prefill.wait_all(statuses, timeout_ms=10000) == StatusCode.SUCCESS
    assert (dst[4096:8192] == src[:4096]).all() and (dst[:4096] == src[8192:12288]).all()
    print("SHIM-OK")
""")


@pytest.mark.timeout(600)
def test_sglang_mori_backend_runs_its_idioms_on_the_shim():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(SHIM)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", SCRIPT], env=env,
                          capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "SHIM-OK" in proc.stdout


def test_shim_directory_is_not_a_package():
    assert (SHIM / "mori" / "__init__.py").is_file()
    assert (SHIM / "mori" / "io" / "__init__.py").is_file() and (SHIM / "mori" / "cpp.py").is_file()
    assert not (SHIM / "__init__.py").exists()
    # Without the shim on the path, `mori` is whatever is installed (here: nothing), never it.
    proc = subprocess.run(
        [sys.executable, "-c", "import importlib.util as u; s = u.find_spec('mori'); "
                               "print(s.origin if s else 'none')"],
        capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    assert str(SHIM) not in proc.stdout
