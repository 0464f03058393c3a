"""The long profile (`mha check --profile long`) and the default grid's long cases: every core backend passes each on
every path (the chunked cores in blocks of T // 8: weights.paths.chunk_size), float32 with room (margin <= 0.1, the issue 38 bar: the policy's bars at these lengths are not loose), bfloat16 too."""

from __future__ import annotations

import pytest

from conformance.suite import backends
from conformance.suite.cases import CASES, LONG_CASES, LONG_GRID, PROFILE_DTYPES
from conformance.suite.check import PATH_KINDS, paths_of
from conformance.suite.compare import STATUS_PASS, STATUS_UNSUPPORTED, clear_cache, run_case

BACKENDS = [pytest.param("numpy"), pytest.param("torch", marks=pytest.mark.torch),
            pytest.param("tf", marks=pytest.mark.tf), pytest.param("jax", marks=pytest.mark.jax)]


@pytest.mark.slow
@pytest.mark.parametrize("backend_id", BACKENDS)
def test_long_profile(backend_id):
    ok, reason = backends.availability(backend_id)
    if not ok:
        pytest.skip(reason)
    adapter = backends.load(backend_id)
    bad, worst = [], {}
    for case in [*(CASES[name] for name in LONG_GRID), *LONG_CASES.values()]:
        for dtype in PROFILE_DTYPES["long"]:
            for path in paths_of(adapter, PATH_KINDS):
                r = run_case(case, backend_id, dtype=dtype, adapter=adapter, path=path)
                if r is None or r.status == STATUS_UNSUPPORTED:
                    continue
                if r.status != STATUS_PASS or (dtype == "float32" and r.margin > 0.1):
                    bad.append(f"{case.name} {dtype} {path}: {r.status} {r.worst.describe() if r.worst else r.message}")
                key = f"{path} {dtype}"
                worst[key] = max(worst.get(key, (0.0, "")), (r.margin, case.name))
        clear_cache()
    print(f"{backend_id}: " + "; ".join(f"{k} {m:.3g} ({c})" for k, (m, c) in sorted(worst.items())))
    assert not bad, "\n".join(bad)
