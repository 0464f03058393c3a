"""The suite fails realistic porting bugs, through both `mha check`'s
comparison and `mha verify`, and passes the same port without the bug."""

from __future__ import annotations

import pytest
from mutants import DIFFERENTIAL_MUTANTS, MUTANTS, SHARING_MUTANTS, MutantAdapter

from conformance.suite.cases import CASES, LONG_GRID, MHA_CASES
from conformance.suite.compare import STATUS_FAIL, STATUS_PASS, run_case
from conformance.suite.verify import verify

pytestmark = pytest.mark.reference  # NumPy only, no framework looked for: the numpy env runs it, `all` does not again

DTYPES = ("float64", "float32", "bfloat16")
# Every mutant over the short grid; the realistic lengths' own bugs in tests/test_mutants_long.py (a T 256 case
# per mutant and dtype would cost tox more than it tells: each of these bugs is caught at a few tokens). The
# selection cases (topk_indices) run their own bugs in tests/test_topk_selection.py: these bugs are caught
# without them, and the four cases in every mutant's run took this file from 29 to 35 s of CPU.
SHORT = [name for name in MHA_CASES if name not in LONG_GRID and CASES[name].selection is None
         and CASES[name].config.indexer is None]  # the indexer cases' own bugs: tests/test_indexer_call.py
# issue 42's cases run their own bugs (SHARING_MUTANTS, test_sharing_mutant_is_caught), not every mutant
SHORT = [name for name in SHORT if name not in {case for _, case in SHARING_MUTANTS.values()}]


def check_results(adapter, dtypes=DTYPES, names=SHORT):
    return [run_case(CASES[name], "mutant", dtype=dtype, adapter=adapter, gradients=False)
            for name in names for dtype in dtypes]


def test_the_port_without_bugs_conforms():
    # the hand port is of multi_head_attention's layer: DeepSeek V4's cases have their own (tests/v4_mutants.py)
    results = check_results(MutantAdapter(None), dtypes=("float64", "float32", "float16", "bfloat16"), names=MHA_CASES)
    bad = [f"{r.case}/{r.dtype}: {r.status} {r.worst.describe() if r.worst else r.message}" for r in results if r.status != STATUS_PASS]
    assert not bad, "\n".join(bad)
    failures = [r for r in verify(MutantAdapter(None), only=list(MHA_CASES)) if r.status != "pass"]
    assert not failures, [f"{r.name}: {r.detail}" for r in failures]


@pytest.mark.parametrize("bug", list(MUTANTS), ids=list(MUTANTS))
def test_mutant_is_caught(bug):
    adapter = MutantAdapter(bug)
    results = check_results(adapter)
    caught = [r for r in results if r.status == STATUS_FAIL]  # numerically wrong, not merely crashing
    assert caught, f"mha check missed {bug} ({MUTANTS[bug]}) over {len(results)} case runs"
    verified = verify(adapter, only=SHORT)
    failed = [r for r in verified if r.status == "fail"]
    assert failed, f"mha verify missed {bug} ({MUTANTS[bug]}) over {len(verified)} vectors"
    worst = max(r.margin for r in caught)
    print(f"{bug}: check fails {len(caught)}/{len(results)} runs (worst margin {worst:.3g}); "
          f"verify fails {len(failed)}/{len(verified)} vectors")


def test_tf32_is_caught_in_float32_itself():
    """The reason float32 tolerances are not loose: TF32 must fail float32 cases."""
    results = check_results(MutantAdapter("tf32_matmul_inputs"), dtypes=("float32",))
    failed = [r for r in results if r.status == STATUS_FAIL]
    assert len(failed) >= len(results) // 2, f"TF32 caught in only {len(failed)}/{len(results)} float32 cases"
    least = min(r.margin for r in failed)
    print(f"tf32 in float32: {len(failed)}/{len(results)} cases fail, smallest failing margin {least:.3g}")


@pytest.mark.parametrize("bug", list(DIFFERENTIAL_MUTANTS), ids=list(DIFFERENTIAL_MUTANTS))
def test_differential_mutant_is_caught(bug):
    """Differential attention's porting bugs fail `mha check`'s comparison on their grid case, in every dtype judged
    (the same port without the bug passes there: test_the_port_without_bugs_conforms)."""
    what, name = DIFFERENTIAL_MUTANTS[bug]
    results = check_results(MutantAdapter(bug), dtypes=("float64", "float32", "bfloat16"), names=[name])
    missed = [f"{r.dtype}: {r.status} (margin {r.margin:.3g})" for r in results if r.status != STATUS_FAIL]
    assert not missed, f"mha check missed {bug} ({what}) on {name}: {missed}"
    print(f"{bug}: {name} fails in {', '.join(f'{r.dtype} (margin {r.margin:.3g})' for r in results)}")


@pytest.mark.parametrize("bug", list(SHARING_MUTANTS), ids=list(SHARING_MUTANTS))
def test_sharing_mutant_is_caught(bug):
    """Issue 42's bugs (a shared-KV layer appending what it reads, a key multiplier or value scale left out) fail
    their case's comparison in every dtype, and its shipped vectors."""
    what, case = SHARING_MUTANTS[bug]
    adapter = MutantAdapter(bug)
    results = check_results(adapter, names=[case])
    caught = [r for r in results if r.status == STATUS_FAIL]
    assert len(caught) == len(results), f"mha check missed {bug} ({what}) on {case}: " + ", ".join(
        f"{r.dtype} {r.status} margin {r.margin:.3g}" for r in results)
    failed = [r for r in verify(adapter, only=[case]) if r.status == "fail"]
    assert failed, f"mha verify missed {bug} ({what}) on {case}'s vectors"
    print(f"{bug}: check fails {len(caught)}/{len(results)} runs on {case} (smallest margin "
          f"{min(r.margin for r in caught):.3g}); verify fails {len(failed)} vectors")
