"""Import-only stand-in for `cutlass` (nvidia-cutlass-dsl); scripts/gpu_stubs/README.md says why.

SGLang imports its CuTe-DSL dual GEMM on any CUDA device while building a Llama MLP, and uses it only
on SM100. Module-level decorators return what they decorate; any other call raises, naming itself.
"""

from stub_missing import install_submodule_finder

install_submodule_finder(__name__, lenient_decorator=True)


def __getattr__(name):
    from stub_missing import Missing

    if name.startswith("__") and name.endswith("__"):
        raise AttributeError(name)
    return Missing(f"{__name__}.{name}", lenient_decorator=True)
