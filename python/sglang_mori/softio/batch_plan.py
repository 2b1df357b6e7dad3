"""Validate a batch and turn it into frames, the way MORI builds work requests.

All-or-nothing: any invalid entry fails the whole batch before anything is sent. Entries are sorted
by remote offset; neighbours contiguous on both sides merge into one piece; a remote-contiguous
neighbour that is not local-contiguous is gathered into the same frame as another piece (an SGE),
up to `max_sge` pieces. A frame is `(remote_offset, total_bytes, local)` where `local` is the local
offset of a single piece or a tuple of `(local_offset, length)` pieces.
"""

from __future__ import annotations

import numpy as np

from .enums import StatusCode

UINT32_MAX = 0xFFFFFFFF
MAX_MSG_SIZE = 1 << 31  # port max_msg_sz of common RDMA NICs; a merged WR may not exceed it
_NUMPY_THRESHOLD = 128  # below this many entries plain Python is faster than numpy


class PlanError(Exception):
    def __init__(self, code: StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def _as_int_list(values) -> list:
    if isinstance(values, np.ndarray):
        return values.tolist()
    out = list(values)
    for v in out:
        if type(v) is not int:
            break
    else:
        return out
    return [int(v) for v in out]


def _check_non_negative(*lists) -> None:
    for values in lists:
        if values and min(values) < 0:
            # pybind rejects negative size_t arguments before MORI sees them.
            raise TypeError("offsets and sizes must be non-negative integers")


def plan_frames(local_offsets, remote_offsets, sizes, local_len: int, remote_len: int,
                max_sge: int = 4, allow_split: bool = False) -> list:
    """Frames for one transfer, or PlanError with MORI's status code and message."""
    n = len(sizes)
    if len(local_offsets) != len(remote_offsets) or n != len(remote_offsets):
        raise PlanError(StatusCode.ERR_INVALID_ARGS,
                        "lengths of local offsets, remote offsets or sizes mismatch")
    if n == 0:
        return []
    if n >= _NUMPY_THRESHOLD:
        frames = _plan_numpy(local_offsets, remote_offsets, sizes, local_len, remote_len, max_sge)
    else:
        lo, ro, sz = _as_int_list(local_offsets), _as_int_list(remote_offsets), _as_int_list(sizes)
        _check_non_negative(lo, ro, sz)
        _validate_python(lo, ro, sz, local_len, remote_len)
        frames = _merge_python(lo, ro, sz, max_sge)
    return _limit_message_size(frames, allow_split)


def _validate_python(lo, ro, sz, local_len, remote_len) -> None:
    for l, r, s in zip(lo, ro, sz):
        if s > UINT32_MAX:
            raise PlanError(StatusCode.ERR_INVALID_ARGS,
                            f"single request size {s} exceeds UINT32_MAX; split it before submitting")
        if l + s > local_len or r + s > remote_len:
            raise PlanError(StatusCode.ERR_INVALID_ARGS, "length out of range")


def _merge_python(lo, ro, sz, max_sge) -> list:
    order = range(len(sz))
    if any(ro[i] > ro[i + 1] for i in range(len(ro) - 1)):
        order = sorted(order, key=ro.__getitem__)
    frames = []
    cur_remote = cur_total = -1
    pieces = None  # list of [local_offset, length] of the open frame
    for i in order:
        l, r, s = lo[i], ro[i], sz[i]
        if pieces is not None and r == cur_remote + cur_total:
            last = pieces[-1]
            if last[0] + last[1] == l and last[1] + s <= UINT32_MAX:
                last[1] += s
                cur_total += s
                continue
            if len(pieces) < max_sge:
                pieces.append([l, s])
                cur_total += s
                continue
        if pieces is not None:
            frames.append(_close(cur_remote, cur_total, pieces))
        cur_remote, cur_total, pieces = r, s, [[l, s]]
    frames.append(_close(cur_remote, cur_total, pieces))
    return frames


def _close(remote: int, total: int, pieces: list) -> tuple:
    if len(pieces) == 1:
        return (remote, total, pieces[0][0])
    return (remote, total, tuple((p[0], p[1]) for p in pieces))


def _plan_numpy(local_offsets, remote_offsets, sizes, local_len, remote_len, max_sge) -> list:
    try:
        lo = np.asarray(local_offsets, dtype=np.int64)
        ro = np.asarray(remote_offsets, dtype=np.int64)
        sz = np.asarray(sizes, dtype=np.int64)
    except (OverflowError, ValueError, TypeError):
        raise TypeError("offsets and sizes must be non-negative integers") from None
    if lo.ndim != 1 or ro.ndim != 1 or sz.ndim != 1:
        raise TypeError("offsets and sizes must be flat sequences of integers")
    if lo.min() < 0 or ro.min() < 0 or sz.min() < 0:
        raise TypeError("offsets and sizes must be non-negative integers")
    big = sz > UINT32_MAX
    if big.any():
        s = int(sz[np.argmax(big)])
        raise PlanError(StatusCode.ERR_INVALID_ARGS,
                        f"single request size {s} exceeds UINT32_MAX; split it before submitting")
    if ((lo + sz) > local_len).any() or ((ro + sz) > remote_len).any():
        raise PlanError(StatusCode.ERR_INVALID_ARGS, "length out of range")
    if (ro[1:] < ro[:-1]).any():
        order = np.argsort(ro)  # order among equal remote offsets is undefined in MORI too
        lo, ro, sz = lo[order], ro[order], sz[order]
    # Runs of entries contiguous on both sides become single pieces.
    remote_next = ro[1:] == ro[:-1] + sz[:-1]
    joined = remote_next & (lo[1:] == lo[:-1] + sz[:-1])
    starts = np.flatnonzero(np.concatenate(([True], ~joined)))
    run_len = np.add.reduceat(sz, starts)
    if (run_len > UINT32_MAX).any():
        # A piece would exceed an SGE's 32-bit length: follow the exact greedy rule instead.
        return _merge_python(lo.tolist(), ro.tolist(), sz.tolist(), max_sge)
    run_lo, run_ro = lo[starts], ro[starts]
    # A run continues the previous frame as another SGE when remote-contiguous with it and the
    # frame has room: position within a remote-contiguous chain, modulo max_sge, opens frames.
    chain_start = np.concatenate(([True], ~remote_next[starts[1:] - 1]))
    idx = np.arange(len(starts))
    first_of_chain = np.maximum.accumulate(np.where(chain_start, idx, 0))
    opens = ((idx - first_of_chain) % max_sge) == 0
    frame_starts = np.flatnonzero(opens)
    totals = np.add.reduceat(run_len, frame_starts).tolist()
    remotes = run_ro[frame_starts].tolist()
    if len(frame_starts) == len(starts):
        return list(zip(remotes, totals, run_lo.tolist()))
    bounds = frame_starts.tolist() + [len(starts)]
    los, lens = run_lo.tolist(), run_len.tolist()
    frames = []
    for k, (a, b) in enumerate(zip(bounds, bounds[1:])):
        local = los[a] if b - a == 1 else tuple(zip(los[a:b], lens[a:b]))
        frames.append((remotes[k], totals[k], local))
    return frames


def _limit_message_size(frames: list, allow_split: bool) -> list:
    for k, (remote, total, local) in enumerate(frames):
        if total > MAX_MSG_SIZE:
            break
    else:
        return frames
    if not allow_split:
        raise PlanError(StatusCode.ERR_INVALID_ARGS,
                        f"merged RDMA WR {k} length {total} exceeds local max_msg_sz "
                        f"{MAX_MSG_SIZE}; enable RDMA transfer chunking or reduce batch size")
    out = []
    for remote, total, local in frames:
        pieces = [(local, total)] if type(local) is int else list(local)
        for lo, length in pieces:
            done = 0
            while done < length:
                step = min(MAX_MSG_SIZE, length - done)
                out.append((remote, step, lo + done))
                remote += step
                done += step
    return out


def split_post_batches(frame_count: int, lanes: int, post_batch_size: int, sq_depth: int) -> list:
    """[(start, end)] post-batches: ceil(frames/lanes) per batch by default, capped by SQ depth."""
    per_lane = (frame_count + lanes - 1) // lanes
    size = per_lane if post_batch_size == -1 else post_batch_size
    size = max(1, min(size, sq_depth))
    return [(s, min(s + size, frame_count)) for s in range(0, frame_count, size)]
