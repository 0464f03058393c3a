"""Realistic lengths: bugs that only a bar set by what the result is made of sees (issue 38).

An ALiBi slope 4% off moves the output by about 0.7% at T 256. A logit term taken from the largest
|logit| + |bias| of the case (slope * 255 on keys of weight e^-60) allowed that; the policy's bar downstream of
the softmax now follows the keys that carry weight (impl_numpy.magnitudes' logit errors), so the mutant fails
`mha check` and `mha verify` at T 256 (the default grid and its shipped vectors) and at T 2048 (the long
profile, tox -e full), while the port without the bug passes with room."""

from __future__ import annotations

import pytest
from mutants import MutantAdapter

from conformance.suite import compare
from conformance.suite.cases import ALL_CASES, CASES
from conformance.suite.compare import STATUS_FAIL, STATUS_PASS, expected_for, run_case
from conformance.suite.vectors import generate
from conformance.suite.verify import verify

pytestmark = pytest.mark.reference


def _margins(case, dtype, bug):
    """(margin under the policy, margin had z been the largest logit magnitude of the case) of the output."""
    result = run_case(case, "mutant", dtype=dtype, adapter=MutantAdapter(bug), gradients=False)
    exp = expected_for(case, dtype)
    weighted, exp["logit_errors"] = exp["logit_errors"], {}  # the policy before issue 38: z over every key
    try:
        before = run_case(case, "mutant", dtype=dtype, adapter=MutantAdapter(bug), gradients=False)
    finally:
        exp["logit_errors"] = weighted
    return result, before


def _caught(case_name, directory, dtype="float32"):
    case = ALL_CASES[case_name]
    fine, fine_before = _margins(case, dtype, None)
    assert fine.status == STATUS_PASS and fine.margin <= 0.1, fine.worst.describe()
    bad, before = _margins(case, dtype, "alibi_slope_typo")
    assert bad.status == STATUS_FAIL, f"mha check missed the slope at {case_name}: {bad.worst.describe()}"
    verified = verify(MutantAdapter("alibi_slope_typo"), directory, only=[case_name], dtypes=[dtype])
    assert [r.status for r in verified] == ["fail"], [(r.name, r.status, r.detail) for r in verified]
    correct = verify(MutantAdapter(None), directory, only=[case_name], dtypes=[dtype])
    assert [r.status for r in correct] == ["pass"], [(r.name, r.status, r.detail) for r in correct]
    print(f"{case_name} {dtype}: the port {fine.margin:.3g} (z over every key: {fine_before.margin:.3g}); the slope "
          f"typo {bad.margin:.3g} (z over every key: {before.margin:.3g}); verify {verified[0].margin:.3g}")
    return before


def test_alibi_slope_typo_caught_at_256():
    assert "long_alibi_256" in CASES  # the default grid, its shipped vectors
    _caught("long_alibi_256", compare.__file__.rsplit("/", 1)[0] + "/vectors")


@pytest.mark.slow
def test_alibi_slope_typo_caught_at_2048(tmp_path):
    generate(tmp_path, cases=["long_alibi_2048"], dtypes=["float32"])
    before = _caught("long_alibi_2048", tmp_path)
    assert before.status == STATUS_PASS  # what the old bar let through: the reason for the change
