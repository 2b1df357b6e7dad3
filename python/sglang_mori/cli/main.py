"""`sglang-mori` command line: benchmarks and the environment doctor.

Each subcommand lives in its own module, imported only when chosen, so that `sglang-mori doctor`
works on a host where torch or sglang are broken.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

# subcommand -> (module, help). Each module exposes add_arguments(parser) and run(args) -> int.
# `transfer` and `soak` drive the multi-process harness, which is test tooling: it lives in the
# source checkout's test/harness and is not in the wheel, so they run from a checkout only.
BENCHMARKS = {
    "engine": ("sglang_mori.cli.bench_engine",
               "softio batch writes (TCP, intra-host) vs raw sockets and memcpy"),
    "transfer": ("harness.bench_transfer", "full backend, prefill and decode processes"),
    "soak": ("harness.bench_soak", "long run with injected faults and aborts"),
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


def _checkout_test_dir():
    """The source checkout's test/ directory when this package runs from one (editable install)."""
    candidate = Path(__file__).resolve().parents[3] / "test"
    return candidate if (candidate / "harness" / "__init__.py").is_file() else None


def _add(sub, name: str, module: str, help_text: str) -> None:
    p = sub.add_parser(name, help=help_text)
    p.set_defaults(_module=module)
    if module.startswith("harness."):
        test_dir = _checkout_test_dir()
        if test_dir is None:
            p.set_defaults(_missing=f"`sglang-mori bench {name}` needs a source checkout of sglang-mori "
                                    "(its test/harness is test tooling, not shipped in the wheel)")
            return
        if str(test_dir) not in sys.path:
            sys.path.insert(0, str(test_dir))
    try:
        importlib.import_module(module).add_arguments(p)
    except ModuleNotFoundError as exc:
        if exc.name != module:
            raise
        p.set_defaults(_missing=f"{module} is not available in this build")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "_missing", None):
        print(args._missing, file=sys.stderr)
        return 2
    return int(importlib.import_module(args._module).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
