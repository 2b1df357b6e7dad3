"""The prefill transfer process (SGLANG_MORI_TRANSFER_PROCESS, issue 28 prototype): a spawned child
owns a softio engine and today's prefill service over pools mapped from /dev/shm; the scheduler's
side hands chunks over a SEQPACKET channel and reads statuses from shared memory."""

import os
import signal

import numpy as np
import pytest

from sglang_mori.backend import room_status as S
from sglang_mori.transfer_process.pools import PoolNotImportable, describe

from rig import AUX_BYTES
from transfer_process_rig import TransferProcessRig
from waiting import wait_until


@pytest.fixture
def tp():
    with TransferProcessRig() as rig:
        yield rig


def test_bytes_written_by_the_child_arrive_in_decode_pool_and_statuses_rise(tp):
    assert tp.claim(1) is None
    assert tp.poll(1) == S.BOOTSTRAPPING
    tp.metadata(1, pages=[5, 9, 2], aux_index=3)
    tp.wait_status(1, S.WAITING_FOR_INPUT)
    assert tp.sglang.transfer_infos[1] == {"transfer-process": (1, 0)}
    tp.send(1, pages=[0, 1], last=False)
    tp.send(1, pages=[7], last=True, start=2, aux_index=4)
    tp.wait_status(1, S.SUCCESS)
    for buffer in range(2):
        for src, dst in ((0, 5), (1, 9), (7, 2)):
            assert tp.decode.page(buffer, dst) == tp.pools.page(buffer, src)
    # Success reached decode with prefill's aux item 4 in decode's aux slot 3
    wait_until(lambda: tp.decode_sglang.status(1) == S.SUCCESS, "decode's room 1 Success", 20)
    assert tp.decode.aux[3 * AUX_BYTES:4 * AUX_BYTES].tobytes() == tp.pools.aux[4 * AUX_BYTES:5 * AUX_BYTES].tobytes()


def test_a_room_decode_aborted_reads_failed_with_its_reason(tp):
    assert tp.claim(2) is None
    tp.metadata(2, pages=[1])
    tp.wait_status(2, S.WAITING_FOR_INPUT)
    tp.service.fail(2, "aborted on prefill by the test", "aborted")
    tp.wait_status(2, S.FAILED)
    assert tp.sglang.failure_reason(2) == "aborted on prefill by the test"


def test_released_slots_are_reused_only_after_the_child_let_go(tp):
    for room in range(100, 116):  # the rig's 16 slots
        assert tp.claim(room) is None, room
    assert "all 16 status slots are in use" in tp.claim(116)
    assert tp.sglang.status(116) == S.FAILED and "status slots" in tp.sglang.failure_reason(116)
    for room in range(100, 116):
        tp.sglang.clear(room)
        tp.service.release(room)
    wait_until(lambda: tp.process.table.released.all(), "the child to let go of every slot", 20)
    for room in range(200, 216):
        assert tp.claim(room) is None, room


def test_a_child_killed_mid_transfer_fails_its_rooms_with_a_reason_and_nothing_hangs(tp):
    assert tp.claim(3) is None
    tp.metadata(3, pages=[4, 6])
    tp.wait_status(3, S.WAITING_FOR_INPUT)
    tp.send(3, pages=[0], last=False)
    os.kill(tp.process.process.pid, signal.SIGKILL)
    tp.wait_status(3, S.FAILED)
    reason = tp.sglang.failure_reason(3)
    assert "transfer process" in reason and "-9" in reason, reason
    # later calls fail at once instead of blocking on the dead channel
    tp.send(3, pages=[1], last=True, start=1)
    assert "exited with code -9" in tp.claim(4)
    assert tp.poll(4) == S.FAILED and "exited with code -9" in tp.sglang.failure_reason(4)


def test_private_host_memory_is_refused_with_the_buffer_named():
    private = np.zeros(4096, np.uint8)
    with pytest.raises(PoolNotImportable, match=r"KV buffer 0 .* private host memory"):
        describe([private.ctypes.data], [private.nbytes], False, -1)


def _check(pools, layerwise="off", pp_size=1, state=()):
    from sglang_mori.backend.prefill.context_parallel import PrefillCP
    from sglang_mori.config import MoriConfig
    from sglang_mori.transfer_process import startup

    return startup.check(MoriConfig(transfer_process=True, layerwise=layerwise), PrefillCP(), pp_size, False,
                         list(state), [p.ctypes.data for p in pools], [p.nbytes for p in pools], 0)


@pytest.mark.parametrize("change, words", [
    ({"layerwise": "on"}, "layer-wise"),
    ({"pp_size": 2}, "pipeline parallelism"),
    ({"state": [123]}, "state pools"),
])
def test_deployments_the_prototype_does_not_carry_are_refused_with_the_reason(change, words, monkeypatch):
    from sglang_mori.backend import sglang_fields
    from transfer_process_rig import SharedPools

    monkeypatch.setattr(sglang_fields, "kv_on_gpu", lambda: False)
    shared = SharedPools()
    try:
        ok, imports = _check(shared.kv)
        assert ok is None and [p.kind for p in imports] == ["shm", "shm"]
        reason, imports = _check(shared.kv, **change)
        assert words in reason and imports == []
    finally:
        shared.close()


def test_a_manager_with_private_cpu_pools_is_refused_naming_the_buffer(monkeypatch):
    from sglang_mori.backend import sglang_fields

    monkeypatch.setattr(sglang_fields, "kv_on_gpu", lambda: False)
    private = [np.zeros(4096, np.uint8), np.zeros(4096, np.uint8)]
    reason, imports = _check(private)
    assert "KV buffer 0" in reason and "private host memory" in reason and imports == []


SCHEDULER_THAT_DIES = """
import os, sys
sys.path.insert(0, {here!r})
from transfer_process_rig import TransferProcessRig
rig = TransferProcessRig()
print(rig.process.process.pid, flush=True)
sys.stdin.readline()
os._exit(0)  # no teardown: the scheduler process dies
"""


def test_the_child_dies_with_the_scheduler_process():
    import subprocess
    import sys
    from pathlib import Path

    here = str(Path(__file__).resolve().parent)
    scheduler = subprocess.Popen([sys.executable, "-c", SCHEDULER_THAT_DIES.format(here=here)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        child = int(scheduler.stdout.readline())
        os.kill(child, 0)  # alive while the scheduler lives
        scheduler.stdin.write("\n")
        scheduler.stdin.flush()
        scheduler.wait(timeout=20)

        def gone():
            try:
                with open(f"/proc/{child}/stat") as f:
                    return f.read().rsplit(")", 1)[1].split()[0] == "Z"
            except FileNotFoundError:
                return True
        wait_until(gone, f"transfer process {child} to die with its scheduler", 20)
    finally:
        if scheduler.poll() is None:
            scheduler.kill()
