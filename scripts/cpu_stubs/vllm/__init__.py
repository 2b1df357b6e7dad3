"""Stand-in for the `vllm` package, on PYTHONPATH only for CPU runs of SGLang (tests, demo, bench).

SGLang 0.5.23 imports `vllm._custom_ops.rotary_embedding` at module load when it detects neither CUDA
nor its own CPU kernels (sglang/srt/layers/rotary_embedding/base.py). The import is never used on
that path: the native PyTorch rotary embedding runs instead. Installing real vllm would replace the
pinned torch, so this stub satisfies the import and fails loudly if anything ever calls into it.
"""
