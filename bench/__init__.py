"""Benchmarks: each module has `run() -> dict` and prints its result as JSON when run with -m."""
