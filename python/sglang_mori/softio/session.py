"""One (local region, remote region) pair and how a transfer on it is posted.

This mirrors MORI's RdmaBackendSession: the status goes IN_PROGRESS inside the call; the whole
batch is validated before anything is sent; frames are split into post-batches spread over the
lanes starting at `uid % lanes`; each post-batch reserves send-queue slots (blocking up to the
backoff when the queue is full). A failure at post-batch i > 0 leaves the earlier batches posted:
their bytes still land although the status has already failed.
"""

from __future__ import annotations

import time

from .batch_plan import PlanError, plan_frames, split_post_batches
from .enums import StatusCode
from .lanes import Completion, PostBatch
from .wire import OP_NOTIFY, OP_READ, OP_WRITE

_SUCCESS = StatusCode.SUCCESS
_ERR_RDMA_OP = StatusCode.ERR_RDMA_OP


class SoftSession:
    def __init__(self, backend, peer, local_region, remote_id: int, remote_size: int):
        self.backend = backend
        self.peer = peer
        self.local = local_region
        self.remote_id = remote_id
        self.remote_size = remote_size

    def transfer(self, local_offsets, remote_offsets, sizes, status, uid: int,
                 is_read: bool) -> None:
        status._start()
        try:
            frames = plan_frames(local_offsets, remote_offsets, sizes, self.local.size,
                                 self.remote_size, self.backend.settings.max_sge,
                                 allow_split=self.backend.chunking)
        except PlanError as exc:
            status.Update(exc.code, exc.message)
            return
        if not frames:
            status.Update(_SUCCESS, "")
            return
        peer = self.peer
        if peer.shape_frames is not None:
            frames = peer.shape_frames(frames)  # the lanes' own framing rule (intra-host cuts)
        if peer.broken is not None:
            # A QP in error state is not rebuilt: every later submission to the peer fails.
            status.Update(_ERR_RDMA_OP, f"EP is degraded, rejecting new submissions "
                                        f"(peer {peer.key}: {peer.broken})")
            return
        self._post(frames, status, uid, OP_READ if is_read else OP_WRITE)

    def _post(self, frames: list, status, uid: int, op: int) -> None:
        settings = self.backend.settings
        faults = self.backend.core.faults
        lanes = self.peer.lanes
        nlanes = len(lanes)
        sq_depth = settings.sq_depth
        batches = split_post_batches(len(frames), nlanes, settings.post_batch_size, sq_depth)
        nbatches = len(batches)

        # Which batches carry a signal (the last one per lane, or when the SQ would fill up),
        # decided up front so the completion knows how many ACKs make the transfer complete.
        first_lane = uid % nlanes
        layout = []
        since = [0] * nlanes
        signals = 0
        for i, (start, end) in enumerate(batches):
            lane = (i + first_lane) % nlanes
            since[lane] += end - start
            signaled = i + nlanes >= nbatches or since[lane] >= sq_depth
            layout.append((lane, signaled, since[lane] if signaled else 0))
            if signaled:
                since[lane] = 0
                signals += 1
        completion = Completion(status, signals)

        allowed = nbatches
        not_before = 0.0
        backoff = settings.sq_backoff_s
        if faults.active:
            if nbatches > 1:
                limit = faults.take_partial_post()
                if limit is not None and limit < nbatches:
                    allowed = limit
            if faults.latency_s > 0:
                not_before = time.monotonic() + faults.latency_s

        view = self.local.view
        unsignaled = [0] * nlanes  # posted slots not yet covered by a signal, per lane
        for i, (start, end) in enumerate(batches):
            lane_index, signaled, release = layout[i]
            lane = lanes[lane_index]
            if i >= allowed:
                status.Update(_ERR_RDMA_OP,
                              f"ibv_post_send failed with 12: Cannot allocate memory (posted "
                              f"0/{end - start} WRs) on ep {lane_index} at post-batch {i} "
                              f"[fault injection: partial_post]")
                self._fence(unsignaled)
                return
            error = lane.reserve(end - start, backoff)
            if error is not None:
                status.Update(_ERR_RDMA_OP, error)
                self._fence(unsignaled)
                return
            unsignaled[lane_index] = 0 if signaled else unsignaled[lane_index] + end - start
            lane.post(PostBatch(op, frames[start:end], view, self.remote_id, signaled, release,
                                completion, not_before, self.local.ptr))
        if self.backend.settings.enable_notification:
            for lane in lanes:
                lane.post(PostBatch(OP_NOTIFY, (uid, nlanes), None, 0, False, 0, None))

    def _fence(self, unsignaled: list) -> None:
        """After a failed post, signal what was posted unsignaled so its SQ slots come back.

        The fence is an empty write into the remote region: it moves no byte, but its ACK proves
        the earlier frames on that lane landed, and frees their slots.
        """
        for lane_index, count in enumerate(unsignaled):
            if count:
                self.peer.lanes[lane_index].post(PostBatch(
                    OP_WRITE, [(0, 0, 0)], self.local.view, self.remote_id, True, count, None,
                    local_ptr=self.local.ptr))
