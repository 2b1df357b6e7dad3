"""The CPU cost of layer-wise's scheduler-thread steps for one 8K-token request of an 8-layer MHA
model, page size 1 (the shape of session 16's GPU runs, docs/benchmarks.md): begin_batch (before
the forward's first kernel is launched), the 8 attention hooks' on_layer, and end_batch, on softio
engines in one process (test/inprocess/layerwise_rig.py). The rig's token row is a numpy array, so
the device-to-host read that begin_batch makes of a GPU row is not in these figures.

    scripts/in_private_netns.sh .venv/bin/python test/manual/layerwise_hook_cpu.py [REQUESTS]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

TEST = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(TEST / "inprocess"), str(TEST / "harness"), str(TEST)]
from layerwise_rig import Geometry, LayerwiseRig  # noqa: E402

TOKENS, LAYERS = 8192, 8


def main(requests: int = 10) -> None:
    geometry = Geometry(is_mla=False, layers=LAYERS, page_size=1, pages=TOKENS * (requests + 2))
    steps = {"begin_batch": [], f"{LAYERS} x on_layer": [], "end_batch": []}
    with LayerwiseRig(geometry, group_size=0) as rig:  # group_size 0: halving groups, as shipped
        p = rig.prefills[0]
        for i in range(requests):
            req = rig.request(1000 + i, TOKENS)
            rig.open(req)
            view = rig.batch_view(req, 0, TOKENS)
            t = time.perf_counter()
            batch = p.session.begin_batch(view)
            steps["begin_batch"].append(time.perf_counter() - t)
            pool = p.pool()
            t = time.perf_counter()
            for layer in range(LAYERS):
                p.session.on_layer(batch, pool, layer)
            steps[f"{LAYERS} x on_layer"].append(time.perf_counter() - t)
            t = time.perf_counter()
            p.session.end_batch(batch)
            steps["end_batch"].append(time.perf_counter() - t)
            if not batch.done.wait(10):
                raise SystemExit("the layer-wise worker did not finish the batch")
    for name, xs in steps.items():
        print(f"{name:<14} median {statistics.median(xs) * 1e3:.3f} ms (min {min(xs) * 1e3:.3f}, "
              f"max {max(xs) * 1e3:.3f}) over {len(xs)} requests")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 10)
