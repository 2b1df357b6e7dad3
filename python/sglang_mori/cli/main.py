"""`sglang-mori` command line: the softio engine benchmark and the environment doctor.

Each subcommand lives in its own module, imported only when chosen, so that `sglang-mori doctor`
works on a host where torch or sglang are broken. The backend benchmarks that drive the
multi-process PD harness (test tooling) run from a source checkout: `scripts/bench_backend.py`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module, help). Each module exposes add_arguments(parser) and run(args) -> int.
BENCHMARKS = {
    "engine": ("sglang_mori.cli.bench_engine",
               "softio batch writes (TCP, intra-host) vs raw sockets and memcpy"),
}
COMMANDS = {
    "doctor": ("sglang_mori.cli.doctor", "check this host for MORI-IO PD serving"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sglang-mori", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    for name, (module, help_text) in BENCHMARKS.items():
        _add(bench_sub, name, module, help_text)
    for name, (module, help_text) in COMMANDS.items():
        _add(sub, name, module, help_text)
    return parser


def _add(sub, name: str, module: str, help_text: str) -> None:
    p = sub.add_parser(name, help=help_text)
    p.set_defaults(_module=module)
    importlib.import_module(module).add_arguments(p)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(importlib.import_module(args._module).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
