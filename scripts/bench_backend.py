#!/usr/bin/env python3
"""The backend benchmarks that drive the multi-process PD harness (test tooling, not in the wheel),
so they run from a source checkout:

    python scripts/bench_backend.py transfer --requests 256 --concurrency 64 --prompt-tokens 512 --compare
    python scripts/bench_backend.py soak [--requests N | --quick] [--json]

`transfer` (test/harness/bench_transfer.py): the full backend, prefill and decode in separate
processes, optionally beside SGLang's built-in mori and Mooncake backends. `soak`
(test/harness/bench_soak.py): a long run with injected faults and aborts. `sglang-mori bench engine`
is the benchmark that ships with the package.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "python"))
sys.path.insert(0, str(REPO / "test"))  # the harness (test tooling, not in the wheel)

BENCHMARKS = {
    "transfer": ("harness.bench_transfer", "full backend, prefill and decode processes"),
    "soak": ("harness.bench_soak", "long run with injected faults and aborts"),
    "hotpath": ("harness.bench_hotpath", "our Python per request by thread role, in one process (no SGLang)"),
    "handoff": ("harness.bench_handoff", "wall-clock hand-offs on time to first token (destinations, last chunk -> Success)"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bench_backend.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="bench", required=True)
    for name, (module, help_text) in BENCHMARKS.items():
        p = sub.add_parser(name, help=help_text)
        p.set_defaults(_module=module)
        importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(importlib.import_module(args._module).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
