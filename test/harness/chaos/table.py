"""The chaos run's results as markdown (a fault x backend table, then every failure cause) and JSON."""

from __future__ import annotations

import dataclasses
import json
from typing import Dict, List, Sequence

from harness.chaos.faults import BY_NAME
from harness.chaos.runner import FaultResult

LABELS = {"mori": "ours", "mooncake_tcp": "Mooncake TCP", "mori_builtin": "built-in mori"}


def recovered(r: FaultResult) -> str:
    return "no" if r.recovered_s is None else f"{r.recovered_s:.1f} s"


def _leftovers(r: FaultResult) -> str:
    problems = [f"{role}: {', '.join(p)}" for role, p in r.leftovers.items() if p]
    return "; ".join(problems) if problems else "none"


def batch_note(r: FaultResult) -> str:
    """The completed requests accepted on a batch-dependent prompt, said apart ("" if none)."""
    c = r.counts
    return (f"{c.batch_dependent} batch-dependent (standalone gives {c.batch_dependent_answers} answers)"
            if c.batch_dependent else "")


def verdict(r: FaultResult) -> str:
    fault = BY_NAME.get(r.fault)
    misses = r.goal_failures(fault.recovery_goal_s if fault else 10.0)
    if misses:
        return "FAIL: " + "; ".join(misses)
    return f"pass; {batch_note(r)}" if r.counts.batch_dependent else "pass"


def passed(r: FaultResult) -> bool:
    return verdict(r).startswith("pass")


def _run_of(r: FaultResult) -> str:
    """The seed and router settings cells ("" when the results do not say them)."""
    return f"{'-' if r.seed is None else r.seed} | {r.router or '-'} | "


def render(results: Sequence[FaultResult]) -> str:
    """One row per fault run. Runs that state their load seed or router settings (chaos_pd.py
    --seeds / --router-settings) get a column for each, so that every seed's row is there."""
    runs = any(r.seed is not None or r.router for r in results)
    lines = [
        f"| fault | backend | {'seed | router | ' if runs else ''}completed (token-identical) | mismatched | "
        "failed with cause | slowest failure | hung | serving again after | leftovers | goals |",
        f"|---|---|{'---|---|' if runs else ''}---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        c = r.counts
        label = BY_NAME[r.fault].label if r.fault in BY_NAME else r.fault
        lines.append(
            f"| {label} | {LABELS.get(r.backend, r.backend)} | {_run_of(r) if runs else ''}{c.completed}/{c.requests}"
            f"{f', {batch_note(r)}' if c.batch_dependent else ''} | {c.mismatch} "
            f"| {c.failed}{f' ({c.unnamed} without cause)' if c.unnamed else ''} | {c.slowest_failure_s:.1f} s | {c.hung} | {recovered(r)} | {_leftovers(r)} "
            f"| {verdict(r)} |")
    return "\n".join(lines)


def render_seeds(results: Sequence[FaultResult]) -> str:
    """Every seed of each fault, backend and router settings on one line: the runs side by side,
    so that no table depends on one seed's luck."""
    groups: Dict[tuple, List[FaultResult]] = {}
    for r in results:
        groups.setdefault((r.fault, r.backend, r.router), []).append(r)
    lines = ["| fault | backend | router | per seed: completed, hung, serving again after, goals | all seeds |",
             "|---|---|---|---|---|"]
    for (fault, backend, router), runs in groups.items():
        label = BY_NAME[fault].label if fault in BY_NAME else fault
        cells = "; ".join(f"seed {r.seed}: {r.counts.completed}/{r.counts.requests}, {r.counts.hung} hung, "
                          f"{recovered(r)}, {'pass' if passed(r) else 'FAIL'}" for r in runs)
        overall = "pass" if all(passed(r) for r in runs) else f"FAIL ({sum(not passed(r) for r in runs)}/{len(runs)})"
        lines.append(f"| {label} | {LABELS.get(backend, backend)} | {router or '-'} | {cells} | {overall} |")
    return "\n".join(lines)


def render_causes(results: Sequence[FaultResult]) -> str:
    """Every distinct failure cause the client saw, per fault and backend, with its count."""
    out: List[str] = []
    for r in results:
        if r.counts.causes:
            label = BY_NAME[r.fault].label if r.fault in BY_NAME else r.fault
            causes = "; ".join(f"{n} x `{text}`" for text, n in r.counts.causes.most_common())
            run = "".join([f", seed {r.seed}" if r.seed is not None else "", f", router {r.router}" if r.router else ""])
            out.append(f"- {label}, {LABELS.get(r.backend, r.backend)}{run}: {causes}")
    return "\n".join(out) or "- (no request failed)"


def to_json(results: Sequence[FaultResult]) -> str:
    def plain(r: FaultResult) -> Dict:
        d = dataclasses.asdict(r)
        d["counts"]["causes"] = dict(r.counts.causes)
        d["verdict"] = verdict(r)
        d["passed"] = passed(r)
        return d
    return json.dumps([plain(r) for r in results], indent=1, default=str)
