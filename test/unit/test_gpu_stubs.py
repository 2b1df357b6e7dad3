"""The GPU stand-ins for SGLang's kernel packages (scripts/gpu_stubs): the torch kernels compute what
sgl_kernel's do (against float64 formulas), and every name they do not implement fails by name when
called, never silently. Run on CPU tensors; the GPU runs (scripts/gpu_sglang) use the same code."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

STUBS = Path(__file__).resolve().parents[2] / "scripts" / "gpu_stubs"


@pytest.fixture(scope="module")
def sk():
    sys.path.insert(0, str(STUBS))
    try:
        import sgl_kernel

        yield sgl_kernel
    finally:
        sys.path.remove(str(STUBS))
        for name in [m for m in sys.modules if m == "sgl_kernel" or m.startswith("sgl_kernel.")]:
            del sys.modules[name]


def rel_err(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


def ref_rmsnorm(x, w, eps, gemma=False):
    x = x.double()
    scale = (1.0 + w.double()) if gemma else w.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * scale


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("gemma", [False, True])
def test_rmsnorm_matches_formula_and_fills_out(sk, dtype, tol, gemma):
    x, w = torch.randn(7, 96).to(dtype), torch.randn(96).to(dtype)
    fn = sk.gemma_rmsnorm if gemma else sk.rmsnorm
    out = torch.full_like(x, float("nan"))
    got = fn(x, w, 1e-5, out=out)
    assert got is out and got.dtype == dtype and not torch.isnan(out).any()
    assert rel_err(out, ref_rmsnorm(x, w, 1e-5, gemma)) < tol
    assert rel_err(fn(x, w, 1e-5), ref_rmsnorm(x, w, 1e-5, gemma)) < tol


@pytest.mark.parametrize("gemma", [False, True])
def test_fused_add_rmsnorm_updates_both_in_place(sk, gemma):
    x, r, w = torch.randn(5, 64), torch.randn(5, 64), torch.randn(64)
    summed = x.double() + r.double()
    fn = sk.gemma_fused_add_rmsnorm if gemma else sk.fused_add_rmsnorm
    assert fn(x, r, w, 1e-6) is None
    assert rel_err(r, summed) < 1e-6
    assert rel_err(x, ref_rmsnorm(summed, w, 1e-6, gemma)) < 1e-6


@pytest.mark.parametrize("name, act", [
    ("silu_and_mul", F.silu),
    ("gelu_and_mul", lambda t: F.gelu(t)),
    ("gelu_tanh_and_mul", lambda t: F.gelu(t, approximate="tanh")),
])
def test_gated_activations(sk, name, act):
    x = torch.randn(3, 4, 2 * 48)
    ref = act(x.double()[..., :48]) * x.double()[..., 48:]
    out = torch.full((3, 4, 48), float("nan"))
    assert getattr(sk, name)(x, out) is out
    assert rel_err(out, ref) < 1e-6


def test_concat_mla_k_broadcasts_the_rope_head(sk):
    k_nope, k_rope = torch.randn(6, 4, 128), torch.randn(6, 1, 64)
    k = torch.full((6, 4, 192), float("nan"))
    sk.concat_mla_k(k=k, k_nope=k_nope, k_rope=k_rope)
    assert torch.equal(k[..., :128], k_nope) and torch.equal(k[..., 128:], k_rope.expand(6, 4, 64))


def test_weak_ref_tensor_aliases_the_memory(sk):
    t = torch.randn(4, 4)
    alias = sk.weak_ref_tensor(t)
    assert alias.data_ptr() == t.data_ptr() and alias.shape == t.shape
    t.add_(1.0)
    assert torch.equal(alias, t)


def test_unimplemented_names_fail_by_name_when_called(sk):
    fn = sk.top_k_renorm_prob  # imported at module load by SGLang's sampler: must not fail there
    with pytest.raises(NotImplementedError, match=r"sgl_kernel\.top_k_renorm_prob is not implemented"):
        fn(torch.zeros(1))
    from sgl_kernel.kvcacheio import transfer_kv_direct

    with pytest.raises(NotImplementedError, match=r"sgl_kernel\.kvcacheio\.transfer_kv_direct"):
        transfer_kv_direct()
    from sgl_kernel.utils import is_arch_support_pdl

    assert is_arch_support_pdl() is False


def test_cutlass_and_ipython_stand_ins_import_and_refuse_work():
    """In a child process: IPython is really installed here, and the stand-ins must shadow it."""
    code = """
import cutlass, cutlass.cute as cute
from cutlass.cute.nvgpu import tcgen05
@cute.jit
def f(a):
    return a + 1
@cute.kernel()
def g(a):
    return a
class K(cutlass.Numeric):
    pass
assert f(1) == 2 and g(3) == 3 and K() is not None
for call in (lambda: cute.ceil_div(4, 2), lambda: tcgen05.make_mma(1)):
    try:
        call()
    except NotImplementedError as e:
        assert "cutlass.cute." in str(e), e
    else:
        raise AssertionError("a cutlass call did work")
from IPython.display import HTML
try:
    HTML("x")
except NotImplementedError as e:
    assert "IPython.display.HTML" in str(e)
else:
    raise AssertionError("IPython.display.HTML did work")
print("ok")
"""
    env = {"PYTHONPATH": str(STUBS), "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
