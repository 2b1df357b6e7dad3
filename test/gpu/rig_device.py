"""Where the rig's tensors live: "cuda" (the point of the rig), or "cpu" with
SGLANG_MORI_GPU_RIG_DEVICE=cpu, which runs the same rig logic on host memory and softio's host path
(no events, no streams) so that its bookkeeping can be checked on a machine without a GPU."""

from __future__ import annotations

import contextlib
import os

import torch

DEVICE = os.environ.get("SGLANG_MORI_GPU_RIG_DEVICE", "cuda")
ON_GPU = DEVICE == "cuda"


def synchronize() -> None:
    if ON_GPU:
        torch.cuda.synchronize()


def set_device() -> None:
    if ON_GPU:
        torch.cuda.set_device(0)


def generator(seed: int) -> torch.Generator:
    return torch.Generator(device=DEVICE).manual_seed(seed)


class _HostStream:
    def synchronize(self) -> None:
        pass


def stream(side: bool):
    if not ON_GPU:
        return _HostStream()
    return torch.cuda.Stream() if side else torch.cuda.current_stream()


def on_stream(s):
    return torch.cuda.stream(s) if ON_GPU else contextlib.nullcontext()


def sleep_cycles(cycles: int) -> None:
    if ON_GPU:
        torch.cuda._sleep(cycles)
