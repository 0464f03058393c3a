"""`mha bench`: what attention costs in each framework (bench.core), and the
timing scripts behind the profiles in docs/performance.md (bench.scripts).
Not conformance: nothing here judges agreement, only speed and memory."""

from bench.core import add_parser, run

__all__ = ["add_parser", "run"]
