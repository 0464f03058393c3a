"""Random cases through every installed backend: zero failures allowed.

The default run takes SMALL cases per dtype per backend; `pytest -m slow`
(`tox -e full`) takes 1000, the figure the tolerance policy was set by.
"""

from __future__ import annotations

import collections

import pytest

from conformance import backends
from conformance.cases import DTYPE_NAMES, random_case
from conformance.compare import STATUS_PASS, clear_cache, run_case

SMALL, FULL = 12, 1000


def sweep(backend_id: str, count: int, first_seed: int = 0):
    ok, reason = backends.availability(backend_id)
    if not ok:
        pytest.skip(reason)
    adapter = backends.load(backend_id)
    worst = collections.defaultdict(float)
    failures = []
    for seed in range(first_seed, first_seed + count):
        case = random_case(seed)
        for dtype in DTYPE_NAMES:
            r = run_case(case, backend_id, dtype=dtype, adapter=adapter)
            if r.status == STATUS_PASS:
                worst[dtype] = max(worst[dtype], r.margin)
            else:
                failures.append(f"{case.name} {dtype}: {r.status} {r.message} {r.worst.describe() if r.worst else ''} "
                                f"{r.divergence.describe() if r.divergence else ''}")
        if seed % 10 == 9:
            clear_cache()  # every case has new shapes: bound the references and JAX programs kept
    clear_cache()
    summary = ", ".join(f"{d} {worst[d]:.3g}" for d in DTYPE_NAMES)
    print(f"{backend_id}: {count} random cases x {len(DTYPE_NAMES)} dtypes, {len(failures)} failures; worst margins: {summary}")
    return failures, worst



BACKENDS = [pytest.param("numpy"), pytest.param("torch", marks=pytest.mark.torch),
            pytest.param("tf", marks=pytest.mark.tf), pytest.param("jax", marks=pytest.mark.jax)]


@pytest.mark.parametrize("backend_id", BACKENDS)
def test_random_sweep(backend_id):
    failures, worst = sweep(backend_id, SMALL, first_seed=10_000)
    assert not failures, f"{len(failures)} of {SMALL * len(DTYPE_NAMES)} runs failed:\n" + "\n".join(failures[:20])
    assert set(worst) == set(DTYPE_NAMES) and all(m <= 1 for m in worst.values()), dict(worst)


@pytest.mark.slow
@pytest.mark.parametrize("backend_id", BACKENDS)
def test_random_sweep_1000(backend_id):
    failures, worst = sweep(backend_id, FULL)
    assert not failures, f"{len(failures)} of {FULL * len(DTYPE_NAMES)} runs failed:\n" + "\n".join(failures[:20])
    assert set(worst) == set(DTYPE_NAMES) and all(m <= 1 for m in worst.values()), dict(worst)
