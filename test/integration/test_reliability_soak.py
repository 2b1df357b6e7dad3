"""The short soak: `scripts/bench_backend.py soak --quick` (300 requests, concurrency 64, 1 % injected
faults, 5 % aborts over softio) must pass: nothing corrupted, nothing hung, no request failed
without a cause, tables empty, RSS growth of both processes under 50 MB, no sockets piling up.
The full 10,000-request run and its figures are in docs/benchmarks.md ("Soak")."""

from __future__ import annotations

from harness import bench_soak


def test_quick_soak_passes():
    f = bench_soak.soak(bench_soak.QUICK_REQUESTS)
    report = bench_soak.format_figures(f)
    assert f["error"] is None, report
    assert f["aborts_injected"] == 15 and f["faults_injected"] >= 2, report
    # an abort that comes after its request already succeeded changes nothing (a race by design)
    assert 0.8 * f["aborts_injected"] <= f["failed_aborted"] <= f["aborts_injected"], report
    assert 0 < f["failed_faulted"] <= f["faults_injected"], report
    assert f["corrupted"] == 0 and f["verified"] and f["checked_bytes"] > 0, report
    assert f["hung"] == 0 and f["failed_unexpected"] == 0, report
    assert f["succeeded"] + f["failed_aborted"] + f["failed_faulted"] == f["requests"], report
    assert all(v < 50 for v in f["rss_growth_mb"].values()) and len(f["rss_growth_mb"]) == 2, report
    assert all(f["fds_after"][k] - f["fds_warm"][k] <= bench_soak.FD_SLACK for k in f["fds_after"]), report
    assert f["ok"], report
