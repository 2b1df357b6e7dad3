"""The transfer process's hand-off inside SGLang's send(), on the CPU (issue 28, docs/benchmarks.md
"Session 22: the hand-off in send(), on the CPU"). With SGLANG_MORI_TRANSFER_PROCESS=on, SGLang's
`send` reaches `TransferProcessService.add_chunk`, which reads the room's aux and sends one record to
the child. This runs that call with SGLang-shaped inputs: page indices as SGLang 0.5.23 passes them
(`kv_to_page_indices`: a numpy int32 array, from the int32 `req_to_token`; int64 too), 64 pages (1K
tokens at page 16) or 512 (8K), one chunk a request (the last, with its aux index), aux read by the
manager's own `_read_aux` from torch buffers shaped like SGLang's MetadataBuffers (Llama-8B widths:
hidden 4096 bf16). A forked process drains the channel with the real Receiver (the child's end), so
the sends never block. Per request: the calls (Python and C, as the profiler hook sees them; even
requests) and the scheduler thread's CPU time (odd requests), medians.

    .venv/bin/python test/manual/handoff_calls_cpu.py [PAGES] [REQUESTS] [int32|int64]

PYTHONPATH=<checkout>/python measures another checkout's hand-off.
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import sys
import time
from types import SimpleNamespace

import numpy as np
import torch

from sglang_mori.backend.manager import MoriKVManager
from sglang_mori.transfer_process import handoff
from sglang_mori.transfer_process.client import TransferProcess
from sglang_mori.transfer_process.scheduler_service import TransferProcessService
from sglang_mori.transfer_process.status_table import StatusTable

AUX_SLOTS = 64


def metadata_buffers(slots: int = AUX_SLOTS):
    """Torch CPU tensors as SGLang's MetadataBuffers builds them (sampling mask off, no DSA, no
    checksum), in its get_buf_infos order."""
    z = torch.zeros
    return [z((slots, 16), dtype=torch.int32), z((slots, 16), dtype=torch.int32),
            z((slots, 16), dtype=torch.float32), z((slots, 16), dtype=torch.int32),
            z((slots, 128), dtype=torch.float32), z((slots, 128), dtype=torch.int32),
            z((slots, 16), dtype=torch.float32), z((slots, 16), dtype=torch.int64),
            z((slots, 4096), dtype=torch.bfloat16), z((slots, 8), dtype=torch.uint64)]


def _drain(sock, theirs) -> None:
    theirs.close()  # the fork's copy of the scheduler's end, or the drain never reads end-of-file
    receiver = handoff.Receiver(sock)
    while receiver.next() is not None:
        pass


def build(slots: int = 4096):
    """A TransferProcessService whose process is the real client object without its child: the
    channel goes to a forked drain instead (the start-up, pools and status writes are not counted)."""
    bufs = metadata_buffers()
    kv_args = SimpleNamespace(aux_data_ptrs=[b.data_ptr() for b in bufs], aux_item_lens=[b[0].nbytes for b in bufs],
                              aux_data_lens=[b.nbytes for b in bufs])
    manager = SimpleNamespace(kv_args=kv_args)
    # the manager's own choice of reader for the hand-off (a checkout before session 22's cut: _read_aux)
    reader = getattr(MoriKVManager, "_handoff_aux_reader", None)
    read_aux = reader(manager) if reader is not None else MoriKVManager._read_aux.__get__(manager)
    mine, theirs = handoff.channel_pair()
    drain = multiprocessing.get_context("fork").Process(target=_drain, args=(theirs, mine), daemon=True)
    drain.start()
    theirs.close()
    process = object.__new__(TransferProcess)
    process.__dict__.update(table=StatusTable.create(slots), sender=handoff.Sender(mine), _socket=mine,
                            process=drain, dead_reason=None, slots={}, _free=list(range(slots - 1, -1, -1)),
                            _releasing=[])
    sglang = SimpleNamespace(fail=lambda room, reason: (_ for _ in ()).throw(AssertionError(reason)))
    service = TransferProcessService(process, sglang, read_aux)
    manager.bufs = bufs  # keeps the buffers alive
    return service, process, manager


def main(pages: int = 512, requests: int = 2000, dtype: str = "int32") -> None:
    service, process, keep = build()
    rng = np.random.default_rng(0)
    counted, cpu = [], []
    n = [0]

    def hook(frame, event, arg):
        if event in ("call", "c_call"):
            n[0] += 1

    for i in range(requests):
        room = (1 << 40) + i
        # SGLang: (req_to_token[row, a:b][::page] // page).cpu().numpy(), a fresh array each send
        kv = torch.from_numpy(rng.permutation(pages * 4)[:pages].astype(np.int32) * 16)
        page_indices = (kv // 16).numpy().astype(dtype, copy=False)
        service.claim(room)
        count = i % 2 == 0  # calls on even requests, CPU time on odd ones (the hook's cost left out)
        n[0] = 0
        t0 = time.thread_time_ns()
        if count:
            sys.setprofile(hook)
        service.add_chunk(room, page_indices, slice(0, pages), True, aux_index=i % AUX_SLOTS, state_indices=[],
                          num_kv_tokens=pages * 16, wait_event=None, indices_event=None, trace_ctx=None)
        sys.setprofile(None)
        t1 = time.thread_time_ns()
        if i >= requests // 10:  # the first tenth warms up
            (counted.append(n[0]) if count else cpu.append((t1 - t0) / 1e3))
        service.release(room)
    process.close(timeout_s=10.0)
    print(f"add_chunk hand-off, {pages} pages {dtype}, last chunk with aux ({len(keep.bufs)} buffers): median "
          f"{statistics.median(counted):.0f} calls, {statistics.median(cpu):.1f} us thread CPU "
          f"(p10 {np.percentile(cpu, 10):.1f}, p90 {np.percentile(cpu, 90):.1f}), {len(cpu)} requests; pid {os.getpid()}")


if __name__ == "__main__":
    main(*(f(a) for f, a in zip((int, int, str), sys.argv[1:])))
