"""Timing scripts behind docs/performance.md's profiles, each run as
`python -m bench.scripts.<name> [shapes or backends]`. Timings, not tests."""
