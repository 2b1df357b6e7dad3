"""One side's registered memory on the GPU: a KV pool of torch tensors (one uint8 tensor per
registered buffer, viewed as bf16 [pages * page_size, values] by the forward) and a host aux buffer,
on a softio engine whose GPU registrations take the device path."""

from __future__ import annotations

import hashlib
import os
import tempfile
from types import SimpleNamespace

import numpy as np
import torch

import sglang_mori.softio as io
from sglang_mori.backend.plans import LocalBuffers, local_layout
from sglang_mori.engine import TransferEngine

from rig_device import ON_GPU, torch_device
from shapes import Shape, kv_args

AUX_BYTES = 64
AUX_SLOTS = 64


class DevicePool:
    """`shape` is this rank's share (Shape.sliced); `device` is the GPU, passed to the engine's
    registration as SGLang passes its `gpu_id`."""

    def __init__(self, role: str, shape: Shape, page_size: int, pages: int, device: int = 0, tp_rank: int = 0,
                 host_shared: bool = False):
        """`host_shared`: on the CPU check (no GPU), the KV buffers are files under /dev/shm, which
        a transfer process can map (transfer_process/pools.py); on a GPU it changes nothing."""
        self.shape, self.page_size, self.pages, self.device = shape, page_size, pages, device
        self.tp_rank = tp_rank
        self.item_len = page_size * shape.token_bytes
        self._shm_paths: list = []
        if host_shared and not ON_GPU:
            self.kv = [self._shared_buffer(pages * self.item_len) for _ in range(shape.buffers)]
        else:
            self.kv = [torch.zeros(pages * self.item_len, dtype=torch.uint8, device=torch_device(device))
                       for _ in range(shape.buffers)]
        self.aux = np.zeros(AUX_SLOTS * AUX_BYTES, np.uint8)
        self.engine = TransferEngine(io, role=role, host="127.0.0.1", qp_per_transfer=2, post_batch_size=-1,
                                     num_workers=1)
        self.args = kv_args(shape, page_size, [t.data_ptr() for t in self.kv], [t.numel() for t in self.kv],
                            self.aux.ctypes.data, self.aux.nbytes, AUX_BYTES)
        self.layout = local_layout(self.args, shape.tp_size, tp_rank, shape.is_mla)
        self.buffers = LocalBuffers(
            kv=[self.engine.register(t.data_ptr(), t.numel(), device if ON_GPU else -1, True) for t in self.kv],
            aux=[self.engine.register(self.aux.ctypes.data, self.aux.nbytes, -1, False)], state=[])
        self._pool = None

    def token_view(self, buffer: int) -> torch.Tensor:
        """Buffer `buffer` as the forward writes it: bf16 [token slots, values per token]."""
        return self.kv[buffer].view(torch.bfloat16).view(self.pages * self.page_size, self.shape.values_per_token)

    def pool(self) -> SimpleNamespace:
        """The pool object the layer-wise mapping reads (one object for the pool's life)."""
        if self._pool is None:
            layers = self.shape.layers
            self._pool = (SimpleNamespace(kv_buffer=self.kv, start_layer=0) if self.shape.is_mla else
                          SimpleNamespace(k_buffer=self.kv[:layers], v_buffer=self.kv[layers:], start_layer=0))
        return self._pool

    def digest(self, pages) -> str:
        """sha256 over every buffer's bytes of these pages, in order (source and destination agree
        exactly when every page landed byte for byte)."""
        index = torch.as_tensor(np.asarray(pages, dtype=np.int64), device=self.kv[0].device)
        h = hashlib.sha256()
        for t in self.kv:
            h.update(t.view(self.pages, self.item_len).index_select(0, index).cpu().numpy().tobytes())
        return h.hexdigest()

    def page_bytes(self, buffer: int, pages) -> torch.Tensor:
        """Buffer `buffer`'s bytes of these pages, [len(pages), item_len], on the pool's device."""
        index = torch.as_tensor(np.asarray(pages, dtype=np.int64), device=self.kv[0].device)
        return self.kv[buffer].view(self.pages, self.item_len).index_select(0, index)

    def page_mismatches(self, pages, expected_digests) -> int:
        return sum(self.digest([p]) != d for p, d in zip(pages, expected_digests))

    def _shared_buffer(self, nbytes: int) -> torch.Tensor:
        fd, path = tempfile.mkstemp(prefix="gpu-rig-kv-", dir="/dev/shm")
        os.close(fd)
        self._shm_paths.append(path)
        return torch.from_numpy(np.memmap(path, dtype=np.uint8, mode="w+", shape=(nbytes,)))

    def close(self) -> None:
        self.engine.deregister_all()
        for path in self._shm_paths:  # the mappings live on until the tensors go; the names go now
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self._shm_paths.clear()
