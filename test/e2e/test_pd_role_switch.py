"""Runtime role switch (SGLang's `POST /pd_role_switch`, `--enable-pd-role-switch`): the decode server
becomes a prefill server and then a decode server again, in the same process. Each switch tears our
manager down (threads, sockets, registrations, the engine) and builds the other role's; SGLang
refuses the switch for a backend that does not declare `supports_role_switch`.

Afterwards the deployment serves through the router, token-identical to the standalone server:
the rebuilt decode manager fetched the prefill's topology again and registered a new engine.
"""

from __future__ import annotations

import time

import pytest
import requests

from harness import client

pytestmark = [pytest.mark.e2e, pytest.mark.needs_backend("mori")]

PROMPTS = ["role switch check", "The decode server was a prefill server a moment ago " * 3]
IDLE_WAIT_S = 60.0


def _switch(url: str, role: str) -> dict:
    r = requests.post(f"{url}/pd_role_switch", json={"new_role": role, "decode_cuda_graph_memory_gb": 0},
                      timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_decode_switches_to_prefill_and_back_then_serves(standalone, pd):
    refs = [client.generate(standalone.url, p, 12) for p in PROMPTS]
    deadline = time.monotonic() + IDLE_WAIT_S
    while client.requests_in_server(pd.decode_url):  # SGLang refuses to switch a busy instance
        assert time.monotonic() < deadline, "decode never went idle"
        time.sleep(0.1)
    there = _switch(pd.decode_url, "prefill")
    assert there["success"] and (there["old_role"], there["new_role"]) == ("decode", "prefill"), there
    back = _switch(pd.decode_url, "decode")
    assert back["success"] and (back["old_role"], back["new_role"]) == ("prefill", "decode"), back
    for prompt, ref in zip(PROMPTS, refs):
        ours = client.generate(pd.router_url, prompt, 12, timeout_s=120)
        assert ours.ok, ours.error
        assert ours.output_ids == ref.output_ids
    log = pd.log_text("decode")
    assert log.count("sglang-mori decode tp0: torn down") == 1 and log.count("sglang-mori prefill tp0: torn down") == 1
