"""`sgl_kernel.utils`: the one query SGLang's Triton attention backend makes at start-up."""


def is_arch_support_pdl() -> bool:
    # Programmatic dependent launch is a launch attribute of sgl_kernel's own CUDA kernels; the
    # stand-in launches none, so no caller may rely on it.
    return False


def __getattr__(name):
    from stub_missing import Missing

    if name.startswith("__") and name.endswith("__"):
        raise AttributeError(name)
    return Missing(f"{__name__}.{name}")
