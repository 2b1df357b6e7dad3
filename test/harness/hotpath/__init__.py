"""`scripts/bench_backend.py hotpath`: our Python per request, split by thread role, on softio."""
