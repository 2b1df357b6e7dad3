"""plans.sh's s21_tpsg on this CPU: the MLA and prefill-TP-2 steps' command lines parse in the real rig
scripts, the steps run in order within their limits and budget, each JSON lands in $OUT, the TP 2 step
compares pd_tp with PD at TP 2 (a stored pd phase and this call's pd), and a refused child on either
rank fails the phase by name (fake servers: plan_shim/s20_shim.py)."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent / "plan_shim"))
import plan_runner  # noqa: E402
sys.path.insert(0, str(ROOT / "scripts" / "gpu_sglang"))
import pd_identity  # noqa: E402

PROMPTS = 4


def stored_reference(path: Path, phase: str) -> Path:
    """A stored pd_identity JSON whose `phase` gives the fake servers' outputs (what the shim answers)."""
    results = [{"output_ids": [len(p["input_ids"]) % 97], "error": None} for p in pd_identity.prompts(PROMPTS, 8192)]
    path.write_text(json.dumps({"phases": {phase: {"c1": {"results": results}, "c16": {"results": results}}}}))
    return path


def run_plan(tmp_path, tproc, budget=460, steps="mla tp2 load", extra=""):
    mla_ref = stored_reference(tmp_path / "mla_ref.json", "standalone")
    tp2_ref = stored_reference(tmp_path / "tp2_ref.json", "pd")
    return plan_runner.run_plan(tmp_path, tproc, f'S21_BUDGET_S={budget}; S21_PROMPTS={PROMPTS}; S21_MLA_REF={mla_ref}; '
                                f'S21_TP2_REF={tp2_ref}; S21_STEPS="{steps}"; S21_REQ_PER_CONC=1; {extra}', "s21_tpsg")


def scripts_of(calls):
    return [c.split()[0].rsplit("/", 1)[1] for c in calls]


def test_s21_plan_runs_mla_then_tp2_then_load_and_passes_serving_children(tmp_path):
    done, w, out, calls = run_plan(tmp_path, "serving", extra="S21_MLA_PHASES=pd_tp,pd S21_TP2_PHASES=pd_tp,pd;")
    summary = (w / "s21.out").read_text()
    assert scripts_of(calls) == ["pd_identity.py", "pd_identity.py", "pd_latency.py"], done.stderr
    mla, tp2, load = calls
    assert "--model /tmp/gpu-mla --out" in mla and "--gpus 2 --gpu-base 0 --phases pd_tp,pd" in mla and "--kv-hash" in mla
    assert "--prefill-tp 2 --decode-gpu 0" in tp2 and "--reference-phase pd --compare-phase pd" in tp2
    assert "--configs pd_off_tproc,pd_off --gpus 2" in load and "--concurrency 16" in load and "--repeats 2" in load
    for step in ("mla: rc 0", "tp2: rc 0", "load: rc 0"):
        assert step in summary, summary + done.stderr
    m = json.loads((out / "identity_mla_tproc.json").read_text())["phases"]
    assert "failed" not in m["pd_tp"] and m["pd_tp"]["c16"]["vs_standalone"]["identical"] == PROMPTS
    assert m["pd_tp"]["c1"]["vs_pd"]["identical"] == PROMPTS
    t = json.loads((out / "identity_tp2_tproc.json").read_text())
    assert t["reference_phase"] == "pd" and t["phases"]["pd_tp"]["transfer_process"]["accepted_pids"] == [7, 8]
    assert "failed" not in t["phases"]["pd_tp"] and t["phases"]["pd_tp"]["c1"]["vs_pd"]["identical"] == PROMPTS
    lat = json.loads((out / "load_tproc.json").read_text())["configs"]
    assert lat["pd_off_tproc"]["transfer_process"]["ok"] and "1024tok_c16" in lat["pd_off_tproc"]
    assert "transfer process pid 8: start-up used 5 ms of CPU" in summary  # the TP 2 step's second child
    assert f"[pd_tp] c1: digest" in summary and f"identical {PROMPTS}/{PROMPTS} vs pd" in summary
    assert "tp2/pd_tp-prefill.log:" in summary


def test_s21_plan_fails_tp2_by_name_when_rank_1_was_refused(tmp_path):
    _, w, out, _ = run_plan(tmp_path, "refused_tp1", steps="tp2")
    failed = json.loads((out / "identity_tp2_tproc.json").read_text())["phases"]["pd_tp"]["failed"]
    assert failed == "transfer process refused (transfers stayed in-process): prefill tp1: injected"
    assert f"[pd_tp] transfer process: {failed}" in (w / "s21.out").read_text()


@pytest.mark.parametrize("budget, ran, skipped", [
    (140, ["pd_identity.py", "pd_latency.py"], ["tp2"]),  # tp2 needs 150 s
    (80, [], ["mla", "tp2", "load"]),
])
def test_s21_plan_skips_by_name_the_steps_the_budget_cannot_hold(tmp_path, budget, ran, skipped):
    _, w, _, calls = run_plan(tmp_path, "serving", budget=budget)
    assert scripts_of(calls) == ran
    summary = (w / "s21.out").read_text()
    assert [line.split(":")[0] for line in summary.splitlines() if "skipped at" in line] == skipped


def test_s21_plan_by_default_runs_pd_tp_alone_against_the_stored_references(tmp_path):
    """The in-call pd phases did not fit one call beside the rest (session 21): by default pd_tp alone."""
    done, w, out, calls = run_plan(tmp_path, "serving")
    mla, tp2, _ = calls
    assert "--phases pd_tp --reference" in mla and "--phases pd_tp --reference" in tp2
    t = json.loads((out / "identity_tp2_tproc.json").read_text())["phases"]
    assert t["pd_tp"]["c16"]["vs_standalone"]["identical"] == PROMPTS and "vs_pd" not in t["pd_tp"]["c16"]
