"""scripts/gpu_sglang/tproc_check.py on sample prefill logs: a PD run asked for the transfer process
passes only where every rank's child was accepted, proven and carried a room to Success."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "gpu_sglang"))
import tproc_check  # noqa: E402

ACCEPT = "[2026-11-28 10:00:01] sglang-mori: transfer process pid 4242 serves control port 39001\n"
PROVEN = ("2026-11-28 10:00:00 transfer-process INFO sglang-mori transfer process pid 4242: engine soft on "
          "127.0.0.1, control port 39001, 64 KV buffers registered and proven; start-up used 900 ms of CPU\n")
SUCCESS = ("2026-11-28 10:00:09 transfer-process INFO sglang-mori transfer process pid 4242: first room reached "
           "Success (room 77)\n")
REFUSED = ("[2026-11-28 10:00:01] sglang-mori prefill tp0: SGLANG_MORI_TRANSFER_PROCESS=on refused: KV buffer 0 at "
           "0x7f00 (4096 bytes) is private host memory (in anonymous memory): the transfer process can map only "
           "shared-memory files under /dev/shm; transfers stay in the scheduler's process\n")


def test_a_log_with_acceptance_proof_and_success_passes():
    assert tproc_check.failure("noise\n" + PROVEN + ACCEPT + SUCCESS) is None


def test_a_refusal_fails_naming_the_reason_even_beside_an_acceptance():
    why = tproc_check.failure(REFUSED + ACCEPT + PROVEN + SUCCESS)
    assert why.startswith("transfer process refused (transfers stayed in-process): prefill tp0: KV buffer 0 at 0x7f00")
    assert why.endswith("files under /dev/shm")  # the reason alone, not the fallback words after it


def test_a_log_without_any_line_fails_as_never_accepted():
    assert tproc_check.failure("[x] The server is fired up and ready to roll!\n").startswith(
        "transfer process never accepted: 0 of 1")


def test_a_child_that_never_reached_success_fails_as_never_posted():
    assert "pid 4242 never carried a room to Success" in tproc_check.failure(PROVEN + ACCEPT)


def test_an_acceptance_without_the_proof_line_fails():
    assert "without its start-up proof" in tproc_check.failure(ACCEPT + SUCCESS)


def test_two_ranks_need_two_children():
    assert "1 of 2 prefill ranks" in tproc_check.failure(PROVEN + ACCEPT + SUCCESS, ranks=2)


def test_check_log_reads_the_file_and_names_a_missing_one(tmp_path):
    log = tmp_path / "pd_tp-prefill.log"
    log.write_text(PROVEN + ACCEPT + SUCCESS)
    assert tproc_check.check_log(log) | {"accepted_pids": None} == {
        "ok": True, "failure": None, "accepted_pids": None, "proven_pids": [4242], "success_pids": [4242],
        "refusals": [], "startup_cpu_ms": {4242: 900}}
    missing = tproc_check.check_log(tmp_path / "absent.log")
    assert not missing["ok"] and missing["failure"].startswith("transfer process check: no prefill log")


def rank_lines(pid: int, port: int) -> str:
    return (PROVEN.replace("4242", str(pid)).replace("39001", str(port)) + ACCEPT.replace("4242", str(pid))
            .replace("39001", str(port)) + SUCCESS.replace("4242", str(pid)))


def test_two_ranks_each_with_a_serving_child_pass_and_report_both_start_ups():
    text = rank_lines(4242, 39001) + rank_lines(4243, 39002)
    assert tproc_check.failure(text, ranks=2) is None
    assert tproc_check.summary(text)["startup_cpu_ms"] == {4242: 900, 4243: 900}


def test_one_refused_rank_of_two_fails_naming_that_rank():
    """TP 2: rank 0's child serves, rank 1 refused (its transfers stayed in its scheduler)."""
    refused_tp1 = REFUSED.replace("prefill tp0", "prefill tp1")
    why = tproc_check.failure(rank_lines(4242, 39001) + refused_tp1, ranks=2)
    assert why.startswith("transfer process refused (transfers stayed in-process): prefill tp1: KV buffer 0")
