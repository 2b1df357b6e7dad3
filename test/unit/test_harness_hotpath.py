"""bench hotpath's parts: the run counts named steps by thread role, and the IPC hand-off part
delivers every message to a reader in another process."""

import pytest

from sglang_mori.config import MoriConfig

from harness.hotpath.ipc import measure
from harness.hotpath.run import run_case


def test_steps_are_counted_on_the_threads_that_run_them():
    # Chunks through the shard (inline posts off: the next test counts them on the scheduler's thread).
    result = run_case("mla61p64", 128, requests=16, window=4, token_bytes=16, engine_mode="instant", steps=True,
                      config=MoriConfig(transfer_shards=1, inline_post="off"))
    steps = {(row["thread"], row["step"]): row for row in result["steps"]}
    # One chunk per request, planned and posted on the shard thread, never on the scheduler's.
    # The window closes once every room succeeded, which the shard decides inside `submit`: the
    # last submit may still be finishing then (counted after the report), hence "about one".
    submit = steps[("mori-shard-N", "shard: submit (all of it)")]
    assert 14 / 16 <= submit["calls"] <= 1.0 and submit["us"] > 0
    assert steps[("mori-shard-N", "plan: write_batch")]["calls"] == pytest.approx(1.0)
    assert not any(thread == "MainThread" and "plan" in step for thread, step in steps)
    # Decode's metadata is handled by prefill's control thread, once per request.
    assert steps[("mori-control", "control: handle message")]["calls"] == pytest.approx(1.0)
    # Decode's status thread reads prefill's messages through the inbox (nobody polls here): the
    # Success, and a TransferStarted only for a room still running SGLANG_MORI_ANNOUNCE_GRACE_MS
    # after its post, which the instant engine's rarely are (a shard descheduled that long on a
    # busy host); the last may be counted after the report. Woken by its arrival flag, the thread
    # drains every message waiting in one pass: fewer waits than messages when they come together.
    handled = steps[("mori-decode-status", "decode status: handle message")]
    received = steps[("mori-decode-status", "inbox: wait, receive, handle")]
    assert 15 / 16 <= handled["calls"] < 2.0 and received["calls"] > 0
    assert 15 / 16 <= result["decode_messages_per_request"] < 2.0
    assert result["rejections"] == []


def test_inline_posts_are_counted_on_the_schedulers_thread():
    """SGLANG_MORI_INLINE_POST=on: a lone room's chunk is planned and posted inside
    send(), on the scheduler's thread, never by a shard; a window of rooms sent back to back
    overlaps nothing on the shard (the instant engine finishes each write as it is posted)."""
    result = run_case("mla61p64", 128, requests=16, window=4, token_bytes=16, engine_mode="instant", steps=True,
                      config=MoriConfig(transfer_shards=1, inline_post="on"))
    steps = {(row["thread"], row["step"]): row for row in result["steps"]}
    assert steps[("MainThread", "inline post (all of it)")]["calls"] == pytest.approx(1.0)
    assert steps[("MainThread", "plan: write_batch")]["calls"] == pytest.approx(1.0)
    assert not any(thread == "mori-shard-N" and "plan" in step for thread, step in steps)
    assert result["rejections"] == []


def test_decode_polls_count_the_poll_as_decodes_scheduler_call():
    """--decode-polls: decode's scheduler polls its rooms as check_status does; every message (the
    Success, and a TransferStarted for a room not done within its grace; warm-up batches included) is
    read once, by the poll or the status thread, and the poll's CPU is decode's scheduler.poll."""
    window, requests = 4, 8
    # Chunks through the shard: posted inline with the instant engine, a room's Success leaves inside
    # prefill's send(), which this rig runs on the thread that polls for decode, so decode's status
    # thread would read every message before the first poll.
    result = run_case("gqa32p16", 64, requests=requests, window=window, token_bytes=16, engine_mode="instant",
                      decode_polls=True, config=MoriConfig(transfer_shards=1, inline_post="off"))
    assert result["decode"]["scheduler.poll"]["ours_us"] > 0
    read = result["decode_read_by"]
    rooms = requests + 2 * window
    assert rooms <= read["poll"] + read["thread"] < 2 * rooms
    # Some rooms' only message (their Success) may reach the status thread before their first poll
    # on a loaded host: fewer than one poll per request then (0.8 in a CI run), never none at all.
    assert read["poll"] > 0 and result["decode_polls_per_request"] > 0
    assert result["decode_status_polled_idle_us_per_s"] >= 0


def test_run_without_steps_reports_none():
    assert "steps" not in run_case("gqa32p16", 64, requests=4, window=4, token_bytes=16, engine_mode="instant")


@pytest.mark.parametrize("kind", ["zmq-ipc", "unix-seqpacket", "shm-ring"])
def test_ipc_handoff_reaches_a_reader_in_another_process(kind):
    row = measure(kind, pages=16, count=50)
    assert row["receiver_ok"] is True  # the reader decoded all 50 messages and exited cleanly
    assert row["messages"] == 50 and row["sender_cpu_us_median"] > 0
