"""The lines a real transfer process writes are the ones scripts/gpu_sglang/tproc_check.py reads to
tell a PD run that used the transfer process from one that silently fell back in-process."""

import logging
import sys
from pathlib import Path

from sglang_mori.backend import room_status as S

from transfer_process_rig import TransferProcessRig

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "gpu_sglang"))
import tproc_check  # noqa: E402


def test_a_child_that_carried_a_room_passes_the_log_check(caplog, capfd):
    caplog.set_level(logging.INFO, logger="sglang_mori.transfer_process")
    with TransferProcessRig() as rig:
        before = capfd.readouterr().err  # the child's start-up lines (its stderr is this process's)
        assert tproc_check.failure(caplog.text + before) is not None  # no room yet: not proven to post
        assert "never carried a room" in tproc_check.failure(caplog.text + before)
        assert rig.claim(1) is None
        rig.metadata(1, pages=[3])
        rig.wait_status(1, S.WAITING_FOR_INPUT)
        rig.send(1, pages=[0], last=True)
        rig.wait_status(1, S.SUCCESS)
    text = caplog.text + before + capfd.readouterr().err
    assert tproc_check.failure(text) is None, tproc_check.summary(text)
    assert tproc_check.summary(text)["accepted_pids"] == [rig.process.process.pid]


def test_a_refusal_fails_the_log_check_by_name(caplog):
    from sglang_mori.backend import manager as manager_module

    caplog.set_level(logging.WARNING, logger="sglang_mori.backend.manager")
    manager = object.__new__(manager_module.MoriKVManager)
    manager.attn_tp_rank = 1  # under TP each rank refuses alone: the check names which
    manager._refuse_transfer_process("KV buffer 3 at 0x10 is private host memory")
    why = tproc_check.failure(caplog.text, ranks=2)
    assert why == ("transfer process refused (transfers stayed in-process): prefill tp1: KV buffer 3 at 0x10 is "
                   "private host memory")
