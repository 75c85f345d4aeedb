"""Pieces of scripts/bench.py (the closed-loop concurrency sweep); run it as `python scripts/bench.py`."""
