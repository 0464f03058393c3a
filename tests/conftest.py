"""Shared test settings: hypothesis profiles and the float64 reference."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

# "ci" bounds the random sweeps so `tox` stays quick; "long" is `tox -e full`.
settings.register_profile("ci", max_examples=60, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("long", max_examples=1000, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=30, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
