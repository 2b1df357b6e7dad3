"""The decode side of the GPU rig, in its own process (as in a deployment: its threads do not share
the prefill's GIL): a KV pool on the GPU, this project's DecodeService with its status thread on a
real ZMQ PULL socket, and SGLang's per-room tables stood in by FakeSGLang.

The parent drives it over a multiprocessing pipe with small commands (`serve`): open rooms (new
receivers and their RoomMetadata for the prefill), digests of pages (byte checks), a decode step
loop timed while the prefill transfers (interference on decode), per-thread CPU.
"""

from __future__ import annotations

import time

import numpy as np


def serve(conn, shape_key: str, page_size: int, pages: int, config_kwargs: dict, paths: list,
          device: int = 0) -> None:
    """Decode TP 1 on GPU `device`, whatever the prefill's TP (its ranks write head slices)."""
    import faulthandler
    import sys

    faulthandler.enable()  # a native crash in the child must leave its stack in the log
    sys.path[:0] = [p for p in paths if p not in sys.path]
    import zmq

    from sglang_mori import protocol
    from sglang_mori.backend.decode.service import AuxSlots, DecodeIdentity, DecodeParts, DecodeService
    from sglang_mori.backend.messenger import Messenger
    from sglang_mori.config import MoriConfig
    from sglang_mori.metrics import NullTransferMetrics

    from device_pool import AUX_BYTES, DevicePool
    from fake_sglang import FakeSGLang
    from shapes import SHAPES
    from thread_roles import ThreadCpu
    import rig_device

    rig_device.set_device(device)
    shape = SHAPES[shape_key]
    pool = DevicePool("decode", shape, page_size, pages, device=device)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    sglang = FakeSGLang()
    rejections: list = []
    service = DecodeService(DecodeParts(
        config=MoriConfig(**config_kwargs), engine=pool.engine, local=pool.buffers, layout=pool.layout,
        identity=DecodeIdentity("127.0.0.1", port, 1, 0),
        aux=AuxSlots(list(pool.args.aux_data_ptrs), [AUX_BYTES], [pool.aux.nbytes]),
        messenger=Messenger(ctx), metrics=NullTransferMetrics(), sglang=sglang, control_socket=sock,
    ), lambda err, origin: rejections.append(str(err)))
    service.start()
    conn.send(protocol.encode(service.registration()))
    cpu = ThreadCpu()
    # The loop polls our inbox once per step, as SGLang's decode loop polls its receivers: the
    # messages prefill sent are then applied on the loop's thread, and their cost is in the loop's time.
    step = _DecodeStep(shape.layers, poll=service.poll_inbox)
    try:
        while True:
            cmd, arg = conn.recv()
            if cmd == "stop":
                break
            if cmd == "open":  # arg: ([(room, decode pages)], [is_dummy per prefill rank])
                out = []
                rooms, dummies = arg
                for room, dst_pages in rooms:
                    sglang.open(room)
                    service.new_receiver(room)
                    # what the receiver sends each prefill rank it pairs with (SGLang's receiver:
                    # with MLA and prefill TP > decode TP, all but the first get dummy metadata)
                    out.append([protocol.encode(service.record_destination(
                        bootstrap_room=room, required_dst_info_num=1, kv_indices=np.asarray(dst_pages),
                        aux_index=room % 64, state_indices=None, decode_prefix_len=None, is_dummy=dummy))
                        for dummy in dummies])
                conn.send(out)
            elif cmd == "statuses":
                conn.send({room: sglang.status(room) for room in arg})
            elif cmd == "clear":
                for room in arg:
                    service.forget(room, service.p.rooms.attempt_of(room) or 0)
                    sglang.clear(room)
                conn.send(None)
            elif cmd == "digests":
                rig_device.synchronize()
                conn.send([pool.digest([p]) for p in arg])
            elif cmd == "devices":  # (device ids in the KV registrations, devices the KV tensors are on)
                conn.send(([d.device_id for d in pool.buffers.kv], sorted({t.device.index for t in pool.kv})))
            elif cmd == "digest":
                rig_device.synchronize()
                conn.send(pool.digest(arg))
            elif cmd == "steps":
                conn.send(step.run(int(arg)))
            elif cmd == "steps_start":  # a step loop beside the command loop (transfers arrive meanwhile)
                step.start(int(arg))
                conn.send(None)
            elif cmd == "steps_done":  # has the step loop beside the command loop ended?
                conn.send(step.done())
            elif cmd == "steps_result":
                conn.send(step.result(float(arg or 120)))
            elif cmd == "cpu_reset":
                cpu = ThreadCpu()
                conn.send(None)
            elif cmd == "cpu":
                conn.send(cpu.since())
            elif cmd == "rejections":
                conn.send(list(rejections))
            else:
                conn.send(RuntimeError(f"unknown command {cmd!r}"))
    finally:
        service.stop()
        pool.close()
        sock.close(0)
        ctx.term()


class _DecodeStep:
    """A stand-in decode step: per layer three small GEMMs (batch 32), launch-bound like a real
    decode step of a small batch; then `poll` (our inbox), as SGLang's loop polls its receivers."""

    def __init__(self, layers: int, hidden: int = 0, batch: int = 32, poll=None):
        import torch

        from rig_device import DEVICE, ON_GPU, synchronize

        hidden = hidden or (2048 if ON_GPU else 64)

        self.sync = synchronize
        self.poll = poll or (lambda: None)
        self.layers = layers
        self.x = torch.randn(batch, hidden, device=DEVICE, dtype=torch.bfloat16)
        self.w = [torch.randn(hidden, hidden, device=DEVICE, dtype=torch.bfloat16) * 0.02 for _ in range(3)]

    def once(self) -> None:
        x = self.x
        for _ in range(self.layers):
            for w in self.w:
                x = x @ w

    def start(self, steps: int) -> None:
        import threading

        self._out = []
        self._thread = threading.Thread(target=lambda: self._out.extend(self.run(steps)), name="decode-steps")
        self._thread.start()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self, timeout_s: float) -> list:
        self._thread.join(timeout_s)
        return list(self._out)

    def run(self, steps: int) -> list:
        """Wall time of each loop pass (ms): a step ended by a device synchronize, then the poll."""
        for _ in range(3):
            self.once()
        self.sync()
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            self.once()
            self.sync()
            self.poll()
            times.append((time.perf_counter() - t0) * 1e3)
        return times
