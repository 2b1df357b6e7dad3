"""The router's failure-handling flags (issue 29): scripts/launch_pd.sh starts the router with the
same ones the harness runs as `launch_pd` (harness/router_settings.py), the router accepts them, and
--router-args overrides them."""

from test_launch_pd import plan

from harness import router_settings


def values_of(argv):
    """flag -> value of every router flag the harness's settings name (the last one wins, as in argparse)."""
    out = {}
    for i, word in enumerate(argv[:-1]):
        if word.startswith("--") and word[2:] in router_settings.LAUNCH_PD:
            out[word[2:]] = int(argv[i + 1])
    return out


def test_launch_pd_starts_the_router_with_the_harness_settings():
    argv = plan("--model-path", "/models/m", "--prefill-gpus", "0", "--decode-gpus", "1")["router"][2]
    assert values_of(argv) == router_settings.LAUNCH_PD
    rargv = plan("--role", "router", "--prefill-addr", "10.0.0.1:30000@8998", "--decode-addr", "10.0.0.2:30000")
    assert values_of(rargv["router"][2]) == router_settings.LAUNCH_PD


def test_router_args_override_the_failure_handling_flags():
    argv = plan("--model-path", "/models/m", "--prefill-gpus", "0", "--decode-gpus", "1",
                "--router-args", "--cb-timeout-duration-secs 30")["router"][2]
    assert values_of(argv)["cb-timeout-duration-secs"] == 30


def test_the_installed_router_parses_them_as_given():
    import argparse

    from sglang_router.router_args import RouterArgs

    parser = argparse.ArgumentParser()
    RouterArgs.add_cli_args(parser)
    ns = parser.parse_args(["--pd-disaggregation", *router_settings.router_flags("launch_pd")])
    args = RouterArgs.from_cli_args(ns)
    assert {k: getattr(args, k.replace("-", "_")) for k in router_settings.LAUNCH_PD} == router_settings.LAUNCH_PD
