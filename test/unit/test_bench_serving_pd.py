"""scripts/bench_serving_pd.py: reading sglang.benchmark.serving's result JSON into the table, and the
client command line as SGLang 0.5.23's own argument parser reads it."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "bench_serving_pd.py"
spec = importlib.util.spec_from_file_location("bench_serving_pd", SCRIPT)
bs = importlib.util.module_from_spec(spec)
sys.modules["bench_serving_pd"] = bs  # dataclasses look the module up by name
spec.loader.exec_module(bs)


def client_result(**overrides):
    """A result line shaped like the one sglang.benchmark.serving appends (a subset of its keys)."""
    result = {
        "backend": "sglang", "dataset_name": "random-ids", "duration": 12.5, "completed": 64,
        "total_output_tokens": 4096, "request_throughput": 5.12, "output_throughput": 327.68,
        "mean_ttft_ms": 200.0, "median_ttft_ms": 180.0, "p99_ttft_ms": 900.0,
        "mean_itl_ms": 25.0, "p99_itl_ms": 80.0, "errors": [""] * 64,
    }
    result.update(overrides)
    return result


def test_read_result_takes_the_last_line(tmp_path):
    out = tmp_path / "r.jsonl"
    out.write_text(json.dumps(client_result(completed=1)) + "\n" + json.dumps(client_result(completed=2)) + "\n\n")
    assert bs.read_result(out)["completed"] == 2
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError):
        bs.read_result(tmp_path / "empty.jsonl")


def test_row_from_result_maps_the_client_keys():
    row = bs.row_from_result("mori", 64, client_result(completed=63))
    assert (row.completed, row.mean_ttft_ms, row.p99_ttft_ms, row.mean_itl_ms, row.output_tok_s,
            row.duration_s, row.error) == (63, 200.0, 900.0, 25.0, 327.68, 12.5, "")


def test_row_from_result_reports_missing_figures():
    # The client leaves ITL as None when no request streamed two tokens (e.g. all failed).
    row = bs.row_from_result("mooncake_tcp", 64, client_result(completed=0, mean_itl_ms=None))
    assert row.completed == 0 and "mean_itl_ms" in row.error


def test_ratio_edge_cases():
    assert bs.ratio(3.0, 2.0) == "1.50x"
    assert bs.ratio(None, 2.0) == "-" and bs.ratio(1.0, None) == "-"
    assert bs.ratio(1.0, 0.0) == "-" and bs.ratio(float("nan"), 1.0) == "-"


def test_table_ratios_are_against_ours():
    ours = bs.row_from_result("mori", 64, client_result())
    builtin = bs.row_from_result("mori_builtin", 64, client_result(mean_ttft_ms=300.0, p99_ttft_ms=450.0,
                                                                   mean_itl_ms=50.0, output_throughput=163.84))
    failed = bs.Row("mooncake_tcp", 64, error="failed: router not ready")
    lines = bs.render_table([builtin, ours, failed]).splitlines()
    assert len(lines) == 5
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    assert cells[:6] == [bs.LABELS["mori_builtin"], "64/64", "300.0", "450.0", "50.00", "163.8"]
    assert cells[6:10] == ["1.50x", "0.50x", "2.00x", "0.50x"]
    ours_cells = [c.strip() for c in lines[3].strip("|").split("|")]
    assert ours_cells[6:10] == ["1.00x"] * 4
    assert "failed: router not ready" in lines[4] and bs.LABELS["mooncake_tcp"] in lines[4]


def test_table_without_ours_has_no_ratios():
    other = bs.row_from_result("mooncake_tcp", 8, client_result(completed=8))
    cells = [c.strip() for c in bs.render_table([other]).splitlines()[2].strip("|").split("|")]
    assert cells[1] == "8/8" and cells[6:10] == ["-"] * 4


def test_parse_args_bounds():
    args = bs.parse_args(["--backends", "mori,mooncake_tcp", "--num-prompts", "16"])
    assert args.backends == ["mori", "mooncake_tcp"] and args.num_prompts == 16
    with pytest.raises(SystemExit):
        bs.parse_args(["--backends", "nixl"])
    with pytest.raises(SystemExit):
        bs.parse_args(["--num-prompts", "0"])


def test_client_argv_as_sglang_reads_it(tmp_path, monkeypatch):
    """SGLang's own parser accepts our command line and reads the workload we mean (skipped where
    the bench requirements, which bring `datasets`, are not installed)."""
    pytest.importorskip("datasets")
    serving = pytest.importorskip("sglang.benchmark.serving")
    argv = bs.client_argv("python", "http://127.0.0.1:31000", tmp_path / "model", tmp_path / "out.jsonl",
                          num_prompts=64, input_len=256, output_len=32, max_concurrency=8,
                          request_rate=float("inf"), seed=1, warmup_requests=2)
    assert argv[:3] == ["python", "-m", "sglang.benchmark.serving"]
    seen = {}
    monkeypatch.setattr(serving, "run_benchmark", lambda a: seen.setdefault("args", a))
    monkeypatch.setattr(sys, "argv", ["bench_serving", *argv[3:]])
    serving.cli_main()
    a = seen["args"]
    assert a.backend == "sglang" and a.pd_separated and a.dataset_name == "random-ids"
    assert a.tokenize_prompt and a.random_range_ratio == 1.0
    assert (a.num_prompts, a.random_input_len, a.random_output_len, a.max_concurrency) == (64, 256, 32, 8)
    assert a.request_rate == float("inf") and a.warmup_requests == 2
    assert a.model == a.tokenizer == str(tmp_path / "model")
    assert a.base_url == "http://127.0.0.1:31000" and a.output_file == str(tmp_path / "out.jsonl")
    assert not a.disable_ignore_eos and not a.disable_stream and a.temperature == 0.0
