"""The benchmark scripts, one package: run each from the repository root as `python -m benchmarks.<script>`
(benchmarks/README.md lists them). Shared pieces live in benchmarks.benchmark; test helpers are loaded from tests/ by
benchmarks.benchmark.suite."""
