"""MORI-IO KV-cache transfer backend for SGLang prefill-decode disaggregation."""

__version__ = "0.1.0"
