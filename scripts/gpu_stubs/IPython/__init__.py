"""Stand-in for IPython: SGLang's sglang/utils.py imports IPython.display for notebook helpers that a
server never calls (scripts/gpu_stubs/README.md)."""
