"""Import stub for Hugging Face `datasets`, for SGLang's bench_serving client only.

`sglang.benchmark.datasets` imports `datasets.load_dataset` at module load for its MMMU and
LongBench loaders; the chaos run uses the `random-ids` workload, which never calls it. The real
package (with pyarrow and pandas) is in requirements/bench.txt, not in CI; this stub lets CI run
SGLang's own client without it, and fails loudly if a loader that needs it is ever chosen.
"""


def load_dataset(*args, **kwargs):
    raise RuntimeError("the `datasets` stub (test/harness/chaos/client_stubs) cannot load datasets; "
                       "install requirements/bench.txt for workloads other than random-ids")
