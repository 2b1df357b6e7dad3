"""scripts/chaos_pd.py --seeds / --router-settings (issue 29): the seeds it runs, the router flags
each deployment gets, and a report that states the router's values and shows every seed."""

import importlib.util
import sys
from pathlib import Path

import pytest

from harness import launch, router_settings
from harness.chaos.runner import FaultResult
from harness.chaos.table import render, render_causes, render_seeds
from harness.chaos.verdict import Counts

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "chaos_pd.py"
spec = importlib.util.spec_from_file_location("chaos_pd", SCRIPT)
chaos_pd = importlib.util.module_from_spec(spec)
sys.modules["chaos_pd"] = chaos_pd
spec.loader.exec_module(chaos_pd)


def test_seeds_make_one_load_each_in_order_and_default_to_seed():
    args = chaos_pd.parse_args(["--seeds", "31, 7,20", "--num-prompts", "8"])
    assert [s.seed for s in args.specs] == [31, 7, 20]
    assert {s.num_prompts for s in args.specs} == {8} and args.spec is args.specs[0]
    assert [s.seed for s in chaos_pd.parse_args(["--seed", "5"]).specs] == [5]
    assert [s.seed for s in chaos_pd.parse_args([]).specs] == [20]


@pytest.mark.parametrize("bad", [["--seeds", "31,x"], ["--seeds", "7,7"], ["--router-settings", "fast"],
                                 ["--router-settings", ","]])
def test_bad_seeds_or_router_settings_are_refused_with_a_reason(bad, capsys):
    with pytest.raises(SystemExit) as exc:
        chaos_pd.parse_args(bad)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert ("--seeds" in err) or ("router settings" in err) or ("--router-settings" in err), err


def test_router_settings_default_to_launch_pd_and_reach_the_router_command_line():
    assert chaos_pd.parse_args([]).router_settings == ["launch_pd"]
    assert chaos_pd.parse_args(["--router-settings", "launch_pd,defaults"]).router_settings == ["launch_pd", "defaults"]
    flags = router_settings.router_flags("launch_pd")
    argv = launch.router_argv(8000, 30000, 8998, 31000, 8001, extra=flags)
    assert argv[-len(flags):] == flags
    assert flags[flags.index("--cb-timeout-duration-secs") + 1] == "1"
    assert router_settings.router_flags("defaults") == []
    assert "--cb-timeout-duration-secs" not in launch.router_argv(8000, 30000, 8998, 31000, 8001)


def test_the_report_states_every_router_value_the_run_used():
    launch_pd = router_settings.describe("launch_pd")
    defaults = router_settings.describe("defaults")
    assert "cb-timeout-duration-secs 1," in launch_pd and "health-check-interval-secs 2," in launch_pd
    # The router's own values, read from the installed router, not assumed.
    from sglang_router.router_args import RouterArgs
    assert f"cb-timeout-duration-secs {RouterArgs.cb_timeout_duration_secs}," in defaults
    assert f"retry-max-retries {RouterArgs.retry_max_retries}" in defaults

    args = chaos_pd.parse_args(["--seeds", "31,7", "--router-settings", "launch_pd,defaults"])
    text = chaos_pd.report(args, "now", [result(31, "launch_pd", 2.0), result(7, "launch_pd", None)])
    assert launch_pd in text and defaults in text
    assert "at seeds 31, 7" in text


def result(seed, router, recovered_s):
    c = Counts(requests=33, completed=1, failed=32)
    return FaultResult("mori", "decode_restart", c, recovered_s=recovered_s, seed=seed, router=router,
                       leftovers={"prefill": [], "decode": []})


def test_every_seed_has_its_row_and_the_seeds_stand_side_by_side():
    runs = [result(31, "launch_pd", 2.0), result(7, "launch_pd", 41.0), result(31, "defaults", 53.7)]
    table = render(runs)
    assert "| fault | backend | seed | router | completed" in table
    assert "| decode killed + restarted | ours | 31 | launch_pd | 1/33 |" in table
    assert "| decode killed + restarted | ours | 7 | launch_pd | 1/33 |" in table
    side = render_seeds(runs)
    assert ("| decode killed + restarted | ours | launch_pd | seed 31: 1/33, 0 hung, 2.0 s, pass; "
            "seed 7: 1/33, 0 hung, 41.0 s, FAIL | FAIL (1/2) |") in side
    assert "| decode killed + restarted | ours | defaults | seed 31: 1/33, 0 hung, 53.7 s, FAIL | FAIL (1/1) |" in side


def test_failure_causes_say_the_seed_and_router_of_their_run():
    a, b = result(31, "launch_pd", 2.0), result(7, "defaults", 50.0)
    a.counts.causes.update({"No available prefill workers": 32})
    b.counts.causes.update({"No available prefill workers": 32})
    assert render_causes([a, b]).splitlines() == [
        "- decode killed + restarted, ours, seed 31, router launch_pd: 32 x `No available prefill workers`",
        "- decode killed + restarted, ours, seed 7, router defaults: 32 x `No available prefill workers`"]
