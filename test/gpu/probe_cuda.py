"""Step-by-step check of softio's CUDA runtime binding on a GPU host (prints each step; a crash
names the step). `python3 test/gpu/probe_cuda.py`"""

import faulthandler
import sys
from pathlib import Path

faulthandler.enable()
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))

import torch  # noqa: E402

from sglang_mori.softio import cuda_runtime  # noqa: E402

t = torch.arange(1 << 20, dtype=torch.int32, device="cuda").view(torch.uint8)
print("runtime path", cuda_runtime._loaded_runtime_path(), flush=True)
rt = cuda_runtime.load()
print("loaded", rt, rt and rt.version, flush=True)
print("device_of gpu", rt.device_of(t.data_ptr()), flush=True)
host = torch.zeros(16, dtype=torch.uint8)
print("device_of host", rt.device_of(host.data_ptr()), flush=True)
handle, off = rt.export(t.data_ptr() + 4096, 0)
print("export", len(handle), off, flush=True)
print("open own", rt.open(handle, 0) + off == t.data_ptr() + 4096, flush=True)
s = rt.stream(0)
e = rt.event(0)
import numpy as np  # noqa: E402

dst = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
srcs = np.array([t.data_ptr(), t.data_ptr() + 8192], dtype=np.uint64)
dsts = np.array([dst.data_ptr() + 100, dst.data_ptr() + 50000], dtype=np.uint64)
sizes = np.array([4096, 1000], dtype=np.uint64)
rt.copy(dsts, srcs, sizes, s, 0)
rt.record(e, s)
rt.synchronize(e)
ok = torch.equal(dst[100:4196], t[:4096]) and torch.equal(dst[50000:51000], t[8192:9192])
print("copy ok", ok, "batch api", rt.batch_calls, flush=True)
