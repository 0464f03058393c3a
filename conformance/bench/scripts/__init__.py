"""Timing scripts behind docs/performance.md's profiles, each run as
`python -m conformance.bench.scripts.<name> [shapes or backends]`. Timings, not tests."""
