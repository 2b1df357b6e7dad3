"""The transfer process's start-up (SGLANG_MORI_TRANSFER_PROCESS): it proves it can post from every
imported pool before the scheduler hands it anything, or the scheduler names why and keeps its
transfers in-process; and once up it costs no CPU while idle."""

import json
import time

import pytest

from sglang_mori.backend import room_status as S
from sglang_mori.transfer_process.client import TransferProcess, TransferProcessError
from sglang_mori.transfer_process.cpu_report import process_cpu_s

import transfer_process_faults
from transfer_process_rig import SharedPools, TransferProcessRig, child_spec

IDLE_WINDOW_S = 2.0
IDLE_CPU_SHARE = 0.10  # of one core; generous: this VM is shared and noisy


def test_an_idle_transfer_process_uses_almost_no_cpu():
    with TransferProcessRig() as rig:
        # one request first, so every thread (shard, completion, the engine's lanes) has run
        assert rig.claim(1) is None
        rig.metadata(1, pages=[3])
        rig.wait_status(1, S.WAITING_FOR_INPUT)
        rig.send(1, pages=[0], last=True)
        rig.wait_status(1, S.SUCCESS)
        pid = rig.process.process.pid
        before = process_cpu_s(pid)
        time.sleep(IDLE_WINDOW_S)  # the measured window itself, not a synchronisation
        used = process_cpu_s(pid) - before
    assert used < IDLE_CPU_SHARE * IDLE_WINDOW_S, f"idle transfer process used {used * 1e3:.0f} ms of CPU in 2 s"


@pytest.mark.parametrize("target, words", [
    (transfer_process_faults.registration_raises, "RuntimeError: injected: cannot register"),
    (transfer_process_faults.crashes_while_proving, "exited with code -6 during start-up"),
])
def test_a_child_that_cannot_register_or_dies_proving_is_refused_with_the_reason(target, words):
    pools = SharedPools()
    try:
        with pytest.raises(TransferProcessError, match="could not start|exited with code") as raised:
            TransferProcess(child_spec(pools), slots=16, target=target)
        assert words in str(raised.value), raised.value
    finally:
        pools.close()


def test_a_probe_write_that_fails_refuses_the_child_naming_the_write(monkeypatch):
    # every lane of every engine in the child fails its first batch: registration itself passes,
    # only a real write from the imported pools shows the engine cannot post from them
    faults = [{"kind": "fail_lane", "lane": lane, "times": 1} for lane in range(8)]
    monkeypatch.setenv("SGLANG_MORI_SOFTIO_FAULTS", json.dumps(faults))
    pools = SharedPools()
    try:
        with pytest.raises(TransferProcessError, match="the probe write from the imported KV pools failed"):
            TransferProcess(child_spec(pools), slots=16)
    finally:
        pools.close()


def test_a_refused_child_leaves_the_manager_in_process_with_the_reason(monkeypatch):
    from sglang_mori.backend import manager as manager_module
    from sglang_mori.transfer_process import startup

    def refuse(*args, **kwargs):
        raise TransferProcessError("the transfer process could not start: injected")

    monkeypatch.setattr(startup, "start", refuse)
    monkeypatch.setattr(manager_module.EngineSettings, "apply", lambda self: None)
    manager = object.__new__(manager_module.MoriKVManager)
    manager.mori_config = manager_module.MoriConfig(transfer_process=True)
    manager.kv_args = type("KVArgs", (), {"ib_device": None, "gpu_id": 0, "aux_data_ptrs": [0],
                                         "aux_data_lens": [64], "aux_item_lens": [64]})()  # SGLang sets all three
    manager.attn_tp_rank, manager.pp_rank, manager.pp_size = 0, 0, 1
    manager.layout, manager.local_ip, manager.sglang = None, "127.0.0.1", None
    manager.cp = type("CP", (), {"owns_aux": True})()
    assert manager._start_transfer_process(pools=[]) is None
    assert manager.transfer_process_refusal == "the transfer process could not start: injected"
