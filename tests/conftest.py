"""Shared test settings: hypothesis profiles and the float64 reference."""

from __future__ import annotations

import gc
import os
import random

import pytest
from hypothesis import HealthCheck, settings

# "ci" bounds the random sweeps so `tox` stays quick, derandomized: every run draws the same examples (CI must
# be reproducible). "long" is `tox -e full`: not derandomized, so each full run explores new examples, from one
# seed per run (HYPOTHESIS_SEED, else a random one) that the run prints at its start and end: HYPOTHESIS_SEED=N
# tox -e full (or pytest --hypothesis-seed=N) replays that run's examples; a failure also prints its
# @reproduce_failure blob (print_blob).
settings.register_profile("ci", max_examples=60, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("long", max_examples=1000, deadline=None, derandomize=False, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=30, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Python's full collections less often, as in `mha check`'s workers (conformance.suite.check.WORKER_GC_THRESHOLDS,
# where the why is written): tracing JAX programs and eager Keras calls allocate by the hundred thousand, and the
# default thresholds had every worker rescan all of the frameworks' objects every few tests. Measured
# (2026-11-27, 2-core EPYC, the jax tests on 2 xdist workers): 195.8 -> 184.7 s.
gc.set_threshold(50_000, 20, 100)

_RUN_SEED: list[int | str] = []  # the seed a run that is not derandomized draws from (set by pytest_configure)


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    """A profile that is not derandomized: one seed for the run, printed, so that the run can be replayed."""
    if settings.default.derandomize:
        return
    from hypothesis import core

    given = config.getoption("hypothesis_seed", None) or os.environ.get("HYPOTHESIS_SEED")
    seed = random.SystemRandom().randrange(2**32) if given in (None, "") else given
    try:
        seed = int(seed)
    except ValueError:  # hypothesis takes any string as a seed too
        pass
    core.global_force_seed = seed  # what `pytest --hypothesis-seed` sets
    os.environ["HYPOTHESIS_SEED"] = str(seed)  # the same seed in pytest-xdist's workers, started after this
    _RUN_SEED.append(seed)


def _seed_line() -> str:
    seed = _RUN_SEED[0]
    return (f"hypothesis profile {settings.get_current_profile_name()!r}, not derandomized: seed {seed} "
            f"(replay: HYPOTHESIS_SEED={seed}, or pytest --hypothesis-seed={seed})")


def pytest_report_header(config):
    return _seed_line() if _RUN_SEED else None


def pytest_terminal_summary(terminalreporter):
    if _RUN_SEED:
        terminalreporter.write_line(_seed_line())


@pytest.fixture
def mirror(request):
    """A mirror's handle (tests/mirrors.py) for the framework named by the parameter (indirect); the test
    skips where that framework is not installed."""
    from mirrors import load

    return load(request.param)
