"""Stand-in for SGLang's `sgl_kernel` on the GPU machine (scripts/gpu_stubs/README.md says why).

Implemented (torch, so CUDA-graph capturable): the norms, gated activations and `weak_ref_tensor` a
Llama-shaped forward calls. Everything else is a name that raises when called.
"""

from stub_missing import install_submodule_finder

from .kernels import (  # noqa: F401
    concat_mla_k,
    fused_add_rmsnorm,
    gelu_and_mul,
    gelu_tanh_and_mul,
    gemma_fused_add_rmsnorm,
    gemma_rmsnorm,
    rmsnorm,
    silu_and_mul,
    weak_ref_tensor,
)

__version__ = "0.0.0+gpu-stand-in"
STAND_IN = True

install_submodule_finder(__name__)


def __getattr__(name):
    from stub_missing import Missing

    if name.startswith("__") and name.endswith("__"):
        raise AttributeError(name)
    return Missing(f"{__name__}.{name}")
