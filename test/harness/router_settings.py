"""sglang_router's failure-handling settings: the ones scripts/launch_pd.sh starts the router with
("launch_pd", docs/deployment.md says why) and the router's own defaults ("defaults"), each as the
command-line flags the router gets and as the full set of values a report can state.

Why launch_pd's differ from the defaults (issue 29, sglang_router 0.3.2): in PD mode the router
records the final status of every attempt (up to 5 attempts per request) against the prefill worker
as well as the decode worker, so a decode that is down or a transfer that passes its deadline counts
as the prefill's failure. 10 consecutive failures open the prefill's breaker by default; with the
default 60 s before it half-opens (and a failure while half-open opening it for another 60 s), all
PD traffic is refused for a minute or more after the fault is over. launch_pd half-opens after 1 s,
tries a request at most 3 times (not 5: 5 attempts of a 12 s transfer deadline outlast a client
that waits a minute) and needs 20 consecutive failures: at seed 31 a 1 Mbit/s throttle made the 8 requests in flight
and their retries fail (16 attempts), which opened a 10-failure breaker 4.6 s after the fault's end
(docs/reliability.md, "Issue 29: why the seed-31 throttle opened the breaker"). A prefill that
really died is taken out by the health checks (every 2 s, 3 misses: about 6 s), not by the
breaker: a request sent to a dead prefill fails only once decode has given up on that prefill's
bootstrap server (SGLang 0.5.23 retries it for about 14 s), so its failures reach the breaker
slowly.
"""

from __future__ import annotations

from typing import Dict, List

# The flags scripts/launch_pd.sh passes (test/unit/test_router_settings.py keeps the two equal).
LAUNCH_PD: Dict[str, int] = {
    "cb-failure-threshold": 20,
    "cb-success-threshold": 2,
    "cb-timeout-duration-secs": 1,
    "health-check-interval-secs": 2,
    "health-check-timeout-secs": 5,
    "health-failure-threshold": 3,
    "health-success-threshold": 1,
    "retry-max-retries": 3,
}
SETTINGS = ("launch_pd", "defaults")


def router_defaults() -> Dict[str, object]:
    """The installed router's own defaults for the flags above."""
    from sglang_router.router_args import RouterArgs

    names = list(LAUNCH_PD)
    return {n: getattr(RouterArgs, n.replace("-", "_")) for n in names}


def router_flags(name: str) -> List[str]:
    """The command-line flags for settings `name` ("defaults": none, the router's own values)."""
    if name == "defaults":
        return []
    if name != "launch_pd":
        raise ValueError(f"unknown router settings {name!r}; one of {SETTINGS}")
    return [w for key, value in LAUNCH_PD.items() for w in (f"--{key}", str(value))]


def effective(name: str) -> Dict[str, object]:
    """Every value the router runs with under settings `name`: its defaults, overridden by the flags."""
    values = router_defaults()
    if name == "launch_pd":
        values.update(LAUNCH_PD)
    elif name != "defaults":
        raise ValueError(f"unknown router settings {name!r}; one of {SETTINGS}")
    return values


def describe(name: str) -> str:
    """One line for a report: which settings, the router's version, and every value."""
    try:
        from importlib.metadata import version
        router = f"sglang_router {version('sglang-router')}"
    except Exception:  # a report line is still worth printing without the version
        router = "sglang_router (version unknown)"
    values = ", ".join(f"{k} {v}" for k, v in effective(name).items())
    return f"router settings `{name}` ({router}): {values}"
