"""Pieces of benchmarks/bench.py (the closed-loop concurrency sweep); run it as `python -m benchmarks.bench`."""
