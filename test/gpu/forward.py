"""A stand-in prefill forward that launches per layer what a real one launches: a QKV GEMM (query columns plus the layer's KV), the
layer's KV store into the pool by token slot (index_copy_, as SGLang's set_kv_buffer does), and two
MLP GEMMs. Launch-bound at short prompts, GPU-bound at long ones (hidden 2048, bf16).

With `hooked`, the forward runs through hooks.py exactly as SGLang's would: `around_run_batch`
around the whole forward and `around_attention_forward` around each layer's attention (which does
the KV store), so the layer-wise session publishes the batch, sees each layer, and the worker
waits on the device event recorded after the store. `store_delay_cycles` delays each store on its
stream (torch.cuda._sleep): a copy that does not wait for the event reads the old bytes.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from sglang_mori.backend.prefill.layerwise import hooks

from rig_device import ON_GPU, generator, sleep_cycles, torch_device

HIDDEN = 2048 if ON_GPU else 64  # the CPU check only exercises the bookkeeping


class StandInModel:
    def __init__(self, shape, hidden: int = HIDDEN, seed: int = 0, device: int | None = None):
        self.device = device
        where = torch_device(device)
        g = generator(seed, device)
        self.shape = shape
        dt = torch.bfloat16
        kv_cols = len(shape.buffers_of_layer(0)) * shape.values_per_token  # K and V (GQA) or the latent (MLA)
        self.w_qkv = torch.randn(hidden, hidden + kv_cols, device=where, dtype=dt, generator=g) * hidden ** -0.5
        self.w_up = torch.randn(hidden, 4 * hidden, device=where, dtype=dt, generator=g) * hidden ** -0.5
        self.w_down = torch.randn(4 * hidden, hidden, device=where, dtype=dt, generator=g) * (4 * hidden) ** -0.5
        self.hidden = hidden
        self._extend = SimpleNamespace(is_extend=lambda: True)
        self._backend = SimpleNamespace()  # no pool of its own: the hook uses the scheduler's
        self._layers = [SimpleNamespace(layer_id=i) for i in range(shape.layers)]

    def inputs(self, tokens: int, seed: int) -> torch.Tensor:
        return torch.randn(tokens, self.hidden, device=torch_device(self.device), dtype=torch.bfloat16,
                           generator=generator(seed, self.device))

    def forward(self, x: torch.Tensor, pool, slots: torch.Tensor, *, hooked: bool, side=None, scheduler=None,
                batch=None, store_delay_cycles: int = 0) -> torch.Tensor:
        """Run every layer; `slots` are the token slots (req_to_token entries) of x's rows."""
        if hooked:
            return hooks.around_run_batch(
                lambda _scheduler, _batch: self._layers_pass(x, pool, slots, True, store_delay_cycles),
                scheduler, batch)
        return self._layers_pass(x, pool, slots, False, store_delay_cycles)

    def _layers_pass(self, x, pool, slots, hooked: bool, delay: int):
        shape = self.shape
        n = shape.values_per_token
        h = self.hidden
        fb = SimpleNamespace(forward_mode=self._extend)
        for layer in range(shape.layers):
            qkv = x @ self.w_qkv
            buffers = shape.buffers_of_layer(layer)

            def attention(backend, q, k, v, layer_obj, forward_batch, buffers=buffers, qkv=qkv):
                if delay:
                    sleep_cycles(delay)
                for j, b in enumerate(buffers):
                    pool.token_view(b).index_copy_(0, slots, qkv[:, h + j * n:h + (j + 1) * n])
                return q

            if hooked:
                hooks.around_attention_forward(attention, self._backend, qkv, None, None, self._layers[layer], fb)
            else:
                attention(self._backend, qkv, None, None, self._layers[layer], fb)
            x = torch.tanh((x @ self.w_up) @ self.w_down)
        return x
