"""The sgl_kernel entry points a plain Llama forward reaches on CUDA, in torch.

Signatures follow sgl_kernel's Python API as SGLang calls it (layers/layernorm.py, layers/activation.py,
breakable_cuda_graph.py). Arithmetic is float32 internally, cast to the input dtype at the end, as the
CUDA kernels do. All of it is plain tensor work on the caller's stream, so CUDA graphs capture it.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def _normed(x32: torch.Tensor, eps: float) -> torch.Tensor:
    return x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)


def _into(result: torch.Tensor, out: Optional[torch.Tensor]) -> torch.Tensor:
    if out is None:
        return result
    out.copy_(result)
    return out


def rmsnorm(input: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
            out: Optional[torch.Tensor] = None, enable_pdl: Optional[bool] = None) -> torch.Tensor:
    result = (_normed(input.float(), eps) * weight.float()).to(input.dtype)
    return _into(result, out)


def fused_add_rmsnorm(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float = 1e-6, enable_pdl: Optional[bool] = None) -> None:
    """In place: residual <- input + residual; input <- rmsnorm(residual) * weight."""
    summed = input.float() + residual.float()
    residual.copy_(summed.to(residual.dtype))
    input.copy_((_normed(summed, eps) * weight.float()).to(input.dtype))


def gemma_rmsnorm(input: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                  out: Optional[torch.Tensor] = None, enable_pdl: Optional[bool] = None) -> torch.Tensor:
    result = (_normed(input.float(), eps) * (1.0 + weight.float())).to(input.dtype)
    return _into(result, out)


def gemma_fused_add_rmsnorm(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                            eps: float = 1e-6, enable_pdl: Optional[bool] = None) -> None:
    summed = input.float() + residual.float()
    residual.copy_(summed.to(residual.dtype))
    input.copy_((_normed(summed, eps) * (1.0 + weight.float())).to(input.dtype))


def _gated(input: torch.Tensor, act, out: Optional[torch.Tensor]) -> torch.Tensor:
    d = input.shape[-1] // 2
    x32 = input.float()
    result = (act(x32[..., :d]) * x32[..., d:]).to(input.dtype)
    return _into(result, out)


def silu_and_mul(input: torch.Tensor, out: Optional[torch.Tensor] = None,
                 enable_pdl: Optional[bool] = None) -> torch.Tensor:
    return _gated(input, F.silu, out)


def gelu_and_mul(input: torch.Tensor, out: Optional[torch.Tensor] = None,
                 enable_pdl: Optional[bool] = None) -> torch.Tensor:
    return _gated(input, lambda t: F.gelu(t, approximate="none"), out)


def gelu_tanh_and_mul(input: torch.Tensor, out: Optional[torch.Tensor] = None,
                      enable_pdl: Optional[bool] = None) -> torch.Tensor:
    return _gated(input, lambda t: F.gelu(t, approximate="tanh"), out)


def concat_mla_k(k: torch.Tensor, k_nope: torch.Tensor, k_rope: torch.Tensor) -> None:
    """DeepSeek MHA prefill: k[..., :nope] = k_nope; k[..., nope:] = k_rope (one head, broadcast)."""
    nope = k_nope.shape[-1]
    k[..., :nope].copy_(k_nope)
    k[..., nope:].copy_(k_rope.expand(*k.shape[:-1], k_rope.shape[-1]))


def weak_ref_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor over the same memory. sgl_kernel's returns one that does not keep the storage alive
    (so the breakable prefill graph's pool can reuse a segment's intermediates); this one does, which
    costs graph-pool memory but keeps every captured address valid, so replays read what capture saw.
    """
    return tensor.detach()
