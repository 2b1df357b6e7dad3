"""Did the prefill server's transfers really run in the transfer process (SGLANG_MORI_TRANSFER_PROCESS=on)?

The switch falls back to in-process transfers with a warning when it is refused (startup.py,
manager.py): a PD phase or config that asks for the transfer process must not count such a run
as a pass. This reads the prefill server's log for the lines our code writes:
- the scheduler's acceptance: client.py, "transfer process pid N serves control port P";
- the child's start-up proof: child_parts.py, "... registered and proven";
- the child's first room at Success: child_tables.py, "first room reached Success";
- the refusal: manager.py, "SGLANG_MORI_TRANSFER_PROCESS=on refused: <reason>".
`failure(log_text)` is None when every prefill rank's child started and carried a room to
Success and nothing was refused, else the reason, by name. Measurement only.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, Optional

ENV = {"SGLANG_MORI_TRANSFER_PROCESS": "on"}
ACCEPTED = re.compile(r"sglang-mori: transfer process pid (\d+) serves control port (\d+)")
PROVEN = re.compile(r"sglang-mori transfer process pid (\d+): engine .* registered and proven")
FIRST_SUCCESS = re.compile(r"sglang-mori transfer process pid (\d+): first room reached Success")
REFUSED = re.compile(r"(?:prefill tp(\d+): )?SGLANG_MORI_TRANSFER_PROCESS=on refused: (.*?)(?:; transfers stay|$)",
                     re.MULTILINE)
# the child's CPU from its spawn to ready (child_parts.py), per child: what the start-up cost
STARTUP_CPU = re.compile(r"sglang-mori transfer process pid (\d+): .* start-up used (\d+) ms of CPU")


def summary(text: str) -> Dict:
    return {"accepted_pids": sorted({int(m.group(1)) for m in ACCEPTED.finditer(text)}),
            "proven_pids": sorted({int(m.group(1)) for m in PROVEN.finditer(text)}),
            "success_pids": sorted({int(m.group(1)) for m in FIRST_SUCCESS.finditer(text)}),
            "refusals": [refusal(m) for m in REFUSED.finditer(text)][:4],
            "startup_cpu_ms": {int(m.group(1)): int(m.group(2)) for m in STARTUP_CPU.finditer(text)}}


def refusal(match) -> str:
    """The reason, led by the refusing rank where the line names it (under TP every rank decides alone)."""
    return match.group(2) if match.group(1) is None else f"prefill tp{match.group(1)}: {match.group(2)}"


def failure(text: str, ranks: int = 1) -> Optional[str]:
    """The reason this log does not show `ranks` transfer processes that served traffic, or None."""
    s = summary(text)
    if s["refusals"]:
        return f"transfer process refused (transfers stayed in-process): {s['refusals'][0]}"
    if len(s["accepted_pids"]) < ranks:
        return (f"transfer process never accepted: {len(s['accepted_pids'])} of {ranks} prefill ranks "
                "logged 'serves control port'")
    missing = set(s["accepted_pids"]) - set(s["proven_pids"])
    if missing:
        return f"transfer process pid {min(missing)} served without its start-up proof in the log"
    idle = set(s["accepted_pids"]) - set(s["success_pids"])
    if idle:
        return f"transfer process pid {min(idle)} never carried a room to Success (it never posted)"
    return None


def check_log(path: Path, ranks: int = 1) -> Dict:
    """{'ok': bool, 'failure': reason or None, **summary} of a prefill server's log file."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError as exc:
        return {"ok": False, "failure": f"transfer process check: no prefill log ({exc})"}
    why = failure(text, ranks)
    return {"ok": why is None, "failure": why, **summary(text)}
