"""The decode side of the GPU rig, in its own process (as in a deployment: its threads do not share
the prefill's GIL): a KV pool on the GPU, this project's DecodeService with its status thread on a
real ZMQ PULL socket, and SGLang's per-room tables stood in by FakeSGLang.

The parent drives it over a multiprocessing pipe with small commands (`serve`): open rooms (new
receivers and their RoomMetadata for the prefill), digests of pages (byte checks), a decode step
loop timed while the prefill transfers (interference on decode), per-thread CPU and the CPU inside
our calls (decode_calls.py).
"""

from __future__ import annotations

import os
import time

import numpy as np

WARM_STEPS = 20  # untimed steps before a window's timed ones (_DecodeStep.run)
CPU_LAYERS = 6  # the stand-in step's layers on the rig's CPU check (a step of a few ms there)


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

    from decode_calls import SCHEDULER_CALLS, STEP_CALLS, TimedCalls
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
    _check_arrival_mode(service, config_kwargs)
    conn.send(protocol.encode(service.registration()))
    cpu = ThreadCpu()
    # Thread CPU inside our calls (the scheduler's: receiver init, metadata, clear; the step loop's
    # poll), apart from the rig's command handling on the same thread
    calls = TimedCalls(service, SCHEDULER_CALLS + STEP_CALLS)
    # The loop polls our inbox once per step, as SGLang's decode loop polls its receivers: the
    # messages prefill sent are then applied on the loop's thread, and their cost is in the loop's time.
    # (On the CPU check, a few layers: a step of a few ms, as on the GPU, so the poll comes as often
    # relative to the inbox's poller timing, POLLER_ACTIVE_S, as it does there.)
    step = _DecodeStep(shape.layers if rig_device.ON_GPU else CPU_LAYERS, poll=service.poll_inbox)
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
                    metadata = [service.record_destination(
                        bootstrap_room=room, required_dst_info_num=1, kv_indices=np.asarray(dst_pages),
                        aux_index=room % 64, state_indices=None, decode_prefix_len=None, is_dummy=dummy)
                        for dummy in dummies]
                    # the frames the receiver sends (ours in a deployment: receiver.py encodes them)
                    t0 = time.thread_time()
                    out.append([protocol.encode(m) for m in metadata])
                    calls.add("encode", time.thread_time() - t0, len(metadata))
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
            elif cmd == "steps_run":
                # A step loop on its own thread while prefill's transfers arrive: this thread only
                # waits in the join (no GIL), so in every window kind the step loop competes with
                # our status thread alone, never with the rig's commands. Answers when the loop
                # ends: (step times in ms, {thread role: CPU s} of this process over the loop,
                # {reader: prefill's messages read} over the loop: the step loop's polls, our thread).
                window_cpu, used = ThreadCpu(), {}
                read0 = _messages_read(service)
                # The arrival watcher (SGLANG_MORI_DECODE_ARRIVAL_FLAG=process) is a child process:
                # its CPU is no thread's of this process, but ours, counted as one more role.
                watcher0 = _watcher_cpu_s(service)

                def ended():  # (read by the step thread as it ends: an ended thread's CPU is gone from /proc)
                    used.update(window_cpu.since())
                    if watcher0 is not None:
                        used[WATCHER_ROLE] = _watcher_cpu_s(service) - watcher0

                step.start(int(arg), on_end=ended)
                times = step.result(150)
                read = {k: v - read0[k] for k, v in _messages_read(service).items()}
                conn.send((times, used, read))
            elif cmd == "calls":  # our calls' CPU by name since the last "calls" (decode_calls.py)
                conn.send(calls.take())
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


WATCHER_ROLE = "arrival-watcher (child process)"


def _check_arrival_mode(service, config_kwargs: dict) -> None:
    """A run asked for the watcher process must have one: fail by name, not measure `off` under
    `process`'s label (the inbox falls back to plain looks when the child cannot start)."""
    if str(config_kwargs.get("decode_arrival_flag", "")).lower() != "process":
        return
    watcher = getattr(service.inbox, "_watcher", None)
    if watcher is None or not watcher.alive():
        raise RuntimeError("SGLANG_MORI_DECODE_ARRIVAL_FLAG=process: decode's inbox has no running "
                           "arrival watcher process (see the log's warning)")
    print(f"decode: arrival watcher process pid {watcher.pid}", flush=True)


def _watcher_cpu_s(service):
    """The watcher child's CPU seconds (the scheduler's ns count, /proc/PID/schedstat: clock ticks
    would be a few per window), None without one."""
    watcher = getattr(service.inbox, "_watcher", None)
    if watcher is None:
        return None
    try:
        with open(f"/proc/{watcher.pid}/schedstat") as f:
            ns = int(f.read().split()[0])
        if ns > 0:  # (some kernels report 0 there: then the clock ticks of /proc/PID/stat)
            return ns / 1e9
        with open(f"/proc/{watcher.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def _messages_read(service) -> dict:
    inbox = service.inbox
    # (+ poll_looks: the polls that looked at the socket itself, where the build counts them: every
    # step with `off`, about one per arrival with the watcher unless something else sets its byte)
    return {"by_poll": inbox.by_poller if inbox else 0, "by_thread": inbox.by_thread if inbox else 0,
            "poll_looks": getattr(inbox, "poller_looks", 0) if inbox else 0}


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

    def start(self, steps: int, on_end=None) -> None:
        """The loop on a thread "decode-steps"; `on_end` runs on that thread after the last step."""
        import threading

        def body():
            self._out.extend(self.run(steps))
            if on_end is not None:
                on_end()

        self._out = []
        self._thread = threading.Thread(target=body, name="decode-steps")
        self._thread.start()

    def result(self, timeout_s: float) -> list:
        self._thread.join(timeout_s)
        return list(self._out)

    def run(self, steps: int) -> list:
        """Wall time of each loop pass (ms): a step ended by a device synchronize, then the poll."""
        # Warm steps before the timed ones: the window's first steps after an idle gap (the GPU's
        # clocks, the launch path's caches) are not what the load costs.
        for _ in range(WARM_STEPS):
            self.once()
            self.sync()
            self.poll()
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            self.once()
            self.sync()
            self.poll()
            times.append((time.perf_counter() - t0) * 1e3)
        return times
