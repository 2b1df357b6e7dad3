"""The gather kernel alone across two GPUs (a diagnostic, not a test): one 8192-token request's
range table (MLA page 64, GQA page 16, decode on GPU 1), copied by softio's kernel at several grids,
the table uploaded from pageable memory, from pinned memory (what softio does) or already resident,
against a plain copy of the same bytes. `python3 test/gpu/kernel_experiment.py` on a two-GPU host;
docs/benchmarks.md "Two GPUs" reports it."""

import sys
import time

import cupy
import numpy as np
import torch

sys.path[:0]=["test/gpu","test/inprocess","python"]
from pd_rig import GpuPD, Requests, child_env
child_env()
def main():
    from link_bench import device_engine, EngineCalls, captured_batch
    for shape, page in (("mla",64),("gqa",16)):
        with GpuPD(shape, page, 8192//page, decode_device=1) as rig:
            reqs = Requests(page, 8192, 1, 0, np.random.default_rng(0))
            dev = device_engine(rig)
            c = EngineCalls(rig, reqs, 0)
            dsts, srcs, sizes, peer = captured_batch(dev, lambda: EngineCalls.wait(c.post("ours_calls")))
            gb = int(sizes.sum())/1e9
            cp = dev.copier
            for blocks in (16, 64, 132, 264):
                for mode in ("pageable", "pinned", "resident"):
                    host = np.concatenate([dsts, srcs, sizes]).astype(np.uint64)
                    n = len(sizes)
                    res = cupy.asarray(host) if mode == "resident" else None
                    ts = []
                    for i in range(8):
                        torch.cuda.synchronize(0)
                        t0 = time.perf_counter()
                        with cupy.cuda.Device(0):
                            s = cupy.cuda.ExternalStream(dev.stream)
                            with s:
                                if mode == "pageable":
                                    table = cupy.asarray(host)
                                elif mode == "pinned":
                                    pm = cupy.cuda.alloc_pinned_memory(3*n*8); h = np.frombuffer(pm, np.uint64, 3*n); h[:] = host
                                    table = cupy.empty(3*n, dtype=cupy.uint64); table.set(h, stream=s)
                                else:
                                    table = res
                                cp.kernel((min(n, blocks),), (512,), (table, np.int64(n)))
                        torch.cuda.synchronize(0)
                        ts.append(time.perf_counter()-t0)
                    ts = sorted(ts[1:])
                    print(f"{shape} 8192 blocks {blocks:>3} {mode:>9}: {gb/ts[len(ts)//2]:6.1f} GB/s (best {gb/ts[0]:6.1f})", flush=True)
            x = torch.empty(int(gb*1e9), dtype=torch.uint8, device="cuda:0"); y = torch.empty_like(x, device="cuda:1")
            ts=[]
            for i in range(8):
                torch.cuda.synchronize(0); torch.cuda.synchronize(1); t0=time.perf_counter(); y.copy_(x); torch.cuda.synchronize(0); torch.cuda.synchronize(1); ts.append(time.perf_counter()-t0)
            ts=sorted(ts[1:]); print(f"{shape} plain copy {gb/ts[len(ts)//2]:.1f} GB/s")
            del x, y
if __name__ == "__main__":
    main()
