"""When prefill fences a failed room's writes still in flight (backend/prefill/fence.py)."""

from sglang_mori.backend.prefill.fence import fence_after_s


def test_the_margin_before_decodes_release_timeout():
    assert fence_after_s(30.0, 10.0, 120.0) == 20.0


def test_never_later_than_the_give_up():
    assert fence_after_s(300.0, 10.0, 120.0) == 120.0


def test_a_margin_covering_the_timeout_still_waits_half_of_it():
    # Fencing at once would fail every write to that decode, while the aborted room's last
    # writes are still landing: other rooms' healthy requests then failed (the quick soak).
    assert fence_after_s(5.0, 10.0, 120.0) == 2.5
    assert fence_after_s(6.0, 3.0, 120.0) == 3.0
