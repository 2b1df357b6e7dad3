"""The one symbol SGLang imports from vllm on CPU; calling it means a CUDA-only path was taken."""


def rotary_embedding(*args, **kwargs):
    raise RuntimeError("vllm stub: rotary_embedding is CUDA-only; SGLang should use forward_native on CPU")
