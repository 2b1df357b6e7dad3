"""One fault under load on a running NetnsPD deployment, and what it left: a FaultResult.

    load starts -> transfers in flight -> fault injected (blocks for its length) -> fault over
    -> probes until a request through the router is served again -> load ends (bounded)
    -> servers drained (bounded) -> leftovers compared with the post-warm-up snapshot
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from harness import client
from harness.chaos import leftovers as lo
from harness.chaos.deployment import NetnsPD
from harness.chaos.faults import Fault, FaultContext
from harness.chaos.hosts import ADDRS, Topology
from harness.chaos.load import LoadSpec, start_client, wait_client
from harness.chaos.recovery import Outcome, serving_again_after
from harness.chaos.verdict import Counts, Key, Reference, answers, classify, read_records, replay_references

PROBE_PROMPT = "The network came back and the next request"
PROBE_TOKENS = 4


@dataclass
class RunSettings:
    model_dir: Path
    load: LoadSpec
    deadline_s: float  # transfer deadline the servers run with
    margin_s: float  # a request answered later than deadline + margin counts as hung
    client_cap_s: float = 420.0  # the whole client run, after which it is stopped
    inject_within_s: float = 90.0  # the fault goes in once transfers are in flight, or by then
    recovery_limit_s: float = 120.0  # probing stops here ("not recovered")
    # After the first served probe, probing goes on this long: a breaker that opens a few seconds
    # after the fault (failures counted as they come back) must show in "serving again after".
    recovery_watch_s: float = 15.0
    drain_s: float = 60.0  # servers must hold no request after the load, within this
    bounds: lo.Bounds = field(default_factory=lo.Bounds)

    @property
    def hang_bound_s(self) -> float:
        return self.deadline_s + self.margin_s


@dataclass
class FaultResult:
    backend: str
    fault: str
    counts: Counts
    fault_s: float = 0.0  # how long the fault lasted (restarts: kill until ready again)
    fault_window: tuple = ()  # (start, end) of the fault, CLOCK_MONOTONIC as in the records
    inject_note: str = ""
    recovered_s: Optional[float] = None  # fault end -> first served request after the last refused one (recovery.py)
    other_restarts: List[str] = field(default_factory=list)
    leftovers: Dict[str, List[str]] = field(default_factory=dict)
    snapshots: Dict[str, lo.Snapshot] = field(default_factory=dict)
    client_exit: Optional[int] = None
    seed: Optional[int] = None  # the load's seed, when a run covers several
    router: str = ""  # the router settings it ran with (harness.router_settings), when stated

    def goal_failures(self, recovery_goal_s: float) -> List[str]:
        out = []
        if self.counts.hung:
            out.append(f"{self.counts.hung} hung")
        if self.counts.mismatch:
            out.append(f"{self.counts.mismatch} token mismatches")
        if self.counts.unnamed:
            out.append(f"{self.counts.unnamed} failures without a cause")
        if self.recovered_s is None or self.recovered_s > recovery_goal_s:
            out.append("not serving again in time" if self.recovered_s is None
                       else f"serving again after {self.recovered_s:.1f} s > {recovery_goal_s:.0f} s")
        if self.other_restarts:
            out.append(f"unplanned restart of {', '.join(self.other_restarts)}")
        for role, problems in self.leftovers.items():
            if problems:
                out.append(f"{role} leftovers: {'; '.join(problems)}")
        return out


def transfers_in_flight(dep: NetnsPD) -> bool:
    """Whether KV is moving now: a request in prefill's in-flight queue or decode's transfer queue."""
    try:
        p = client.get_json(f"{dep.prefill_url}/v1/loads?include=disagg", 2.0)["loads"][0]
        d = client.get_json(f"{dep.decode_url}/v1/loads?include=disagg", 2.0)["loads"][0]
    except Exception:
        return False
    return ((p.get("disaggregation") or {}).get("prefill_inflight_queue_reqs", 0)
            + (d.get("disaggregation") or {}).get("decode_transfer_queue_reqs", 0)) > 0


def _answered(records: Path) -> bool:
    """Whether the client has had an answer (its warm-up request came back)."""
    try:
        return '"event": "end"' in records.read_text()
    except FileNotFoundError:
        return False


def probe_ok(dep: NetnsPD, expected_ids: List[int], timeout_s: float = 30.0) -> bool:
    gen = client.generate(dep.router_url, PROBE_PROMPT, PROBE_TOKENS, timeout_s=timeout_s)
    return gen.ok and gen.output_ids == expected_ids


def _probe_recovery(dep: NetnsPD, expected_ids: List[int], fault_end: float, limit_s: float,
                    watch_s: float) -> List[Outcome]:
    """(send time, served right) of each probe from the fault's end: until one is served right,
    within `limit_s`, then for `watch_s` more (a late breaker opening refuses them)."""
    outcomes: List[Outcome] = []
    first_ok: Optional[float] = None
    while True:
        now = time.monotonic()
        if first_ok is None and now - fault_end >= limit_s:
            return outcomes
        if first_ok is not None and now - first_ok >= watch_s:
            return outcomes
        timeout_s = max(1.0, limit_s - (now - fault_end)) if first_ok is None else watch_s
        ok = probe_ok(dep, expected_ids, timeout_s=timeout_s)
        outcomes.append((now, ok))
        if ok and first_ok is None:
            first_ok = now
        time.sleep(0.5)  # the next probe: a bounded count over a bounded time


def _load_outcomes(reqs, refs) -> List[Outcome]:
    return [(r.start, r.success and r.text in answers(refs.get(r.key))) for r in reqs]


def snapshots(dep: NetnsPD, topo: Topology) -> Dict[str, lo.Snapshot]:
    ours = dep.backend == "mori"
    return {
        "prefill": lo.snapshot("prefill", dep.prefill_url, dep.pid("prefill"), topo.hosts["prefill"], ADDRS["decode"], ours),
        "decode": lo.snapshot("decode", dep.decode_url, dep.pid("decode"), topo.hosts["decode"], ADDRS["prefill"], ours),
    }


def drain(dep: NetnsPD, topo: Topology, limit_s: float) -> Dict[str, lo.Snapshot]:
    """Snapshots once neither server holds a request or backend state, or the last ones at the
    limit (failed rooms may take a deadline or two to be released)."""
    end = time.monotonic() + limit_s
    while True:
        snaps = snapshots(dep, topo)
        if all(s.idle() for s in snaps.values()) or time.monotonic() > end:
            return snaps
        time.sleep(1.0)  # poll interval of a bounded wait


def run_fault(dep: NetnsPD, topo: Topology, fault: Fault, settings: RunSettings, refs: Dict[Key, Reference],
              probe_ids: List[int], baseline: Dict[str, lo.Snapshot], work: Path,
              replay_reference: bool = False) -> FaultResult:
    """`refs` maps prompts to their reference texts (verdict.Reference); with `replay_reference` it
    is filled after the load from the deployment itself (verdict.replay_references), for runs
    without a standalone."""
    records = work / f"{dep.backend}-{fault.name}.jsonl"
    pids = {role: dep.pid(role) for role in ("prefill", "decode", "router")}
    proc = start_client(settings.load, dep.router_url, settings.model_dir, records,
                        settings.hang_bound_s + 5.0, work / f"{dep.backend}-{fault.name}.client.log", pd=True,
                        prefix=topo.hosts["router"].prefix())
    result = FaultResult(dep.backend, fault.name, Counts(), seed=settings.load.seed)
    try:
        started = time.monotonic()
        # After the client's warm-up request (a failed warm-up ends bench_serving's whole run),
        # while KV moves.
        while not (_answered(records) and transfers_in_flight(dep)):
            if time.monotonic() - started > settings.inject_within_s:
                result.inject_note = "no transfer seen in flight; injected anyway"
                break
            time.sleep(0.1)  # poll interval
        t0 = time.monotonic()
        fault.inject(FaultContext(dep, topo, settings.deadline_s))
        fault_end = time.monotonic()
        result.fault_s = fault_end - t0
        result.fault_window = (t0, fault_end)
        probed = _probe_recovery(dep, probe_ids, fault_end, settings.recovery_limit_s,
                                 settings.recovery_watch_s)
        result.client_exit = wait_client(proc, max(10.0, settings.client_cap_s - (time.monotonic() - started)))
    finally:
        proc.stop(grace_s=2.0)
    until = time.monotonic()
    reqs = read_records(records)
    if replay_reference:
        refs.update(replay_references(dep.router_url, reqs, settings.load.max_concurrency))
    result.counts = classify(reqs, refs, settings.hang_bound_s, until)
    result.recovered_s = serving_again_after(probed + _load_outcomes(reqs, refs), fault_end)
    result.other_restarts = [role for role, pid in pids.items()
                             if role != fault.restarts and (dep.pid(role) != pid or not dep.procs[role].alive())]
    result.snapshots = drain(dep, topo, settings.drain_s)
    result.leftovers = {role: lo.leftover_problems(snap, baseline[role], settings.bounds)
                        for role, snap in result.snapshots.items()}
    return result
