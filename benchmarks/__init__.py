"""Benchmarks (not shipped in the package)."""
