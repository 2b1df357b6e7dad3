"""`scripts/bench_backend.py transfer` output: the table's ratios and the --json object scripts read."""

import json

from harness import bench_transfer


def row(backend, req_s, p50, cpu, path="intra-host", ok=8):
    return {"backend": backend, "ok": ok, "requests": 8, "req_s": req_s, "p50_ms": p50, "p99_ms": p50 * 2,
            "gb_s": 1.0, "ops_per_chunk": 1, "byte_exact": True, "cpu_s_per_request": cpu, "engine_path": path,
            "error": None}


def test_json_has_one_object_per_backend_with_the_documented_fields():
    out = json.loads(bench_transfer.as_json([row("ours", 200.0, 10.0, 0.002), row("mooncake-tcp", 50.0, 40.0, 0.01,
                                                                                 "mooncake-tcp")]))
    assert set(out) == {"ours", "mooncake-tcp"}
    assert out["ours"] == {"requests": 8, "ok": 8, "requests_per_s": 200.0, "p50_ms": 10.0, "p99_ms": 20.0,
                           "cpu_s_per_request": 0.002, "engine_path": "intra-host", "byte_exact": True, "error": None,
                           "thread_cpu_ms_per_request": None}


def test_table_states_ratios_against_each_baseline():
    text = bench_transfer.format_table([row("ours", 200.0, 10.0, 0.002), row("sglang-mori-builtin", 100.0, 30.0, 0.004)])
    assert "ours / sglang-mori-builtin: 2.00x requests/s, 3.00x lower p50, 0.50x the CPU per request" in text
    assert "intra-host" in text


def test_thread_cpu_table_lists_each_side_by_role_heaviest_first():
    r = row("ours", 200.0, 10.0, 0.002)
    r["thread_cpu_ms_per_request"] = {"decode": {"softio-target-N": 6.0, "MainThread": 0.5}}
    text = bench_transfer.format_thread_cpu([r])
    assert text.splitlines() == ["ours decode: 6.50 ms/req by thread", "       6.00  softio-target-N",
                                 "       0.50  MainThread"]
