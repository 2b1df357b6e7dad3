"""`sglang-mori doctor`: is this host ready to serve PD disaggregation over MORI-IO?

Prints one line per check (ok / warn / fail / absent, with a fix) and exits 1 if any check failed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from sglang_mori.doctor.host import HostView
from sglang_mori.doctor.result import exit_code
from sglang_mori.doctor.runner import run_checks


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bootstrap", action="append", default=[], metavar="HOST:PORT",
                        help="check that this prefill bootstrap server answers (repeatable)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds per network probe")
    # Where to look; for containers with the host's /sys mounted elsewhere, and for tests.
    parser.add_argument("--sysfs-root", default="/sys", help=argparse.SUPPRESS)
    parser.add_argument("--proc-root", default="/proc", help=argparse.SUPPRESS)
    parser.add_argument("--boot-root", default="/boot", help=argparse.SUPPRESS)
    parser.add_argument("--lib-dir", action="append", default=None, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    host = HostView(sys_root=Path(args.sysfs_root), proc_root=Path(args.proc_root),
                    boot_root=Path(args.boot_root),
                    lib_dirs=[Path(d) for d in args.lib_dir] if args.lib_dir else None,
                    timeout_s=args.timeout)
    results = run_checks(host, args.bootstrap)
    if args.json:
        print(json.dumps([r.as_dict() for r in results], indent=1))
    else:
        for r in results:
            print(r.line())
        counts = {s: sum(1 for r in results if r.status.value == s) for s in ("ok", "warn", "fail", "absent")}
        print("summary: " + ", ".join(f"{n} {s}" for s, n in counts.items()))
    return exit_code(results)
