"""Decode's receiver attempt ids: prefill tells a retract-rebootstrap from a replay by the id alone,
so ids must not repeat within a process, nor continue a parent's sequence in a forked child."""

import os

from sglang_mori.backend.decode import rooms


def test_attempt_ids_never_repeat_and_fit_msgpack_int64():
    ids = [rooms.new_attempt_id() for _ in range(10_000)]
    assert len(set(ids)) == len(ids)
    assert all(1 <= i < 2**62 for i in ids)


def test_registry_gives_each_receiver_of_a_room_a_new_attempt():
    registry = rooms.DecodeRoomRegistry()
    first = registry.open(7).attempt
    second = registry.open(7).attempt
    assert first != second
    assert registry.current(7, second) is not None and registry.current(7, first) is None


def test_a_forked_child_does_not_continue_the_parents_sequence():
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: send its next id, leave without pytest's teardown
        os.write(write_end, rooms.new_attempt_id().to_bytes(8, "little"))
        os._exit(0)
    os.close(write_end)
    child_next = int.from_bytes(os.read(read_end, 8), "little")
    os.close(read_end)
    os.waitpid(pid, 0)
    parent_next = rooms.new_attempt_id()
    assert child_next not in (parent_next, parent_next - 1, parent_next + 1)
