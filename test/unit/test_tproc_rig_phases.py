"""The rig's transfer-process runs on this CPU with fake servers: pd_identity.py's `pd_tp` phase and
pd_latency.py's `_tproc` configs set SGLANG_MORI_TRANSFER_PROCESS=on on the prefill server only,
put decode on the prefill's GPU with --gpus 1 (started once the prefill is up), and fail by name
unless the prefill log shows the transfer process serving."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "gpu_sglang"))
import pd_identity  # noqa: E402
import pd_latency  # noqa: E402

SERVING = ("sglang-mori transfer process pid 7: engine soft on 127.0.0.1, control port 9, 16 KV buffers registered "
           "and proven; start-up used 5 ms of CPU\nsglang-mori: transfer process pid 7 serves control port 9\n"
           "sglang-mori transfer process pid 7: first room reached Success (room 3)\n")
REFUSED = ("sglang-mori prefill tp0: SGLANG_MORI_TRANSFER_PROCESS=on refused: KV buffer 0 at 0x1: no CUDA IPC "
           "handle (error 1); transfers stay in the scheduler's process\n")


def fake_servers(events, prefill_log_text):
    class FakeServer:
        def __init__(self, name, argv, env, logs, port):
            self.name, self.argv, self.env, self.url, self.ready_s = name, argv, env, f"http://h:{port}", 1.0
            self.log = Path(logs) / f"{name}.log"
            events.append(("new", self))

        def start(self):
            events.append(("start", self.name))
            if self.name.endswith("-prefill") and prefill_log_text is not None:
                self.log.parent.mkdir(parents=True, exist_ok=True)
                self.log.write_text(prefill_log_text)
            return self

        def wait_ready(self, deadline_s):
            events.append(("ready", self.name))

        def metrics(self):
            return {}

        def stop(self):
            pass

        def gpu(self):
            return int(self.argv[self.argv.index("--base-gpu-id") + 1])
    return FakeServer


class FakePDClient:
    def __init__(self, pre, dec, boot):
        pass

    def __call__(self, body):
        return {"output_ids": [1, 2], "error": None}

    def stream(self, body):
        return {"ttft_s": 0.05, "itl_s": [0.002], "tokens": 2, "e2e_s": 0.1, "sent_at": 1.0, "first_at": 1.05}


def latency_args(**kw):
    base = dict(model="m", mem=0.5, mem_decode_shared=0.65, trace=False, gpu_base=0, start_timeout=1,
                lengths=[16], concurrency=[1], requests_c1=2, requests_per_conc=1, repeats=1, clients=["new"], gpus=1)
    return types.SimpleNamespace(**dict(base, **kw))


def run_latency(monkeypatch, tmp_path, name, log_text, **kw):
    events = []
    monkeypatch.setattr(pd_latency, "Server", fake_servers(events, log_text))
    monkeypatch.setattr(pd_latency, "PDClient", FakePDClient)
    monkeypatch.setattr(pd_latency, "compiled_files", lambda: 0)
    result = pd_latency.run_config(name, latency_args(**kw), tmp_path, [1, 2, 3])
    return result, events


def servers_of(events):
    return {s.name.rsplit("-", 1)[1]: s for kind, s in events if kind == "new"}


def test_tproc_config_sets_the_switch_on_the_prefill_only_and_shares_one_gpu(monkeypatch, tmp_path):
    result, events = run_latency(monkeypatch, tmp_path, "pd_off_tproc", SERVING)
    assert "failed" not in result, result.get("failed")
    assert result["transfer_process"]["ok"] and result["16tok_c1"]["ok"] == 2
    pre, dec = servers_of(events)["prefill"], servers_of(events)["decode"]
    assert pre.env["SGLANG_MORI_TRANSFER_PROCESS"] == "on" and "SGLANG_MORI_TRANSFER_PROCESS" not in dec.env
    assert pre.env["SGLANG_MORI_LAYERWISE"] == dec.env["SGLANG_MORI_LAYERWISE"] == "off"
    assert pre.gpu() == dec.gpu() == 0
    assert dec.argv[dec.argv.index("--mem-fraction-static") + 1] == "0.65"
    order = [e for e in events if e[0] != "new"]
    assert order.index(("ready", "pd_off_tproc-prefill")) < order.index(("start", "pd_off_tproc-decode"))
    assert order.count(("ready", "pd_off_tproc-prefill")) == 1


def test_tproc_config_whose_switch_was_refused_fails_by_name(monkeypatch, tmp_path):
    result, _ = run_latency(monkeypatch, tmp_path, "pd_off_tproc", REFUSED)
    assert result["failed"].startswith("transfer process refused (transfers stayed in-process): prefill tp0: KV buffer 0")


def test_tproc_config_without_a_prefill_log_fails_by_name(monkeypatch, tmp_path):
    result, _ = run_latency(monkeypatch, tmp_path, "pd_off_tproc", None)
    assert result["failed"].startswith("transfer process check: no prefill log")


def test_plain_pd_config_is_not_checked_and_two_gpus_keep_decode_on_the_next(monkeypatch, tmp_path):
    result, events = run_latency(monkeypatch, tmp_path, "pd_off", None, gpus=2)
    assert "failed" not in result and "transfer_process" not in result
    pre, dec = servers_of(events)["prefill"], servers_of(events)["decode"]
    assert (pre.gpu(), dec.gpu()) == (0, 1) and "SGLANG_MORI_TRANSFER_PROCESS" not in pre.env


def test_tproc_suffix_combines_with_others():
    assert pd_latency.split_variants("off_tproc_threadreads") == (
        "off", {"SGLANG_MORI_POLL_READS": "0"}, [], {"SGLANG_MORI_TRANSFER_PROCESS": "on"})


def identity_args(tmp_path, **kw):
    base = dict(model="m", gpus=1, gpu_base=0, prefill_tp=1, standalone_tp=1, deterministic=True, dtype=None,
                mem=0.3, mem_decode_shared=0.65, kv_hash=None, start_timeout=1, concurrency=[1], decode_gpu=None)
    return types.SimpleNamespace(**dict(base, **kw))


@pytest.mark.parametrize("log_text, failed", [
    (SERVING, None),
    (REFUSED, "transfer process refused (transfers stayed in-process): prefill tp0: KV buffer 0 at 0x1: no CUDA IPC "
              "handle (error 1)"),
    ("", "transfer process never accepted: 0 of 1 prefill ranks logged 'serves control port'"),
])
def test_pd_tp_phase_runs_the_prefill_in_a_transfer_process_and_fails_by_name(monkeypatch, tmp_path, log_text, failed):
    events = []
    monkeypatch.setattr(pd_identity, "Server", fake_servers(events, log_text))
    monkeypatch.setattr(pd_identity, "PDClient", FakePDClient)
    phase = pd_identity.run_phase("pd_tp", identity_args(tmp_path), [{"input_ids": [5], "max_new_tokens": 2}],
                                  tmp_path / "logs", [1, 2, 3])
    assert phase.get("failed") == failed
    assert phase["c1"]["results"][0]["output_ids"] == [1, 2]  # the tokens are still compared
    pre, dec = servers_of(events)["prefill"], servers_of(events)["decode"]
    assert pre.env["SGLANG_MORI_TRANSFER_PROCESS"] == "on" and pre.env["SGLANG_MORI_LAYERWISE"] == "off"
    assert "SGLANG_MORI_TRANSFER_PROCESS" not in dec.env
    assert pre.gpu() == dec.gpu() == 0


def test_plain_pd_phase_is_not_checked(monkeypatch, tmp_path):
    events = []
    monkeypatch.setattr(pd_identity, "Server", fake_servers(events, None))
    monkeypatch.setattr(pd_identity, "PDClient", FakePDClient)
    phase = pd_identity.run_phase("pd", identity_args(tmp_path), [{"input_ids": [5], "max_new_tokens": 2}],
                                  tmp_path / "logs", [1, 2, 3])
    assert "failed" not in phase and "transfer_process" not in phase
    assert "SGLANG_MORI_TRANSFER_PROCESS" not in servers_of(events)["prefill"].env


def test_max_total_tokens_reaches_both_servers(monkeypatch, tmp_path):
    _, events = run_latency(monkeypatch, tmp_path, "pd_off", None, max_total_tokens=131072)
    for server in servers_of(events).values():
        assert server.argv[server.argv.index("--max-total-tokens") + 1] == "131072"


def test_fewer_prompts_than_the_reference_count_only_the_prompts_compared():
    items = pd_identity.prompts(64, 8192)
    assert pd_identity.prompts(16, 8192) == items[:16]  # a shorter run's prompts are the reference's first
    ref = [{"output_ids": [i], "error": None} for i in range(64)]
    got = [{"output_ids": [i], "error": None} for i in range(16)]
    got[3] = {"output_ids": [99], "error": None}
    assert {k: v for k, v in pd_identity.compare(ref, got).items() if k in ("identical", "total", "mismatched")} == {
        "identical": 15, "total": 16, "mismatched": [3]}


def test_pd_tp_at_prefill_tp2_with_decode_on_a_prefill_gpu(monkeypatch, tmp_path):
    """Two GPUs, prefill TP 2 on both: --decode-gpu 0 starts decode after the prefill is up, with the
    shared fraction; the check wants two children, so one rank's serving child is not enough."""
    events = []
    monkeypatch.setattr(pd_identity, "Server", fake_servers(events, SERVING))
    monkeypatch.setattr(pd_identity, "PDClient", FakePDClient)
    args = identity_args(tmp_path, gpus=2, prefill_tp=2, decode_gpu=0)
    phase = pd_identity.run_phase("pd_tp", args, [{"input_ids": [5], "max_new_tokens": 2}], tmp_path / "logs", [1, 2, 3])
    assert phase["failed"] == "transfer process never accepted: 1 of 2 prefill ranks logged 'serves control port'"
    pre, dec = servers_of(events)["prefill"], servers_of(events)["decode"]
    assert pre.argv[pre.argv.index("--tp-size") + 1] == "2" and (pre.gpu(), dec.gpu()) == (0, 0)
    assert dec.argv[dec.argv.index("--mem-fraction-static") + 1] == "0.65" and "--tp-size" not in dec.argv
    order = [e for e in events if e[0] != "new"]
    assert order.index(("ready", "pd_tp-prefill")) < order.index(("start", "pd_tp-decode"))
    assert order.count(("ready", "pd_tp-prefill")) == 1  # its ready_s is its start-up (session 21 read 1.0 s)


def test_two_gpus_without_decode_gpu_keep_decode_after_the_prefills():
    args = identity_args(None, gpus=2, prefill_tp=1)
    assert pd_identity.decode_gpu(args) == 1
    assert pd_identity.decode_gpu(identity_args(None, gpus=1)) == 0
    assert pd_identity.decode_gpu(identity_args(None, gpus=2, prefill_tp=2, decode_gpu=1)) == 1


def test_a_stored_pd_phase_as_reference_and_a_phase_of_this_run_compared(tmp_path):
    """TP 2 against TP 2: the reference's `pd` phase (--reference-phase) and this run's `pd` (--compare-phase)."""
    report = {"phases": {
        "standalone": {"c1": {"results": [{"output_ids": [1], "error": None}, {"output_ids": [2], "error": None}]}},
        "pd_tp": {"c1": {"results": [{"output_ids": [1], "error": None}, {"output_ids": [3], "error": None}],
                         "digest": "d1"}},
        "pd": {"c1": {"results": [{"output_ids": [1], "error": None}, {"output_ids": [3], "error": None}],
                      "digest": "d1"}}}, "reference": "stored.json"}
    pd_identity.compare_phases(report, [1], "standalone", "vs_standalone")
    pd_identity.compare_phases(report, [1], "pd", "vs_pd")
    assert report["phases"]["pd_tp"]["c1"]["vs_pd"]["identical"] == 2
    assert report["phases"]["pd_tp"]["c1"]["vs_standalone"]["identical"] == 1
    assert "vs_pd" not in report["phases"]["pd"]["c1"]
    assert pd_identity.identity_lines(report, [1], "pd") == [
        "[pd_tp] c1: digest d1; identical 1/2 vs the reference; identical 2/2 vs pd",
        "[pd] c1: digest d1; identical 1/2 vs the reference"]


def test_a_phase_cut_by_the_steps_time_limit_keeps_the_comparisons_of_the_phases_before_it(tmp_path, monkeypatch,
                                                                                           capsys):
    """Session 21's first call: SIGINT during the second phase lost the first phase's comparison lines."""
    items = pd_identity.prompts(2, 8192)
    results = [{"output_ids": [i], "error": None} for i in range(2)]
    ref = tmp_path / "ref.json"
    ref.write_text(json.dumps({"phases": {"pd": {"c1": {"results": results}}}}))

    def run_phase(name, *args):
        if name == "pd":
            raise KeyboardInterrupt
        return {"phase": name, "c1": {"results": results}}
    monkeypatch.setattr(pd_identity, "run_phase", run_phase)
    monkeypatch.setattr(sys, "argv", ["pd_identity.py", "--model", "m", "--out", str(tmp_path / "o"), "--phases",
                                      "pd_tp,pd", "--prompts", str(len(items)), "--concurrency", "1", "--reference",
                                      str(ref), "--reference-phase", "pd", "--tag", "t"])
    pd_identity.main()
    report = json.loads((tmp_path / "o" / "t.json").read_text())
    assert report["phases"]["pd"]["failed"].startswith("interrupted")
    assert report["phases"]["pd_tp"]["c1"]["vs_standalone"]["identical"] == 2
    assert "[pd_tp] c1: digest" in capsys.readouterr().out
