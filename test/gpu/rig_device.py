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


def set_device(device: int = 0) -> None:
    if ON_GPU:
        torch.cuda.set_device(device)


def torch_device(device: int | None = None) -> str:
    """The torch device of GPU `device` (None: the current one); "cpu" for the CPU check."""
    return DEVICE if not ON_GPU or device is None else f"cuda:{device}"


def generator(seed: int, device: int | None = None) -> torch.Generator:
    return torch.Generator(device=torch_device(device)).manual_seed(seed)


def gpu_count() -> int:
    return torch.cuda.device_count() if ON_GPU else 1


class _HostStream:
    def synchronize(self) -> None:
        pass


def stream(side: bool, device: int | None = None):
    if not ON_GPU:
        return _HostStream()
    return torch.cuda.Stream(device=device) if side else torch.cuda.current_stream(device)


def on_stream(s):
    return torch.cuda.stream(s) if ON_GPU else contextlib.nullcontext()


def on_device(device: int | None):
    """Make `device` current for the block (the forward of one TP rank)."""
    return torch.cuda.device(device) if ON_GPU and device is not None else contextlib.nullcontext()


def sleep_cycles(cycles: int) -> None:
    if ON_GPU:
        torch.cuda._sleep(cycles)
