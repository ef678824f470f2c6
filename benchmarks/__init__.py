"""Benchmark scripts: each prints one JSON document (see benchmarks/kernels.py)."""
