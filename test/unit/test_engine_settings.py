"""`--disaggregation-ib-device` per GPU: every form SGLang accepts ends up in MORI_RDMA_DEVICES.

The manager builds its engine settings with `EngineSettings.for_gpu(kv_args.ib_device,
kv_args.gpu_id, ...)` and applies them before creating the IOEngine; these tests drive that same
call with SGLang's real parser, on a patched environment.
"""

import ast
import json
import os
from pathlib import Path

import pytest

from sglang_mori.engine.settings import EngineSettings
from sglang_mori.backend.sglang_fields import ib_devices_for_gpu

MANAGER = Path(__file__).resolve().parents[2] / "python" / "sglang_mori" / "backend" / "manager.py"

MAP = {"0": "mlx5_0, mlx5_1", "1": "mlx5_2", "7": "rdma7"}


@pytest.fixture
def env(monkeypatch):
    for name in ("MORI_RDMA_DEVICES", "MORI_DISABLE_AUTO_XGMI"):
        monkeypatch.setenv(name, "")  # recorded, so whatever apply() sets is undone afterwards
        monkeypatch.delenv(name)
    return os.environ


def resolved(ib_device, gpu_id, env):
    EngineSettings.for_gpu(ib_device, gpu_id, resolve=ib_devices_for_gpu).apply()
    return env.get("MORI_RDMA_DEVICES")


@pytest.mark.parametrize("gpu_id, devices", [(0, "mlx5_0,mlx5_1"), (1, "mlx5_2"), (7, "rdma7")])
def test_json_map_resolves_per_gpu(env, gpu_id, devices):
    assert resolved(json.dumps(MAP), gpu_id, env) == devices


def test_json_file_resolves_per_gpu(env, tmp_path):
    path = tmp_path / "ib_devices.json"
    path.write_text(json.dumps(MAP))
    assert resolved(str(path), 1, env) == "mlx5_2"
    assert resolved(f"  {path}  ", 0, env) == "mlx5_0,mlx5_1"


def test_plain_list_is_the_same_for_every_gpu(env):
    assert resolved("mlx5_0, mlx5_3", 0, env) == "mlx5_0,mlx5_3"
    assert resolved("mlx5_0, mlx5_3", 5, env) == "mlx5_0,mlx5_3"


def test_no_flag_leaves_mori_its_own_choice(env):
    for value in (None, "", "   "):
        assert resolved(value, 0, env) is None
    assert EngineSettings.for_gpu(None, 0).describe_nic() == "auto"


def test_a_gpu_missing_from_the_map_fails_at_start_naming_the_mapped_gpus(env):
    with pytest.raises(ValueError, match=r"No IB devices configured for GPU 3. Available GPUs: \[0, 1, 7\]"):
        EngineSettings.for_gpu(json.dumps(MAP), 3, resolve=ib_devices_for_gpu)
    assert "MORI_RDMA_DEVICES" not in env


def test_xgmi_travels_with_the_devices(env):
    EngineSettings.for_gpu(json.dumps(MAP), 1, xgmi=True, resolve=ib_devices_for_gpu).apply()
    assert (env["MORI_RDMA_DEVICES"], env["MORI_DISABLE_AUTO_XGMI"]) == ("mlx5_2", "0")


def test_manager_starts_its_engine_with_these_settings():
    # The manager is not constructed here (it needs a scheduler); check it calls for_gpu with
    # the flag and this rank's GPU, and applies the result before loading the engine module.
    start = next(n for n in ast.walk(ast.parse(MANAGER.read_text()))
                 if isinstance(n, ast.FunctionDef) and n.name == "_start_engine")
    source = ast.unparse(start)
    calls = [n for n in ast.walk(start) if isinstance(n, ast.Call)]
    for_gpu = [c for c in calls if getattr(c.func, "attr", None) == "for_gpu"]
    assert len(for_gpu) == 1
    assert [ast.unparse(a) for a in for_gpu[0].args[:2]] == ["self.kv_args.ib_device", "self.kv_args.gpu_id"]
    assert source.index(".apply()") < source.index("load_io_module(")


def test_a_user_set_mori_rdma_devices_wins_over_the_flag(env, monkeypatch, caplog):
    # docs/configuration.md: the flag is used only when the variable is unset. An exclusion such as
    # "^mlx5_8" cannot be said with the flag, and must not be silently replaced by it.
    monkeypatch.setenv("MORI_RDMA_DEVICES", "^mlx5_8")
    with caplog.at_level("INFO", logger="sglang_mori.engine.settings"):
        assert resolved(json.dumps(MAP), 1, env) == "^mlx5_8"
    assert "MORI_RDMA_DEVICES=^mlx5_8 from the environment win over --disaggregation-ib-device (mlx5_2" in caplog.text
    assert EngineSettings.for_gpu(json.dumps(MAP), 1, resolve=ib_devices_for_gpu).describe_nic() == "^mlx5_8"


def test_the_flag_is_used_and_logged_when_the_variable_is_unset(env, caplog):
    with caplog.at_level("INFO", logger="sglang_mori.engine.settings"):
        assert resolved(json.dumps(MAP), 1, env) == "mlx5_2"
    assert "RDMA devices mlx5_2 from --disaggregation-ib-device" in caplog.text


def test_a_second_manager_in_the_process_still_follows_the_flag(env):
    # A role switch builds a new manager in the same process: the value the first one exported is
    # ours, not the user's, so the flag still decides.
    assert resolved("mlx5_0", 0, env) == "mlx5_0"
    assert resolved("mlx5_0,mlx5_1", 0, env) == "mlx5_0,mlx5_1"
