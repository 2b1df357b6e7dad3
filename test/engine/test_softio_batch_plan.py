"""softio's batch planner: MORI's sort, merge and gather rules, in Python and numpy alike."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_mori.softio.batch_plan import (MAX_MSG_SIZE, PlanError, _merge_python, _plan_numpy,
                                           plan_frames, split_post_batches)
from sglang_mori.softio.enums import StatusCode

SOFTIO_ONLY = True
pytestmark = pytest.mark.timeout(120)


def pieces(frame):
    remote, total, local = frame
    return [(local, total)] if isinstance(local, int) else list(local)


def apply(frames, local: np.ndarray, size: int) -> np.ndarray:
    out = np.zeros(size, dtype=np.uint8)
    for frame in frames:
        remote = frame[0]
        for lo, length in pieces(frame):
            out[remote:remote + length] = local[lo:lo + length]
            remote += length
    return out


@st.composite
def batches(draw):
    """Entries over a small space, so merges and gathers are frequent; no overlaps remotely."""
    n = draw(st.integers(1, 120))
    slots = draw(st.permutations(range(n)))
    sizes = draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    local_slots = draw(st.lists(st.integers(0, n + 3), min_size=n, max_size=n))
    remote = [s * 3 for s in slots]
    # Remote slots of 3 bytes: entries of size 3 touch their neighbours (remote-contiguous).
    sizes = [min(s, 3) for s in sizes]
    local = [s * 3 for s in local_slots]
    return local, remote, sizes


@settings(max_examples=100, deadline=None)
@given(batches(), st.integers(1, 4))
def test_numpy_and_python_planners_agree_and_move_the_right_bytes(batch, max_sge):
    lo, ro, sz = batch
    size = 3 * (len(sz) + 4)
    python = _merge_python(lo, ro, sz, max_sge)
    vectorised = _plan_numpy(np.array(lo), np.array(ro), np.array(sz), size, size, max_sge)
    assert vectorised == python
    assert plan_frames(lo, ro, sz, size, size, max_sge) == python
    assert all(len(pieces(f)) <= max_sge for f in python)
    assert [f[0] for f in python] == sorted(f[0] for f in python)
    assert all(f[1] == sum(p[1] for p in pieces(f)) for f in python)
    local = np.random.default_rng(0).integers(1, 256, size, dtype=np.uint8)
    expected = np.zeros(size, dtype=np.uint8)
    for l, r, s in zip(lo, ro, sz):
        expected[r:r + s] = local[l:l + s]
    assert np.array_equal(apply(python, local, size), expected)


def test_merge_and_gather_examples():
    # Contiguous on both sides: one piece. Remote-contiguous only: pieces of one frame.
    assert plan_frames([0, 100], [0, 100], [100, 50], 1000, 1000) == [(0, 150, 0)]
    assert plan_frames([500, 0], [100, 0], [50, 100], 1000, 1000) == [(0, 150, ((0, 100),
                                                                                 (500, 50)))]
    five = plan_frames([0, 20, 40, 60, 80], [0, 10, 20, 30, 40], [10] * 5, 1000, 1000)
    assert [len(pieces(f)) for f in five] == [4, 1]
    assert plan_frames([], [], [], 10, 10) == []


@pytest.mark.parametrize("args, code, text", [
    (([0], [0, 1], [1]), StatusCode.ERR_INVALID_ARGS, "mismatch"),
    (([0], [95], [10]), StatusCode.ERR_INVALID_ARGS, "length out of range"),
    (([95], [0], [10]), StatusCode.ERR_INVALID_ARGS, "length out of range"),
    (([0], [0], [1 << 32]), StatusCode.ERR_INVALID_ARGS, "UINT32_MAX"),
])
def test_invalid_batches(args, code, text):
    for convert in (list, np.array):
        with pytest.raises(PlanError) as info:
            plan_frames(*(convert(a) for a in args), 100, 100)
        assert info.value.code == code and text in info.value.message


def test_negative_values_are_type_errors_like_pybind():
    with pytest.raises(TypeError):
        plan_frames([-1], [0], [1], 10, 10)
    with pytest.raises(TypeError):
        plan_frames(np.array([0] * 200), np.array([-1] * 200), np.array([1] * 200), 10, 10)


def test_oversized_merged_range_needs_chunking():
    big = MAX_MSG_SIZE // 2 + 1
    args = ([0, big], [0, big], [big, big], 4 * big, 4 * big)
    with pytest.raises(PlanError, match="max_msg_sz"):
        plan_frames(*args)
    frames = plan_frames(*args, allow_split=True)
    assert all(f[1] <= MAX_MSG_SIZE for f in frames) and sum(f[1] for f in frames) == 2 * big


def test_post_batches_spread_over_lanes_and_respect_the_send_queue():
    assert split_post_batches(8, 2, -1, 8192) == [(0, 4), (4, 8)]
    assert split_post_batches(5, 4, -1, 8192) == [(0, 2), (2, 4), (4, 5)]
    assert split_post_batches(5, 1, 2, 8192) == [(0, 2), (2, 4), (4, 5)]
    assert split_post_batches(6, 1, -1, 4) == [(0, 4), (4, 6)]


def test_invalid_large_batches_take_the_numpy_path():
    n = 200
    lo, ro, sz = np.arange(n) * 10, np.arange(n) * 10, np.full(n, 10)
    with pytest.raises(PlanError, match="length out of range"):
        plan_frames(lo, ro, sz, 10 * n, 10 * n - 1)
    sz[7] = 1 << 32
    with pytest.raises(PlanError, match="UINT32_MAX"):
        plan_frames(lo, ro, sz, 1 << 40, 1 << 40)
    assert plan_frames(lo, ro, np.full(n, 10), 10 * n, 10 * n) == [(0, 10 * n, 0)]
