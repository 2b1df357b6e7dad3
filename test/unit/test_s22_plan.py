"""plans.sh's s22_meter on this CPU: one pd_latency.py --call-meter per config in order, 1K and 8K at c1
and c16, twice, after full-batch warm-ups, each within its limit and the budget; each JSON lands in $OUT
with the meter's per-request figures for prefill and decode; meter_summary.py's table reads them; a
refused child fails the tproc config by name (fake servers: plan_shim/s20_shim.py)."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent / "plan_shim"))
import plan_runner  # noqa: E402
sys.path.insert(0, str(ROOT / "scripts" / "gpu_sglang"))
import meter_summary  # noqa: E402


def run_plan(tmp_path, tproc, budget=450, extra=""):
    return plan_runner.run_plan(tmp_path, tproc, f"S22_BUDGET_S={budget}; S22_REQ_PER_CONC=1; S22_REQ_C1=2; {extra}",
                                "s22_meter")


def test_s22_plan_meters_both_configs_at_1k_and_8k_twice(tmp_path):
    done, w, out, calls = run_plan(tmp_path, "serving")
    lat = [c for c in calls if "pd_latency.py" in c]
    assert len(lat) == 2, done.stderr
    for call, config in zip(lat, ("pd_off_tproc", "pd_off")):
        assert f"--configs {config} --gpus 2 --gpu-base 0 --lengths 1024,8192 --concurrency 1,16" in call
        assert "--repeats 2 --full-warmup --call-meter" in call and f"--tag meter_{config}" in call
    summary = (w / "s22.out").read_text()
    assert "pd_off_tproc: rc 0" in summary and "pd_off: rc 0" in summary, summary + done.stderr
    for config in ("pd_off_tproc", "pd_off"):
        res = json.loads((out / f"meter_{config}.json").read_text())["configs"][config]
        for key in ("1024tok_c1", "1024tok_c16", "8192tok_c16", "8192tok_c16_repeat1"):
            meter = res[key]["call_meter"]
            assert meter["prefill"]["total_us"] == 120.0 and meter["decode"]["total_us"] == 80.0, (key, meter)
            assert meter["prefill"]["requests"] == res[key]["requests"]
    assert json.loads((out / "meter_pd_off_tproc.json").read_text())["configs"]["pd_off_tproc"]["transfer_process"]["ok"]
    # the summary table: both configs, every shape, both sides against their goals
    assert "pd_off_tproc  8192tok_c16_repeat1" in summary
    assert "120.0 = 100.0 + 20.0 (ok)" in summary and "80.0 = 50.0 + 30.0 (ok)" in summary
    assert "transfer process pid 7: start-up used 5 ms of CPU" in summary
    # the table ends the file: run_plan prints each .out's last 25 lines, the end of a call's output
    last = summary.splitlines()[-25:]
    assert last[-1].startswith("us/req: total") and last[-18].startswith("config") and "8192tok_c16_repeat1" in last[-2]


def test_s22_plan_fails_the_tproc_config_by_name_when_the_child_was_refused(tmp_path):
    _, w, out, _ = run_plan(tmp_path, "refused", extra="S22_CONFIGS=pd_off_tproc;")
    failed = json.loads((out / "meter_pd_off_tproc.json").read_text())["configs"]["pd_off_tproc"]["failed"]
    assert failed.startswith("transfer process refused (transfers stayed in-process)")
    summary = (w / "s22.out").read_text()
    assert "pd_off_tproc FAILED: transfer process refused" in summary


def test_s22_plan_bounds_each_config_by_the_budget_left_and_skips_by_name(tmp_path):
    _, w, _, calls = run_plan(tmp_path, "serving", budget=200)
    summary = (w / "s22.out").read_text()
    assert "pd_off_tproc: rc 0" in summary and "(limit 200 s)" in summary  # min(220, budget left)
    _, w2, _, calls2 = run_plan(tmp_path / "b", "serving", budget=140)  # under S22_MIN_S (150 s)
    assert not [c for c in calls2 if "pd_latency.py" in c]
    skipped = [line.split(":")[0] for line in (w2 / "s22.out").read_text().splitlines() if "skipped at" in line]
    assert skipped == ["pd_off_tproc", "pd_off"]


def test_s22_plan_measures_another_model_folder_with_its_vocabulary(tmp_path):
    model = tmp_path / "mla"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps({"model_type": "deepseek_v2", "vocab_size": 8192}))
    _, w, out, calls = run_plan(tmp_path, "serving", extra=f"S22_MODEL={model}; S22_CONFIGS=pd_off;")
    (call,) = [c for c in calls if "pd_latency.py" in c]
    assert f"--model-dir {model}" in call
    assert json.loads((out / "meter_pd_off.json").read_text())["model"]["model_type"] == "deepseek_v2"


def test_meter_summary_marks_each_side_against_its_goal():
    report = {"configs": {"pd_off": {"1024tok_c16": {
        "ttft_ms_p50": 41.8, "ttft_ms_p90": 107.7, "itl_ms_p50": 3.01, "output_tok_s": 3567.0, "ok": 64, "requests": 64,
        "call_meter": {"prefill": {"requests": 64, "processes": 1, "total_us": 180.0, "scheduler_calls_us": 120.0,
                                   "our_threads_us": 60.0, "engine_threads_us": 5.0,
                                   "calls_us": {"MoriKVSender.send": 80.0}, "threads_us": {"mori-completion": 60.0}},
                       "decode": {"requests": 64, "processes": 1, "total_us": 90.0, "scheduler_calls_us": 90.0,
                                  "our_threads_us": 0.0, "engine_threads_us": 0.0, "calls_us": {}, "threads_us": {}}}}}}}
    (row,) = meter_summary.rows(report)
    assert row == ["pd_off", "1024tok_c16", "41.8", "107.7", "3.01", "3567.0", "64/64",
                   "180.0 = 120.0 + 60.0 (OVER)", "90.0 = 90.0 + 0.0 (ok)"]
    (detail, _) = meter_summary.top_calls(report)
    assert detail.startswith("pd_off 1024tok_c16 prefill: calls MoriKVSender.send 80.0; ours inside them -; threads mori-completion 60.0")


def test_the_prompts_stay_inside_the_models_vocabulary():
    import pd_latency

    ids = [t for p in pd_latency.workload(64, 4, seed=1, vocab=20) for t in p["input_ids"]]
    assert len(ids) == 256 and set(ids) <= set(range(10, 20)) and len(set(ids)) > 5


def test_an_interrupted_config_keeps_its_measurements_and_stops_the_list(tmp_path, monkeypatch, capsys):
    """The plan's `timeout -s INT`: the JSON keeps what was measured, the config says why it ended."""
    import pd_latency

    sent = []

    def send(body):
        sent.append(1)
        if len(sent) == 5:  # warm-up 2, the first measurement 2, then the time limit
            raise KeyboardInterrupt
        return {"ttft_s": 0.01, "itl_s": [0.001], "tokens": 2, "e2e_s": 0.02, "sent_at": 0, "first_at": 0.01}

    class Srv:
        name, ready_s, url = "s", 1.0, "u"

        def __init__(self, *a):
            pass

        def start(self):
            return self

        def wait_ready(self, t):
            pass

        def stop(self):
            pass

    monkeypatch.setattr(pd_latency, "Server", Srv)
    monkeypatch.setattr(pd_latency, "generate_stream", lambda url, body: send(body))
    monkeypatch.setattr(pd_latency, "compiled_files", lambda: 0)
    monkeypatch.setattr(sys, "argv", ["pd_latency.py", "--out", str(tmp_path), "--configs", "standalone,standalone2",
                                      "--lengths", "16", "--concurrency", "1", "--requests-c1", "2", "--repeats", "2",
                                      "--tag", "t"])
    try:
        pd_latency.main()
    except KeyboardInterrupt:
        pytest.fail("the interrupt left pd_latency.main() without writing what was measured")
    report = json.loads((tmp_path / "t.json").read_text())["configs"]
    assert list(report) == ["standalone"]  # the list stopped at the interrupt
    res = report["standalone"]
    assert res["interrupted"] and res["failed"].startswith("interrupted (time limit)")
    assert res["16tok_c1"]["ok"] == 2 and "16tok_c1_repeat1" not in res
