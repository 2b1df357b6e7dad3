"""A check's verdict and its one-line rendering."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Status(str, enum.Enum):
    OK = "ok"
    WARN = "warn"  # works, but a known trap or a slow path
    FAIL = "fail"  # PD serving with MORI-IO will not work as configured
    ABSENT = "absent"  # the thing is not on this host; says nothing about whether it is needed here


@dataclass(frozen=True)
class CheckResult:
    name: str
    status: Status
    detail: str
    fix: str = ""

    def line(self) -> str:
        text = f"{self.status.value:<6}  {self.name:<20}  {self.detail}"
        if self.fix and self.status is not Status.OK:
            text += f"  | fix: {self.fix}"
        return text

    def as_dict(self) -> dict:
        return {"name": self.name, "status": self.status.value, "detail": self.detail,
                "fix": self.fix}


def exit_code(results) -> int:
    """Non-zero when any check failed; warnings and absences do not fail the run."""
    return 1 if any(r.status is Status.FAIL for r in results) else 0
