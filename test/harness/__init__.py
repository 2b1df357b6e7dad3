"""Helpers shared by the end-to-end tests, the CPU demo and the PD latency benchmark.

Nothing here is imported by the backend itself: it builds a tiny local model, starts and stops real
SGLang servers and the router, and talks to them over HTTP.
"""
