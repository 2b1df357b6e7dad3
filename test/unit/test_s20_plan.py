"""plans.sh's s20_tpsg on this CPU: every step's command line parses in the real rig scripts, the
steps run in order within their limits, each JSON lands in $OUT, a transfer process that served
passes and a refused one fails its phase and config by name (fake servers: plan_shim/s20_shim.py)."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent / "plan_shim"))
import plan_runner  # noqa: E402


def run_plan(tmp_path, tproc, budget=420, extra=""):
    return plan_runner.run_plan(tmp_path, tproc, f"S20_BUDGET_S={budget}; S20_PROMPTS=4; S20_REQ=2; {extra}", "s20_tpsg")


def test_s20_plan_runs_every_step_and_passes_a_serving_transfer_process(tmp_path):
    done, w, out, calls = run_plan(tmp_path, "serving")
    summary = (w / "s20.out").read_text()
    assert [c.split()[0].rsplit("/", 1)[1] for c in calls] == ["pd_identity.py", "pd_latency.py", "pd_identity.py"]
    assert "--gpus 1" in calls[0] and "--phases pd_tp,standalone" in calls[0] and "--kv-hash" in calls[0]
    assert "--phases pd --reference" in calls[2]
    assert "--configs pd_off_tproc,pd_off" in calls[1] and "--lengths 1024,8192 --concurrency 1" in calls[1]
    for step in ("identity_tp: rc 0", "latency_tp: rc 0", "identity_pd: rc 0"):
        assert step in summary, summary + done.stderr
    ident = json.loads((out / "identity_tp_1gpu.json").read_text())
    assert "failed" not in ident["phases"]["pd_tp"]
    assert ident["phases"]["pd_tp"]["c16"]["vs_standalone"]["identical"] == 4
    lat = json.loads((out / "latency_tp_1gpu.json").read_text())["configs"]
    assert lat["pd_off_tproc"]["transfer_process"]["ok"] and "1024tok_c1" in lat["pd_off_tproc"]
    assert "transfer_process" not in lat["pd_off"]
    pd = json.loads((out / "identity_pd_1gpu.json").read_text())
    assert pd["phases"]["pd"]["c1"]["vs_standalone"]["identical"] == 4  # against step 1's standalone
    assert "pd_tp-prefill.log:" in summary and "first room reached Success" in summary


def test_s20_plan_fails_a_refused_transfer_process_by_name(tmp_path):
    _, w, out, _ = run_plan(tmp_path, "refused")
    failed = "transfer process refused (transfers stayed in-process): prefill tp0: injected"
    assert json.loads((out / "identity_tp_1gpu.json").read_text())["phases"]["pd_tp"]["failed"] == failed
    assert json.loads((out / "latency_tp_1gpu.json").read_text())["configs"]["pd_off_tproc"]["failed"] == failed
    assert f"[pd_tp] transfer process: {failed}" in (w / "s20.out").read_text()


@pytest.mark.parametrize("budget, ran, skipped", [
    (130, ["pd_latency.py", "pd_identity.py"], ["identity_tp"]),  # step 1 needs 150 s
    (90, [], ["identity_tp", "latency_tp", "identity_pd"]),
])
def test_s20_plan_skips_by_name_the_steps_the_budget_cannot_hold(tmp_path, budget, ran, skipped):
    _, w, _, calls = run_plan(tmp_path, "serving", budget=budget)
    assert [c.split()[0].rsplit("/", 1)[1] for c in calls] == ran
    summary = (w / "s20.out").read_text()
    assert [line.split(":")[0] for line in summary.splitlines() if "skipped at" in line] == skipped
    if "identity_pd" not in skipped:  # no standalone from step 1: step 3 runs its own first
        assert "--phases standalone,pd" in calls[-1] and "--reference" not in calls[-1]


def test_s20_plan_against_a_stored_reference_runs_no_standalone(tmp_path):
    """The short call: S20_REF (a stored pd_identity JSON) is step 1's and step 3's reference, and
    S20_STEPS / S20_MAXTOK choose the steps and the latency servers' pool size."""
    sys.path.insert(0, str(ROOT / "scripts" / "gpu_sglang"))
    import pd_identity

    items = pd_identity.prompts(4, 8192)
    results = [{"output_ids": [len(p["input_ids"]) % 97], "error": None} for p in items]
    ref = tmp_path / "ref.json"
    ref.write_text(json.dumps({"phases": {"standalone": {"c1": {"results": results}, "c16": {"results": results}}}}))
    _, w, out, calls = run_plan(tmp_path, "serving",
                                extra=f"S20_REF={ref} S20_STEPS='identity_tp latency_tp' S20_MAXTOK=131072;")
    assert [c.split()[0].rsplit("/", 1)[1] for c in calls] == ["pd_identity.py", "pd_latency.py"]
    assert "--phases pd_tp --reference" in calls[0]
    assert "--max-total-tokens 131072" in calls[1]
    ident = json.loads((out / "identity_tp_1gpu.json").read_text())
    assert ident["phases"]["pd_tp"]["c1"]["vs_standalone"]["identical"] == 4
    assert "failed" not in ident["phases"]["pd_tp"]
