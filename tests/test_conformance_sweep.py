"""Random cases through every installed backend, on each of its paths: zero failures allowed.

The default run takes SMALL cases per dtype per backend; `pytest -m slow`
(`tox -e full`) takes 1000, every path included (the chunked cores too).
conformance/suite/sweep.py is the same sweep as a command, for seeds no test uses.
"""

from __future__ import annotations

import pytest

from conformance.suite import backends
from conformance.suite.cases import DTYPE_NAMES
from conformance.suite.check import DEFAULT_PATH_KINDS, PATH_KINDS
from conformance.suite.sweep import sweep

SMALL, FULL = 12, 1000


def sweep_or_skip(backend_id, seeds, kinds):
    ok, reason = backends.availability(backend_id)
    if not ok:
        pytest.skip(reason)
    summary = sweep(backend_id, seeds, DTYPE_NAMES, kinds)
    worst = ", ".join(f"{key} {value['margin']:.3g}" for key, value in summary["worst"].items())
    print(f"{backend_id}: {len(seeds)} random cases on {summary['paths']} x {len(DTYPE_NAMES)} dtypes, "
          f"{summary['runs']} runs, {len(summary['failures'])} failures; worst margins: {worst}")
    return summary


BACKENDS = [pytest.param("numpy"), pytest.param("torch", marks=pytest.mark.torch),
            pytest.param("tf", marks=pytest.mark.tf), pytest.param("jax", marks=pytest.mark.jax)]


def assert_clean(summary, kinds):
    failures = summary["failures"]
    assert not failures, f"{len(failures)} of {summary['runs']} runs failed:\n" + "\n".join(failures[:20])
    judged = {key.split()[1] for key in summary["worst"]}
    assert judged == set(DTYPE_NAMES), f"dtypes judged: {sorted(judged)}"
    assert all(value["margin"] <= 1 for value in summary["worst"].values()), summary["worst"]
    paths = {key.split()[0] for key in summary["worst"]}
    assert paths == set(summary["paths"]), f"paths judged {sorted(paths)} of {summary['paths']} ({kinds})"


@pytest.mark.parametrize("backend_id", BACKENDS)
def test_random_sweep(backend_id):
    summary = sweep_or_skip(backend_id, range(10_000, 10_000 + SMALL), DEFAULT_PATH_KINDS)
    assert_clean(summary, DEFAULT_PATH_KINDS)


@pytest.mark.slow
@pytest.mark.parametrize("backend_id", BACKENDS)
def test_random_sweep_1000(backend_id):
    summary = sweep_or_skip(backend_id, range(FULL), PATH_KINDS)
    assert_clean(summary, PATH_KINDS)
