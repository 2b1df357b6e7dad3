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
    mode, env, flags = pd_latency.split_variants("auto_cand")
    assert mode == "auto" and flags == []
    assert env["PYTHONPATH"].split(":") == [str(tmp_path / "python"), "/tree/python", "/site"]


def test_cand_combines_with_other_suffixes(tmp_path, monkeypatch):
    (tmp_path / "python" / "sglang_mori").mkdir(parents=True)
    (tmp_path / "python" / "sglang_mori" / "__init__.py").write_text("")
    monkeypatch.setenv("CAND_ROOT", str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", "/site")
    mode, env, flags = pd_latency.split_variants("auto_optimistic_cand")
    assert mode == "auto" and flags == ["--optimistic-prefill-attempts", "1"]
    assert env["PYTHONPATH"].startswith(str(tmp_path / "python") + ":")


def test_a_missing_candidate_fails_by_name_instead_of_running_this_tree(tmp_path, monkeypatch):
    monkeypatch.setenv("CAND_ROOT", str(tmp_path / "nothing"))
    with pytest.raises(FileNotFoundError, match="no candidate tree"):
        pd_latency.split_variants("auto_cand")


def test_plain_modes_change_nothing():
    assert pd_latency.split_variants("auto") == ("auto", {}, [])
    assert pd_latency.split_variants("off_threadreads") == ("off", {"SGLANG_MORI_POLL_READS": "0"}, [])


def test_cand_without_a_pythonpath_adds_no_empty_entry(tmp_path, monkeypatch):
    (tmp_path / "python" / "sglang_mori").mkdir(parents=True)
    (tmp_path / "python" / "sglang_mori" / "__init__.py").write_text("")
    monkeypatch.setenv("CAND_ROOT", str(tmp_path))
    monkeypatch.delenv("PYTHONPATH", raising=False)
    assert pd_latency.split_variants("auto_cand")[1] == {"PYTHONPATH": str(tmp_path / "python")}
