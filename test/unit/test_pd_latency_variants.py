"""scripts/gpu_sglang/pd_latency.py's config names: suffixes that set the servers' environment and
flags, and `_cand`, the same call's baseline on a candidate tree's code."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "gpu_sglang"))
import pd_latency  # noqa: E402


def test_cand_puts_the_candidate_python_first_on_the_servers_path(tmp_path, monkeypatch):
    (tmp_path / "python" / "sglang_mori").mkdir(parents=True)
    (tmp_path / "python" / "sglang_mori" / "__init__.py").write_text("")
    monkeypatch.setenv("CAND_ROOT", str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", "/tree/python:/site")
    mode, env, flags, _ = pd_latency.split_variants("auto_cand")
    assert mode == "auto" and flags == []
    assert env["PYTHONPATH"].split(":") == [str(tmp_path / "python"), "/tree/python", "/site"]


def test_cand_combines_with_other_suffixes(tmp_path, monkeypatch):
    (tmp_path / "python" / "sglang_mori").mkdir(parents=True)
    (tmp_path / "python" / "sglang_mori" / "__init__.py").write_text("")
    monkeypatch.setenv("CAND_ROOT", str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", "/site")
    mode, env, flags, _ = pd_latency.split_variants("auto_optimistic_cand")
    assert mode == "auto" and flags == ["--optimistic-prefill-attempts", "1"]
    assert env["PYTHONPATH"].startswith(str(tmp_path / "python") + ":")


def test_a_missing_candidate_fails_by_name_instead_of_running_this_tree(tmp_path, monkeypatch):
    monkeypatch.setenv("CAND_ROOT", str(tmp_path / "nothing"))
    with pytest.raises(FileNotFoundError, match="no candidate tree"):
        pd_latency.split_variants("auto_cand")


def test_plain_modes_change_nothing():
    assert pd_latency.split_variants("auto") == ("auto", {}, [], {})
    assert pd_latency.split_variants("off_threadreads") == ("off", {"SGLANG_MORI_POLL_READS": "0"}, [], {})


def test_cand_without_a_pythonpath_adds_no_empty_entry(tmp_path, monkeypatch):
    (tmp_path / "python" / "sglang_mori").mkdir(parents=True)
    (tmp_path / "python" / "sglang_mori" / "__init__.py").write_text("")
    monkeypatch.setenv("CAND_ROOT", str(tmp_path))
    monkeypatch.delenv("PYTHONPATH", raising=False)
    assert pd_latency.split_variants("auto_cand")[1] == {"PYTHONPATH": str(tmp_path / "python")}


class FakeServer:
    def __init__(self, name, argv, env, logs, port):
        self.name, self.url, self.ready_s = name, f"http://127.0.0.1:{port}", 1.0

    def start(self):
        return self

    def wait_ready(self, deadline_s):
        pass

    def metrics(self):
        return {}

    def stop(self):
        pass


def test_both_clients_are_measured_in_turn_on_the_same_servers_with_their_own_prompts(tmp_path, monkeypatch):
    """--clients new,old: each repeat measures the new client, then the old one, on one standalone
    server; the old one's results under <shape>_oldclient[_repeatN], no prompt shared between them."""
    seen = []

    def fake(client):
        def send(url, body):
            seen.append((client, tuple(body["input_ids"][:4])))
            return {"ttft_s": 0.08, "itl_s": [0.002], "tokens": 2, "e2e_s": 0.1, "sent_at": 1.0, "first_at": 1.08}
        return send
    monkeypatch.setattr(pd_latency, "Server", FakeServer)
    monkeypatch.setattr(pd_latency, "compiled_files", lambda: 0)
    monkeypatch.setattr(pd_latency, "generate_stream", fake("new"))
    monkeypatch.setattr(pd_latency, "generate_stream_requests", fake("old"))
    args = type("A", (), dict(model="m", mem=0.5, trace=False, gpu_base=0, start_timeout=1, lengths=[16],
                              concurrency=[1], requests_c1=3, requests_per_conc=1, repeats=2,
                              clients=["new", "old"]))()
    result = pd_latency.run_config("standalone", args, tmp_path, [1, 2, 3])
    assert "failed" not in result
    keys = [k for k in result if k.startswith("16tok")]
    assert keys == ["16tok_c1", "16tok_c1_oldclient", "16tok_c1_repeat1", "16tok_c1_oldclient_repeat1"]
    assert all(result[k]["ok"] == 3 for k in keys)
    measured = seen[2:]  # after the warm-up's 2 requests (new client)
    assert [c for c, _ in measured] == ["new"] * 3 + ["old"] * 3 + ["new"] * 3 + ["old"] * 3
    prompts = [p for _, p in measured]
    assert len(set(prompts)) == len(prompts)  # no prefix-cache hit between clients or repeats
