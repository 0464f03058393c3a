"""The pytest plugin: the shipped vectors as test items of a user's function
(docs/verify-in-ci.md). Installed with the package (entry point `pytest11`,
name `mha`; `-p no:mha` turns it off), no configuration needed:

    pytest --mha-impl MODULE:FUNCTION [--mha-cases PREFIX ...] [--mha-dtypes DTYPE ...]
           [--mha-require-gradients] [--mha-vectors DIR] [--mha-fail-unsupported]

adds one item per vector, named by the vector (`self_basic.float32`), after
the items of the test files, so `-k`, `-x`, `--lf` and pytest-xdist work on
them. The function has `mha verify`'s signature (conformance/suite/verify.py); a
failing item says what `mha verify --verbose` says. An "unsupported" vector
(the function raised NotImplementedError) is a skip with its reason, or a
failure with --mha-fail-unsupported. Without --mha-impl the plugin adds
nothing and imports nothing beyond pytest.

Inside a test file, the same vectors parametrize a test of your own:

    from conformance.suite.pytest_plugin import assert_conforms, vectors

    @pytest.mark.parametrize("vector", vectors(cases=["self_", "causal"]))
    def test_my_attention(vector):
        assert_conforms(my_attention, vector, require_gradients=True)
"""

from __future__ import annotations

import pytest

# conformance.suite.cases.DTYPE_NAMES, written out so that loading the plugin in
# every pytest run does not import NumPy (tests/test_pytest_plugin.py keeps them equal)
DTYPES = ("float64", "float32", "float16", "bfloat16")
NODEID = "mha-vectors"
_STATE = pytest.StashKey[dict]()


def pytest_addoption(parser) -> None:
    group = parser.getgroup("mha", "multi-head attention conformance vectors (mha-conformance)")
    group.addoption("--mha-impl", metavar="MODULE:FUNCTION", default=None,
                    help="verify this function, `mha verify`'s signature, against every shipped vector: "
                         "one test item per vector")
    group.addoption("--mha-cases", nargs="+", action="extend", default=None, metavar="PREFIX",
                    help="only vectors whose name starts with one of these")
    group.addoption("--mha-dtypes", nargs="+", action="extend", default=None, choices=DTYPES, metavar="DTYPE",
                    help=f"only vectors of these dtypes ({', '.join(DTYPES)})")
    group.addoption("--mha-require-gradients", action="store_true", default=False,
                    help="a vector passed on the forward pass only (no 'grads' returned) fails")
    group.addoption("--mha-vectors", metavar="DIR", default=None, help="vector files (default: the shipped ones)")
    group.addoption("--mha-fail-unsupported", action="store_true", default=False,
                    help="a vector the function refuses (NotImplementedError) fails instead of being skipped")


def pytest_configure(config) -> None:
    spec = config.getoption("mha_impl", None)
    if not spec:
        return
    from conformance.suite.vectors import DEFAULT_DIR, load_all
    from conformance.suite.verify import load_function, select

    try:
        function = load_function(spec)
    except ValueError as err:
        raise pytest.UsageError(str(err).replace("--impl", "--mha-impl", 1)) from None
    directory = config.getoption("mha_vectors") or DEFAULT_DIR
    try:
        chosen = select(load_all(directory), only=config.getoption("mha_cases"), dtypes=config.getoption("mha_dtypes"))
    except ValueError as err:
        raise pytest.UsageError(str(err).replace("--vectors", "--mha-vectors", 1)) from None
    if not chosen:
        raise pytest.UsageError(f"--mha-cases/--mha-dtypes: no vector in {directory} matches")
    config.stash[_STATE] = {"spec": spec, "function": function, "vectors": chosen}


class VerifyFailure(Exception):
    def __init__(self, result):
        super().__init__(result.message())
        self.result = result


class VectorItem(pytest.Item):
    def __init__(self, *, vector, **kwargs):
        super().__init__(**kwargs)
        self.vector = vector

    def runtest(self) -> None:
        from conformance.suite.verify import GRADIENTS_FORWARD_ONLY, STATUS_PASS, STATUS_UNSUPPORTED, verify_vector

        config = self.config
        result = verify_vector(config.stash[_STATE]["function"], self.vector,
                               require_gradients=config.getoption("mha_require_gradients"))
        self.user_properties.append(("mha_gradients", result.gradients))
        if result.status == STATUS_PASS:
            if result.gradients == GRADIENTS_FORWARD_ONLY or result.unchecked:  # what was not checked, and why
                self.add_report_section("call", "mha", result.message())
            return
        if result.status == STATUS_UNSUPPORTED and not config.getoption("mha_fail_unsupported"):
            pytest.skip(f"unsupported: {result.detail}")
        raise VerifyFailure(result)

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, VerifyFailure):
            result = excinfo.value.result
            return result.message() + (f"\n\n{result.traceback}" if result.traceback else "")
        return super().repr_failure(excinfo, style=style)

    def reportinfo(self):
        return self.vector.path, None, f"{NODEID}::{self.name}"


class VectorCollector(pytest.Collector):
    def collect(self):
        return [VectorItem.from_parent(self, name=v.name, vector=v) for v in self.config.stash[_STATE]["vectors"]]


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    """The vectors join the session's own collectors (after the test files),
    so pytest reports, selects, reruns and distributes them like any test."""
    report = yield
    if isinstance(collector, pytest.Session) and _STATE in collector.config.stash and report.passed:
        report.result.append(VectorCollector.from_parent(collector, name=NODEID, nodeid=NODEID))
    return report


def pytest_report_header(config):
    if _STATE in config.stash:
        return f"mha: verifying {config.stash[_STATE]['spec']} against the conformance vectors"
    return None


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    if _STATE not in config.stash:
        return
    forward_only = [r for r in terminalreporter.stats.get("passed", [])
                    if ("mha_gradients", "forward only") in getattr(r, "user_properties", ())]
    if forward_only:
        terminalreporter.write_line(
            f"mha: {len(forward_only)} vectors passed on the forward pass only ({config.stash[_STATE]['spec']} "
            "returned no 'grads'); --mha-require-gradients makes that a failure")


# -- for test files of your own ------------------------------------------------------------

def vectors(cases=None, dtypes=None, directory=None) -> list:
    """The vectors as pytest params (id = the vector's name), for
    `@pytest.mark.parametrize("vector", vectors(...))`; `cases` are name
    prefixes, `directory` defaults to the shipped vectors."""
    from conformance.suite.vectors import DEFAULT_DIR, load_all
    from conformance.suite.verify import select

    chosen = select(load_all(directory or DEFAULT_DIR), only=cases, dtypes=dtypes)
    if not chosen:
        raise ValueError(f"cases {cases!r}, dtypes {dtypes!r}: no vector in {directory or DEFAULT_DIR} matches")
    return [pytest.param(v, id=v.name) for v in chosen]


def assert_conforms(fn, vector, *, require_gradients: bool = False, fail_unsupported: bool = False):
    """Verify `fn` on one vector: return the VerifyResult of a pass, skip an
    unsupported vector (fail it with fail_unsupported), and fail otherwise
    with `mha verify --verbose`'s message."""
    from conformance.suite.verify import STATUS_PASS, STATUS_UNSUPPORTED, verify_vector

    result = verify_vector(fn, vector, require_gradients=require_gradients)
    if result.status == STATUS_PASS:
        return result
    if result.status == STATUS_UNSUPPORTED and not fail_unsupported:
        pytest.skip(f"unsupported: {result.detail}")
    pytest.fail(result.message() + (f"\n\n{result.traceback}" if result.traceback else ""), pytrace=False)
