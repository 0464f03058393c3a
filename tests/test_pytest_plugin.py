"""The pytest plugin (conformance/suite/pytest_plugin.py): `pytest --mha-impl
MODULE:FUNCTION` gives one item per vector, and the helpers parametrize a
user's own test. Run through pytester, in a directory standing for a user's
repository that holds a copy of the worked example and a buggy variant."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from conformance.suite.cases import DTYPE_NAMES
from conformance.suite.vectors import load_all
from conformance.suite.verify import verify_vector
from weights.config import MODERN_DEFAULTS

pytest_plugins = ["pytester"]
NODEID = "mha-vectors"  # the vectors' collector (conformance.suite.pytest_plugin.NODEID)

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "mha_examples" / "numpy_attention.py"
VECTORS = {v.name: v for v in load_all()}
PLAIN_INPUTS = {"query", "key", "value", "mask", "bias", "dropout_mask"}
MODERN_OFF = MODERN_DEFAULTS  # every field beyond the plain layer's, each off


def is_plain(vector) -> bool:
    """A vector of only the features the example implements (the rest it refuses)."""
    config = vector.config.to_dict()
    return (set(vector.inputs) <= PLAIN_INPUTS and not vector.options.get("return_cache")
            and all(config.get(name, off) == off for name, off in MODERN_OFF.items()))


PLAIN = {n for n, v in VECTORS.items() if is_plain(v)}
# The bug below (causal alignment swapped) changes the mask only where T != S.
TOUCHED = {n for n in PLAIN if VECTORS[n].options["is_causal"]
           and VECTORS[n].inputs["query"].shape[1] != VECTORS[n].inputs["key"].shape[1]}

BUGGY = '''
from user_attention import attention


def alignment_swapped(config, tensors, inputs, options):
    if options.get("is_causal"):
        flipped = {"top_left": "bottom_right", "bottom_right": "top_left"}[options["causal_alignment"]]
        options = dict(options, causal_alignment=flipped)
    return attention(config, tensors, inputs, options)


def forward_only(config, tensors, inputs, options):
    result = attention(config, tensors, inputs, options)
    result.pop("grads", None)
    return result
'''


def _entry_point_installed() -> bool:
    return any(ep.value == "conformance.suite.pytest_plugin" for ep in importlib.metadata.entry_points(group="pytest11"))


# An editable install made before the entry point existed does not load the plugin by itself.
PLUGIN = [] if _entry_point_installed() else ["-p", "conformance.suite.pytest_plugin"]


@pytest.fixture
def user_repo(pytester):
    pytester.makepyfile(user_attention=EXAMPLE.read_text(), user_buggy=BUGGY)
    pytester.makepyfile(test_own="def test_own():\n    assert sum([1, 2]) == 3\n")
    pytester.syspathinsert()
    return pytester


def outcomes(reprec) -> dict[str, set[str]]:
    """outcome -> nodeids, from an inline run's reports."""
    found: dict[str, set[str]] = {}
    for rep in reprec.getreports("pytest_runtest_logreport"):
        if rep.when == "call" or rep.outcome != "passed":
            found.setdefault(rep.outcome, set()).add(rep.nodeid)
    return found


def vector_ids(names) -> set[str]:
    return {f"{NODEID}::{n}" for n in names}


def test_without_mha_impl_the_plugin_adds_nothing(user_repo):
    result = user_repo.runpytest(*PLUGIN, "--co", "-q")
    assert result.ret == 0
    assert [line for line in result.outlines if "::" in line] == ["test_own.py::test_own"]


def test_loading_the_plugin_imports_no_numpy():
    code = "import sys, conformance.suite.pytest_plugin; sys.exit('numpy' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_one_item_per_vector_named_by_it_after_the_users_tests(user_repo):
    result = user_repo.runpytest(*PLUGIN, "--mha-impl", "user_attention:attention", "--co", "-q")
    items = [line for line in result.outlines if "::" in line]
    assert items[0] == "test_own.py::test_own"
    assert items[1:] == [f"{NODEID}::{v.name}" for v in VECTORS.values()]
    assert len(items) - 1 == len(VECTORS) >= 128


@pytest.mark.reference  # the user's NumPy port, no framework: the numpy env runs it, not `tox -e all` again
def test_a_correct_function_passes_every_vector_it_supports(user_repo):
    reprec = user_repo.inline_run(*PLUGIN, "--mha-impl", "user_attention:attention", "--mha-require-gradients")
    got = outcomes(reprec)
    assert got["passed"] == vector_ids(PLAIN) | {"test_own.py::test_own"}
    assert got.get("skipped", set()) == vector_ids(set(VECTORS) - PLAIN)
    assert "failed" not in got
    for rep in reprec.getreports("pytest_runtest_logreport"):
        if rep.skipped:
            assert "unsupported: this port does not implement" in str(rep.longrepr)


@pytest.mark.reference  # the user's NumPy port, no framework: the numpy env runs it, not `tox -e all` again
def test_a_porting_bug_fails_exactly_the_vectors_it_touches(user_repo):
    assert len(TOUCHED) >= 12
    got = outcomes(user_repo.inline_run(*PLUGIN, "--mha-impl", "user_buggy:alignment_swapped"))
    assert got["failed"] == vector_ids(TOUCHED)
    assert got["passed"] == vector_ids(PLAIN - TOUCHED) | {"test_own.py::test_own"}
    # the failure says what `mha verify --verbose` says
    result = user_repo.runpytest(*PLUGIN, "--mha-impl", "user_buggy:alignment_swapped", "-k", "causal_top_left.float32")
    sys.path.insert(0, str(user_repo.path))
    try:
        from user_buggy import alignment_swapped
        expected = verify_vector(alignment_swapped, VECTORS["causal_top_left.float32"]).message()
    finally:
        sys.path.remove(str(user_repo.path))
        sys.modules.pop("user_buggy", None)
        sys.modules.pop("user_attention", None)
    assert expected.startswith("fail causal_top_left.float32: ")
    text = "\n".join(result.outlines)
    assert expected in text, text


@pytest.mark.reference  # the user's NumPy port, no framework: the numpy env runs it, not `tox -e all` again
def test_xdist_runs_the_items_in_two_workers(user_repo):
    pytest.importorskip("xdist")
    result = user_repo.runpytest_subprocess(*PLUGIN, "--mha-impl", "user_buggy:alignment_swapped", "-n", "2",
                                            "--mha-dtypes", "float32", "float16", "-p", "no:cacheprovider")
    chosen = {n for n in PLAIN if VECTORS[n].dtype in ("float32", "float16")}
    skipped = {n for n in VECTORS if VECTORS[n].dtype in ("float32", "float16")} - chosen
    result.assert_outcomes(failed=len(TOUCHED & chosen), passed=len(chosen - TOUCHED) + 1, skipped=len(skipped))
    assert "created: 2/2 workers" in result.stdout.str()
    failed = {line.split()[1] for line in result.outlines if line.startswith("FAILED ")}
    assert failed == vector_ids(TOUCHED & chosen)


def test_last_failed_and_exitfirst_work_on_the_items(user_repo):
    args = [*PLUGIN, "--mha-impl", "user_buggy:alignment_swapped", "--mha-cases", "causal", "self_basic"]
    chosen = {n for n in VECTORS if n.startswith(("causal", "self_basic"))}
    first = user_repo.runpytest(*args)
    first.assert_outcomes(failed=len(TOUCHED), passed=len((chosen & PLAIN) - TOUCHED) + 1,
                          skipped=len(chosen - PLAIN))
    again = user_repo.runpytest(*args, "--lf")
    again.assert_outcomes(failed=len(TOUCHED), deselected=len(chosen - TOUCHED) + 1)
    stopped = user_repo.runpytest(*args, "-x")
    before = {n for n in chosen if f"{n}.safetensors" < f"{min(TOUCHED)}.safetensors"}  # vectors run in file order
    stopped.assert_outcomes(failed=1, passed=len(before & PLAIN) + 1, skipped=len(before - PLAIN))


def test_forward_only_passes_with_a_summary_line_and_fails_when_gradients_are_required(user_repo):
    args = [*PLUGIN, "--mha-impl", "user_buggy:forward_only", "--mha-cases", "self_basic", "gqa"]
    result = user_repo.runpytest(*args)
    result.assert_outcomes(passed=9)
    result.stdout.fnmatch_lines(["mha: 8 vectors passed on the forward pass only (user_buggy:forward_only returned "
                                 "no 'grads'); --mha-require-gradients makes that a failure"])
    required = user_repo.runpytest(*args, "--mha-require-gradients")
    required.assert_outcomes(passed=1, failed=8)
    required.stdout.fnmatch_lines(["*no 'grads' in the result (gradients required)*"])


def test_unsupported_fails_with_mha_fail_unsupported(user_repo):
    modern = sorted(set(VECTORS) - PLAIN)
    if not modern:
        pytest.skip("every shipped vector is one the example implements")
    result = user_repo.runpytest(*PLUGIN, "--mha-impl", "user_attention:attention", "--mha-fail-unsupported",
                                 "-k", modern[0])
    result.assert_outcomes(failed=1, deselected=len(VECTORS))
    result.stdout.fnmatch_lines([f"unsupported {modern[0]}: this port does not implement*"])


def test_the_helpers_parametrize_a_users_own_test(user_repo):
    user_repo.makepyfile(test_mine='''
import pytest
from conformance.suite.pytest_plugin import assert_conforms, vectors
from user_buggy import alignment_swapped


@pytest.mark.parametrize("vector", vectors(cases=["causal_top_left", "self_basic"], dtypes=["float64"]))
def test_alignment(vector):
    assert_conforms(alignment_swapped, vector, require_gradients=True)
''')
    result = user_repo.runpytest(*PLUGIN, "test_mine.py", "-v")
    result.assert_outcomes(failed=1, passed=1)
    result.stdout.fnmatch_lines(["*test_alignment?causal_top_left.float64? FAILED*",
                                 "*test_alignment?self_basic.float64? PASSED*",
                                 "fail causal_top_left.float64: * quantities beyond tolerance*",
                                 "  output: FAIL margin * (worst at *: got *, expected *"])


@pytest.mark.parametrize("argv, message", [
    (["--mha-impl", "no_colon"], "ERROR: --mha-impl must be MODULE:FUNCTION: got 'no_colon'"),
    (["--mha-impl", "no_such_module_here:fn"], "ERROR: --mha-impl no_such_module_here:fn: cannot import *"),
    (["--mha-impl", "user_attention:attention", "--mha-cases", "zzz"], "ERROR: --mha-cases/--mha-dtypes: no vector*"),
])
def test_bad_options_are_usage_errors(user_repo, argv, message):
    result = user_repo.runpytest(*PLUGIN, *argv)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])


def test_the_dtype_choices_and_the_entry_point():
    from conformance.suite import pytest_plugin  # imported here: the runs above import it as a plugin, with rewriting

    assert pytest_plugin.DTYPES == DTYPE_NAMES and pytest_plugin.NODEID == NODEID
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["pytest11"] == {"mha": "conformance.suite.pytest_plugin"}


def test_every_flag_the_guide_and_the_ci_example_use_exists(user_repo, capsys):
    """docs/verify-in-ci.md and docs/ci-example.yml name only options that exist."""
    import re

    from conformance.cli.commands import main

    docs = (ROOT / "docs" / "verify-in-ci.md").read_text() + (ROOT / "docs" / "ci-example.yml").read_text()
    plugin_help = "\n".join(user_repo.runpytest(*PLUGIN, "--help").outlines)
    used = set(re.findall(r"--mha-[a-z-]+", docs))
    assert used and used <= set(re.findall(r"--mha-[a-z-]+", plugin_help)), used
    with pytest.raises(SystemExit):
        main(["verify", "--help"])
    verify_help = capsys.readouterr().out
    verify_lines = [line for line in docs.splitlines() if "mha verify " in line]
    flags = {f for line in verify_lines for f in re.findall(r"(?<![\w-])--[a-z][a-z-]+", line)}
    assert {"--impl", "--junit", "--require-gradients"} <= flags
    assert flags <= set(re.findall(r"--[a-z][a-z-]+", verify_help)), flags


def test_the_example_refuses_every_field_it_does_not_implement():
    """The worked example's OFF table is every field beyond the plain layer (weights.config.MODERN_DEFAULTS),
    so a vector that uses a new field is reported unsupported by it, not failed."""
    namespace: dict = {}
    exec(compile(EXAMPLE.read_text(), str(EXAMPLE), "exec"), namespace)
    assert namespace["OFF"] == MODERN_DEFAULTS
