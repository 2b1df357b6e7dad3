#!/usr/bin/env python3
"""MORI-IO write bandwidth between two processes, 4 KiB .. 64 MiB, one transfer outstanding.

The shape of MORI's own "batch size = 1" benchmark, so the table can be read against its published
ConnectX-7 figures (ROCm/mori docs/MORI-IO-BENCHMARK.md, write, 400G): 64 KiB 9.11 GB/s,
256 KiB 23.77, 1 MiB 38.91, 4 MiB 46.37, 16 MiB 48.71, 64 MiB 49.34.

One node (both processes here; GPU 0 writes into GPU 1):
    python test/manual/mori_bandwidth.py                          # RDMA (through the NIC)
    python test/manual/mori_bandwidth.py --transport xgmi         # XGMI (MORI_DISABLE_AUTO_XGMI=0)
Two nodes (the descriptor file on a shared filesystem, or copied by hand):
    node B: python test/manual/mori_bandwidth.py --role target --host 10.0.0.2 --desc-file /shared/bw.desc
    node A: python test/manual/mori_bandwidth.py --role initiator --host 10.0.0.1 --desc-file /shared/bw.desc

`--engine soft --mem cpu` runs the same code on softio (CPU, TCP), which checks the script itself.
Every wait is bounded (--timeout); the written bytes are verified at the end by checksum.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

ANCHOR_CX7_WRITE_GBPS = {64 << 10: 9.11, 256 << 10: 23.77, 1 << 20: 38.91, 4 << 20: 46.37,
                         16 << 20: 48.71, 64 << 20: 49.34}
DEFAULT_SIZES = [4 << 10 << (2 * i) for i in range(7)]  # 4K 16K 64K 256K 1M 4M 16M, + 64M below
DEFAULT_SIZES.append(64 << 20)


def human(n: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def load_io(engine: str):
    return importlib.import_module("mori.io" if engine == "mori" else "sglang_mori.softio")


class Buffer:
    """A registered buffer in GPU (torch) or CPU (numpy) memory, filled with a known pattern."""

    def __init__(self, io, eng, size: int, mem: str, device: int, fill: int):
        self.size = size
        if mem == "gpu":
            import torch

            self.t = ((torch.arange(size, dtype=torch.int64, device=f"cuda:{device}") * 7 + fill) % 251).to(torch.uint8)
            self.desc = eng.register_torch_tensor(self.t)
        else:
            import numpy as np

            self.t = ((np.arange(size, dtype=np.int64) * 7 + fill) % 251).astype(np.uint8)
            self.desc = eng.register_memory(self.t.ctypes.data, size, -1, io.MemoryLocationType.CPU)

    def digest(self, n: int) -> str:
        head = self.t[:n]
        data = head.cpu().numpy().tobytes() if hasattr(head, "cpu") else head.tobytes()
        return hashlib.sha256(data).hexdigest()


def make_engine(io, role: str, host: str, qp: int):
    eng = io.IOEngine(f"bw-{role}-{os.getpid()}-{uuid.uuid4().hex[:8]}", io.IOEngineConfig(host, 0))
    eng.create_backend(io.BackendType.RDMA, io.RdmaBackendConfig(qp, -1, -1, io.PollCqMode.POLLING, False))
    return eng


def run_target(args) -> int:
    """Register the destination, publish descriptors, then answer CHECK requests until told to stop."""
    io = load_io(args.engine)
    eng = make_engine(io, "target", args.host, args.qp)
    buf = Buffer(io, eng, max(args.sizes), args.mem, args.target_device, fill=0)
    blob = {"engine": eng.get_engine_desc().pack().hex(), "mem": buf.desc.pack().hex()}
    if args.desc_file:
        Path(args.desc_file).write_text(json.dumps(blob))
        print(f"target ready; descriptors in {args.desc_file}; waiting for {args.desc_file}.done", flush=True)
        deadline = time.monotonic() + args.timeout
        done = Path(args.desc_file + ".done")
        while not done.exists():
            if time.monotonic() > deadline:
                print("target: no initiator finished in time", file=sys.stderr)
                return 1
            time.sleep(0.5)
        n = int(done.read_text() or 4096)
        print(f"target checksum of first {n} bytes: {buf.digest(n)}", flush=True)
        return 0
    print("DESC " + json.dumps(blob), flush=True)
    for line in sys.stdin:  # the local initiator drives us over stdin
        if line.startswith("CHECK "):
            print("SUM " + buf.digest(int(line.split()[1])), flush=True)
    return 0


def sweep(io, eng, local, remote, sizes, args):
    rows = []
    for size in sizes:
        iters = max(args.min_iters, min(args.max_iters, args.bytes_per_size // size))
        for i in range(args.warmup + iters):
            if i == args.warmup:
                t0 = time.perf_counter()
            st = eng.write(local.desc, 0, remote, 0, size, eng.allocate_transfer_uid())
            code = st.WaitFor(int(args.timeout * 1000))
            if int(code) != 0:
                raise RuntimeError(f"write of {human(size)} ended with {code}: {st.Message()}")
        elapsed = time.perf_counter() - t0
        lat_us = elapsed / iters * 1e6
        rows.append({"size": size, "iters": iters, "avg_latency_us": lat_us,
                     "gbps": size * iters / elapsed / 1e9,
                     "anchor_cx7_gbps": ANCHOR_CX7_WRITE_GBPS.get(size)})
        print(f"  {human(size):>8}  {iters:>5} iters  {lat_us:10.1f} us  {rows[-1]['gbps']:7.2f} GB/s", flush=True)
    return rows


def print_table(rows, title):
    print(f"\n{title}")
    print(f"{'size':>8} {'iters':>6} {'avg lat us':>11} {'GB/s':>8} {'CX7 anchor':>11} {'ratio':>6}")
    for r in rows:
        anchor = r["anchor_cx7_gbps"]
        print(f"{human(r['size']):>8} {r['iters']:>6} {r['avg_latency_us']:>11.1f} {r['gbps']:>8.2f} "
              f"{anchor if anchor else '-':>11} {r['gbps'] / anchor if anchor else float('nan'):>6.2f}")


def run_initiator(args, desc_json=None, check=None) -> dict:
    io = load_io(args.engine)
    eng = make_engine(io, "initiator", args.host, args.qp)
    local = Buffer(io, eng, max(args.sizes), args.mem, args.device, fill=3)
    blob = desc_json or json.loads(Path(args.desc_file).read_text())
    eng.register_remote_engine(io.EngineDesc.unpack(bytes.fromhex(blob["engine"])))
    remote = io.MemoryDesc.unpack(bytes.fromhex(blob["mem"]))
    title = f"MORI-IO write, engine={args.engine}, mem={args.mem}, transport={args.transport}, qp={args.qp}"
    print(title, flush=True)
    rows = sweep(io, eng, local, remote, args.sizes, args)
    n = min(args.sizes[-1], 1 << 20)
    expected = local.digest(n)
    result = {"title": title, "rows": rows, "checked_bytes": n, "expected_sum": expected}
    if check is not None:
        result["target_sum"] = check(n)
        result["bytes_ok"] = result["target_sum"] == expected
    elif args.desc_file:
        Path(args.desc_file + ".done").write_text(str(n))
        print(f"initiator checksum of first {n} bytes: {expected} (compare with the target's line)")
    print_table(rows, title)
    return result


def run_local(args) -> dict:
    """Both ends on this node: the target is a child process driven over a pipe."""
    env = dict(os.environ)
    if args.transport == "xgmi":
        env["MORI_DISABLE_AUTO_XGMI"] = "0"  # inverted: only "0" enables XGMI
        os.environ["MORI_DISABLE_AUTO_XGMI"] = "0"
    else:
        env.pop("MORI_DISABLE_AUTO_XGMI", None)
        os.environ.pop("MORI_DISABLE_AUTO_XGMI", None)
    cmd = [sys.executable, __file__, "--role", "target", "--engine", args.engine, "--mem", args.mem,
           "--host", args.host, "--qp", str(args.qp), "--target-device", str(args.target_device),
           "--timeout", str(args.timeout), "--sizes", ",".join(str(s) for s in args.sizes)]
    child = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline()
        if not line.startswith("DESC "):
            raise RuntimeError(f"target did not start (got {line!r}, exit {child.poll()})")

        def check(n):
            child.stdin.write(f"CHECK {n}\n")
            child.stdin.flush()
            reply = child.stdout.readline()
            return reply.split()[1] if reply.startswith("SUM ") else None

        return run_initiator(args, json.loads(line[5:]), check)
    finally:
        if child.stdin:
            child.stdin.close()
        try:
            child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait(timeout=30)


def parse_sizes(text: str):
    out = []
    for part in text.split(","):
        part = part.strip().upper()
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(part[-1:], 1)
        out.append(int(part.rstrip("KMG")) * mult)
    return sorted(out)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--role", choices=("local", "target", "initiator"), default="local")
    p.add_argument("--engine", choices=("mori", "soft"), default="mori")
    p.add_argument("--mem", choices=("gpu", "cpu"), default="gpu")
    p.add_argument("--transport", choices=("rdma", "xgmi"), default="rdma")
    p.add_argument("--host", default="127.0.0.1", help="IPv4 address this end advertises")
    p.add_argument("--device", type=int, default=0, help="initiator GPU")
    p.add_argument("--target-device", type=int, default=1, help="target GPU")
    p.add_argument("--qp", type=int, default=4)
    p.add_argument("--sizes", default=",".join(str(s) for s in DEFAULT_SIZES))
    p.add_argument("--bytes-per-size", type=int, default=4 << 30, help="bytes written per size")
    p.add_argument("--min-iters", type=int, default=10)
    p.add_argument("--max-iters", type=int, default=2000)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per wait")
    p.add_argument("--desc-file", default="")
    p.add_argument("--json", default="", help="write the results here")
    args = p.parse_args(argv)
    args.sizes = parse_sizes(args.sizes) if isinstance(args.sizes, str) else args.sizes
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.role == "target":
        return run_target(args)
    result = run_local(args) if args.role == "local" else run_initiator(args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    if result.get("bytes_ok") is False:
        print("ERROR: the target's bytes differ from what was written", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
