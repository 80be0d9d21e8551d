"""Benchmarks: each tier against raw redis-py SET/GET of the same bytes, in one run."""
