"""Timeline of one prefill step on the GPU rig (a diagnostic, not a test): when each layer group
was posted by the worker, when each device copy batch was enqueued and completed, when the
forward ended, when send() ran and when the room's Success came; then a cProfile of the chunk
submitter's work for one request. `python3 test/gpu/trace_step.py [shape page tokens decode_device]`."""

from __future__ import annotations

import cProfile
import pstats
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "inprocess"), str(HERE.parents[1] / "python")]


def main() -> None:
    import numpy as np

    from pd_rig import GpuPD, Requests, child_env
    from sglang_mori.backend.prefill.layerwise.worker import LayerWorker
    from sglang_mori.backend.prefill.submitter import Chunk, ChunkSubmitter
    from sglang_mori.softio import device_path

    child_env()
    shape, page, tokens, decode_device = (sys.argv[1:] + ["mla", "64", "16384", "0"][len(sys.argv) - 1:])[:4]
    page, tokens, decode_device = int(page), int(tokens), int(decode_device)
    events = []
    t = time.perf_counter

    def wrap(cls, name, label):
        original = getattr(cls, name)

        def traced(self, *a, **k):
            start = t()
            out = original(self, *a, **k)
            events.append((start, t(), label))
            return out
        setattr(cls, name, traced)

    wrap(LayerWorker, "submit", "worker group post")
    wrap(ChunkSubmitter, "submit", "shard chunk submit")
    original_submit = device_path.DeviceEngine.submit
    original_shared = device_path.DeviceEngine.submit_shared

    def submit(self, dsts, srcs, sizes, statuses, *more):
        start = t()
        original_submit(self, dsts, srcs, sizes, statuses, *more)
        mode = "kernel" if self.copier is not None else "memcpy"
        events.append((start, t(), f"device submit ({mode}) {int(sizes.sum()) / 1e6:.1f} MB, {len(sizes)} ranges"))

    def submit_shared(self, dst_base, src_base, dst_off, src_off, sizes, statuses, *more):
        start = t()
        original_shared(self, dst_base, src_base, dst_off, src_off, sizes, statuses, *more)
        mode = "kernel" if self.copier is not None else "memcpy"
        n = len(dst_base)
        events.append((start, t(), f"device submit ({mode}, shared) {n * int(sizes.sum()) / 1e6:.1f} MB, "
                                   f"{n} x {len(sizes)} ranges"))
    device_path.DeviceEngine.submit = submit
    device_path.DeviceEngine.submit_shared = submit_shared

    with GpuPD(shape, page, 2 * (tokens // page + 1), decode_device=decode_device) as rig:
        reqs = Requests(page, tokens, 1, 0, np.random.default_rng(0))
        for mode in (False, True, False, True):
            events.clear()
            r = rig.prefill_batch(reqs, layerwise=mode)
            t0 = min(e[0] for e in events) if events else 0
            print(f"--- layer-wise {mode}: forward {r.forward_ms:.2f} ms, tail {r.tail_ms:.2f} ms, total {r.total_ms:.2f}")
            for start, end, label in sorted(events):
                print(f"  {1e3 * (start - t0):8.2f} .. {1e3 * (end - t0):8.2f} ms  {label}")
            rig.release(rig.last_rooms)
        # the chunk submitter's own work for one request, profiled in this thread
        p = rig.prefill
        prof = cProfile.Profile()
        n = 5
        spent = 0.0
        for _ in range(n):
            rooms = rig.next_rooms(1)
            rig.open_rooms(reqs, rooms)
            chunk = Chunk(room=rooms[0], kv_indices=np.asarray(reqs.src[0]), index_slice=slice(0, reqs.src.shape[1]),
                          is_last=True, aux_index=1, state_indices=None)
            start = t()
            prof.enable()
            p.service.submitter.submit(chunk)
            prof.disable()
            spent += t() - start
            p.sglang.wait_concluded(rooms, 30)
            rig.release(rooms)
        print(f"chunk submit: {1e3 * spent / n:.2f} ms per request of {tokens} tokens")
        pstats.Stats(prof).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
