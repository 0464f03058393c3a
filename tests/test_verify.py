"""`mha verify`: a user's function against the shipped vectors, forward and
gradients, and the JUnit XML that `mha verify` and `mha check` write.

The functions under test are independent of the suite: the worked example
(examples/mha_examples/numpy_attention.py, a plain NumPy port with a
hand-written backward pass) and tests/mutants.py's port. Which vectors a bug
touches is read from the vectors' own metadata, never from verify's answer.
"""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest
from mutants import port

from conformance.cli.commands import main
from conformance.io import write_arrays
from conformance.suite import verify as V
from conformance.suite.vectors import load_all
from impl_numpy import adapter as reference
from weights import AttentionConfig
from weights.config import MODERN_DEFAULTS

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "mha_examples" / "numpy_attention.py"


def _load_example():
    spec = importlib.util.spec_from_file_location("numpy_attention_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.attention


attention = _load_example()
VECTORS = {v.name: v for v in load_all()}
# The features the example implements; vectors of others (rope, a KV cache ...) it must refuse as unsupported.
PLAIN_INPUTS = {"query", "key", "value", "mask", "bias", "dropout_mask"}
MODERN_OFF = MODERN_DEFAULTS  # every field beyond the plain layer's, each off


def is_plain(vector) -> bool:
    config = vector.config.to_dict()
    return (set(vector.inputs) <= PLAIN_INPUTS and not vector.options.get("return_cache")
            and all(config.get(name, off) == off for name, off in MODERN_OFF.items()))


PLAIN = {name: v for name, v in VECTORS.items() if is_plain(v)}


def verify_plain(fn, **kwargs):
    return [V.verify_vector(fn, v, **kwargs) for v in PLAIN.values()]


def forward_only(config, tensors, inputs, options):
    result = attention(config, tensors, inputs, options)
    result.pop("grads", None)
    return result


def output_bias_gradient_sign_flipped(config, tensors, inputs, options):
    """A backward bug that leaves the forward pass intact."""
    result = attention(config, tensors, inputs, options)
    if "output.bias" in result.get("grads", {}):
        result["grads"]["output.bias"] = -result["grads"]["output.bias"]
    return result


def default_scale_always(config, tensors, inputs, options):
    """impl_numpy with the config's `scale` ignored (always 1/sqrt(head_dim)), returning its trace."""
    cfg = AttentionConfig.from_dict({**config, "scale": None})
    return reference.forward(cfg, tensors, inputs, options, trace=True)


def causal_off_by_one(config, tensors, inputs, options):
    return port(config, tensors, inputs, options, bug="causal_off_by_one")


def by_status(results):
    out: dict[str, set[str]] = {}
    for r in results:
        out.setdefault(r.status, set()).add(r.name)
    return out


def test_the_example_passes_every_vector_with_its_gradients_checked():
    results = V.verify(attention, require_gradients=True)
    assert len(results) == len(VECTORS) and len(PLAIN) >= 128
    assert {r.name for r in results if r.status == V.STATUS_UNSUPPORTED} == set(VECTORS) - set(PLAIN)
    results = [r for r in results if r.name in PLAIN]
    bad = [r.message() for r in results if r.status != V.STATUS_PASS]
    assert not bad, "\n".join(bad)
    carrying = {n for n, v in PLAIN.items() if V.gradient_names(v)}
    assert carrying and {r.name for r in results if r.gradients == V.GRADIENTS_CHECKED} == carrying
    for r in results:  # every expected.grad.* of the vector was compared
        assert {c.name for c in r.comparisons if c.name.startswith("grad ")} == {
            f"grad {g}" for g in V.gradient_names(VECTORS[r.name])}
    assert "pass" in V.summary(results) and "forward only" not in V.summary(results)


def test_forward_only_passes_as_such_and_fails_when_gradients_are_required():
    name = "self_basic.float32"
    result = V.verify_vector(forward_only, VECTORS[name])
    assert result.status == V.STATUS_PASS and result.forward_only
    assert result.label == "pass (forward only)"
    assert "forward only" in result.message() and "11 gradients not checked" in result.message()
    assert "(1 forward only" in V.summary([result])
    required = V.verify_vector(forward_only, VECTORS[name], require_gradients=True)
    assert required.status == V.STATUS_FAIL
    assert "no 'grads' in the result (gradients required)" in required.message()
    assert "grad.output.bias" not in required.message() and "output.bias" in required.message()


def test_a_forward_bug_fails_exactly_the_vectors_it_touches_with_the_numbers():
    results = verify_plain(causal_off_by_one)
    touched = {n for n, v in PLAIN.items() if v.options["is_causal"]}
    assert len(touched) >= 20
    statuses = by_status(results)
    assert statuses[V.STATUS_FAIL] == touched
    assert statuses[V.STATUS_PASS] == set(PLAIN) - touched  # forward only: the port returns no grads
    failed = next(r for r in results if r.name == "causal_square.float64")
    # the message's worst element, recomputed here from the port's output and the expected values
    vector = VECTORS[failed.name]
    answer = causal_off_by_one(vector.config.to_dict(), vector.tensors, vector.inputs, dict(vector.options))
    tol = vector.tolerance["output"]
    err = np.abs(answer["output"] - vector.expected["output"])
    atol = np.maximum(tol["atol"], vector.allowance.get("output", 0.0))  # the elementwise floor, where larger
    ratio = err / (atol + tol["rtol"] * np.abs(vector.expected["output"]))
    worst = np.unravel_index(np.argmax(ratio), ratio.shape)
    text = failed.message()
    assert text.startswith("fail causal_square.float64: ")
    assert f"output: FAIL margin {ratio.max():.3g}" in text
    assert f"worst at {list(map(int, worst))}: got {float(answer['output'][worst])!r}" in text
    assert f"expected {float(vector.expected['output'][worst])!r}" in text
    assert f"rtol {tol['rtol']:.3g}, atol {tol['atol']:.3g}: {tol['reason']}" in text


def test_a_returned_trace_names_the_first_divergent_stage():
    results = V.verify(default_scale_always)
    touched = {n for n, v in VECTORS.items()
               if v.config.scale is not None and not math.isclose(v.config.scale, v.config.head_dim ** -0.5)}
    assert touched >= {f"{case}.{d}" for case in ("custom_scale", "large_logits")
                       for d in ("float64", "float32", "float16", "bfloat16")}
    assert by_status(results)[V.STATUS_FAIL] == touched
    for r in results:
        if r.name in touched:
            # the projections agree; the logits are the first stage off
            assert r.divergence.startswith("first divergent stage: logits (worst at ["), r.divergence
            assert r.divergence in r.message()


def test_a_gradient_only_bug_fails_on_gradients_and_passes_forward_only():
    results = verify_plain(output_bias_gradient_sign_flipped)
    touched = {n for n, v in PLAIN.items() if "output.bias" in V.gradient_names(v)}
    assert touched and touched != set(PLAIN)
    assert by_status(results)[V.STATUS_FAIL] == touched
    for r in results:
        assert all(c.ok for c in r.comparisons if not c.name.startswith("grad ")), r.message()  # forward intact
        if r.name in touched:
            assert [c.name for c in r.comparisons if not c.ok] == ["grad output.bias"]
            assert "grad output.bias: FAIL margin" in r.message()
    # the same port shipped forward only: the bug goes unseen unless gradients are required
    assert all(r.status == V.STATUS_PASS and r.forward_only for r in verify_plain(forward_only))
    assert all(r.status == V.STATUS_FAIL for r in verify_plain(forward_only, require_gradients=True))


def test_every_input_and_option_reaches_the_function_unchanged():
    seen = {}

    def spy(config, tensors, inputs, options):
        seen.update(config=config, tensors=tensors, inputs=inputs, options=options)
        return attention(config, tensors, inputs, options)

    for vector in VECTORS.values():
        V.verify_vector(spy, vector)  # the example may refuse a vector: it was still called with it
        assert seen["config"] == vector.config.to_dict()
        assert set(seen["inputs"]) == set(vector.inputs) and set(seen["tensors"]) == set(vector.tensors)
        for group in ("inputs", "tensors"):
            for key, value in getattr(vector, group).items():
                got = seen[group][key]
                assert got.dtype == value.dtype and np.array_equal(got, value, equal_nan=True), (vector.name, key)
        assert {k: v for k, v in seen["options"].items() if k != "cotangent"} == vector.options
        assert np.array_equal(seen["options"]["cotangent"], vector.cotangent)


def test_quantities_a_vector_format_adds_are_checked_generically(tmp_path):
    """A vector whose tolerance names a quantity verify has never heard of
    (the KV cache's present_key, say) requires it and checks it, and an integer
    input is passed through as it is."""
    src = VECTORS["self_basic.float32"]
    arrays = {f"weights.{k}": v for k, v in src.tensors.items()}
    arrays |= {f"inputs.{k}": v for k, v in src.inputs.items()} | {"inputs.positions": np.arange(5, dtype=np.int64)}
    arrays |= {f"expected.{k}": v for k, v in src.expected.items()} | {"expected.novel": np.full((2, 3), 0.5)}
    arrays |= {f"allowance.{k}": v for k, v in src.allowance.items()}  # the elementwise floors (a gradient's too)
    arrays["cotangent.output"] = src.cotangent
    tolerance = src.tolerance | {"novel": {"rtol": 1e-6, "atol": 1e-6, "reason": "made up for the test"}}
    metadata = {"format": "mha-vectors", "format_version": "1", "case": "invented", "dtype": "float32",
                "config": src.config.to_json(), "options": json.dumps(src.options | {"new_option": 7}),
                "tolerance": json.dumps(tolerance), "generator": "tests/test_verify.py"}
    write_arrays(tmp_path / "invented.float32.safetensors", arrays, metadata=metadata)

    def with_novel(value):
        def fn(config, tensors, inputs, options):
            assert inputs["positions"].dtype == np.int64 and options["new_option"] == 7
            return attention(config, tensors, {k: v for k, v in inputs.items() if k != "positions"}, options) | (
                {} if value is None else {"novel": np.full((2, 3), value)})
        return fn

    (good,) = V.verify(with_novel(0.5), tmp_path)
    assert good.status == V.STATUS_PASS and "novel" in [c.name for c in good.comparisons]
    (off,) = V.verify(with_novel(0.6), tmp_path)
    assert off.status == V.STATUS_FAIL and "novel: FAIL" in off.message() and "made up for the test" in off.message()
    (absent,) = V.verify(with_novel(None), tmp_path)
    assert absent.status == V.STATUS_FAIL and "no 'novel' in the result" in absent.detail


def test_crashes_and_unsupported_vectors_are_reported_not_raised():
    def crashes(config, tensors, inputs, options):
        raise RuntimeError("boom")

    def refuses(config, tensors, inputs, options):
        raise NotImplementedError("no GQA here")

    vector = VECTORS["gqa.float32"]
    crashed = V.verify_vector(crashes, vector)
    assert crashed.status == V.STATUS_ERROR and crashed.detail == "RuntimeError: boom"
    assert "raise RuntimeError" in crashed.traceback
    refused = V.verify_vector(refuses, vector)
    assert refused.status == V.STATUS_UNSUPPORTED and refused.detail == "no GQA here"
    wrong = V.verify_vector(lambda *a: [1, 2], vector)
    assert wrong.status == V.STATUS_ERROR and "expected a dict with 'output'" in wrong.detail


def test_a_core_backends_own_function_is_judged_as_the_column_it_runs_as(monkeypatch):
    """impl_tf's function runs as tf, keras-jax or keras-torch by the Keras backend Keras runs on (its adapter's
    NAME): `mha verify` reads that column's NOT_YET, as `mha check` does, not tf's whatever the Keras backend
    (the package name alone said tf). The adapter stands in here (no Keras needed): tests/test_keras_backends.py
    runs the real one on Keras's jax backend."""
    import types

    from conformance.suite import backends

    vector = VECTORS["gqa.float32"]

    def keras_port(config, tensors, inputs, options):
        raise AssertionError("a backend's NOT_YET config is never called")

    keras_port.__module__ = "impl_tf.adapter"
    monkeypatch.setitem(sys.modules, "impl_tf.adapter", types.SimpleNamespace(NAME="keras-jax"))
    monkeypatch.setattr(backends, "NOT_YET", {"keras-jax": {"num_kv_heads": "GQA: not yet on keras-jax"},
                                              "tf": {}})
    assert V.core_backend(keras_port) == "keras-jax"
    refused = V.verify_vector(keras_port, vector)
    assert (refused.status, refused.detail) == (V.STATUS_UNSUPPORTED, "GQA: not yet on keras-jax"), refused
    monkeypatch.setitem(sys.modules, "impl_tf.adapter", types.SimpleNamespace(NAME="tf"))
    monkeypatch.setattr(backends, "NOT_YET", {"keras-jax": {}, "tf": {"num_kv_heads": "GQA: not yet on tf"}})
    assert V.verify_vector(keras_port, vector).detail == "GQA: not yet on tf"
    monkeypatch.setitem(sys.modules, "impl_mlx.adapter", types.ModuleType("impl_mlx.adapter"))  # no NAME
    keras_port.__module__ = "impl_mlx.adapter"
    assert V.core_backend(keras_port) == "mlx" and V.core_backend(attention) is None  # a user's: no column


# -- the command line ------------------------------------------------------------------

@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """The example copied beside a user's working directory, plus two buggy variants."""
    shutil.copy(EXAMPLE, tmp_path / "attention.py")
    (tmp_path / "buggy.py").write_text(
        "from attention import attention\n\n\n"
        "def grad_bug(config, tensors, inputs, options):\n"
        "    result = attention(config, tensors, inputs, options)\n"
        "    if 'output.bias' in result.get('grads', {}):\n"
        "        result['grads']['output.bias'] = -result['grads']['output.bias']\n"
        "    return result\n\n\n"
        "def forward_only(config, tensors, inputs, options):\n"
        "    result = attention(config, tensors, inputs, options)\n"
        "    result.pop('grads', None)\n"
        "    return result\n")
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    for name in ("attention", "buggy"):
        sys.modules.pop(name, None)


def run_cli(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_verify_writes_junit_one_testcase_per_vector(user_module, capsys):
    code, out, err = run_cli(capsys, "verify", "--impl", "buggy:grad_bug", "--dtypes", "float32", "float64",
                             "--junit", "out.xml")
    chosen = {n for n, v in VECTORS.items() if v.dtype in ("float32", "float64")}
    touched = {n for n in chosen & set(PLAIN) if "output.bias" in V.gradient_names(VECTORS[n])}
    assert code == 1, err
    assert f"{len(chosen)} vectors: " in out and f"{len(touched)} fail" in out
    root = ET.parse(user_module / "out.xml").getroot()
    assert root.tag == "testsuites"
    (suite,) = root.findall("testsuite")
    every = suite.findall("testcase")
    assert len(every) == int(suite.get("tests"))
    # one testcase per vector, and one <skipped> per comparison not judged ("VECTOR QUANTITY": never a pass)
    cases = [c for c in every if " " not in c.get("name")]
    not_judged = [c for c in every if " " in c.get("name")]
    assert len(cases) == len(chosen)
    assert all(c.find("skipped") is not None and "not judged" in c.find("skipped").get("message", "") +
               (c.find("skipped").text or "") for c in not_judged)
    assert {c.get("name") for c in cases} == chosen
    failed = {c.get("name"): c.find("failure") for c in cases if c.find("failure") is not None}
    assert set(failed) == touched and int(suite.get("failures")) == len(touched)
    results = {r.name: r for r in V.verify(output_bias_gradient_sign_flipped, only=["no_weights"], dtypes=["float32"])}
    assert failed["no_weights.float32"].text == results["no_weights.float32"].message()
    assert failed["no_weights.float32"].get("message") == results["no_weights.float32"].message().splitlines()[0]
    for line in results["no_weights.float32"].message().splitlines():  # full width: not wrapped at 80 columns
        assert line in out


def test_cli_verify_require_gradients_and_forward_only(user_module, capsys):
    code, out, _ = run_cli(capsys, "verify", "--impl", "buggy:forward_only", "--cases", "self_basic")
    assert code == 0 and "4 pass (4 forward only: no 'grads' returned)" in out
    code, out, _ = run_cli(capsys, "verify", "--impl", "buggy:forward_only", "--cases", "self_basic",
                           "--require-gradients", "--junit", "r.xml")
    assert code == 1 and "4 fail" in out
    suite = ET.parse(user_module / "r.xml").getroot().find("testsuite")
    assert suite.get("failures") == "4" and "gradients required" in suite.find("testcase/failure").text
    code, out, _ = run_cli(capsys, "verify", "--impl", "attention:attention", "--require-gradients", "--verbose",
                           "--cases", "gqa", "--dtypes", "bfloat16")
    assert code == 0 and out.startswith("pass gqa.bfloat16: worst ")


@pytest.mark.parametrize("argv, message", [
    (["--junit", "."], "--junit .: is a directory"),
    (["--junit", "nowhere/out.xml"], "--junit nowhere/out.xml: directory nowhere does not exist"),
    (["--cases", "no_such_case"], "no vector in"),
])
def test_cli_verify_refuses_bad_arguments_in_one_line(user_module, capsys, argv, message):
    code, out, err = run_cli(capsys, "verify", "--impl", "attention:attention", *argv)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_junit_marks_unsupported_as_skipped_and_errors_with_their_traceback(tmp_path):
    from conformance.suite import junit

    def picky(config, tensors, inputs, options):
        if config["num_kv_heads"] != config["num_heads"]:
            raise NotImplementedError("no GQA")
        if "mask" in inputs:
            raise KeyError("\x00mask")  # a NUL, which XML cannot hold
        return forward_only(config, tensors, inputs, options)

    results = V.verify(picky, dtypes=["float32"])
    junit.write_verify(tmp_path / "v.xml", results, impl="m:picky", seconds=1.5)
    suite = ET.parse(tmp_path / "v.xml").getroot().find("testsuite")
    cases = {c.get("name"): c for c in suite.findall("testcase")}
    assert len(cases) == sum(v.dtype == "float32" for v in VECTORS.values())
    assert cases["gqa.float32"].find("skipped").text == "unsupported: no GQA"
    error = cases["padding_mask.float32"].find("error")
    assert "KeyError" in error.get("message") and "Traceback" in error.text and "\x00" not in error.text
    assert "forward only" in cases["self_basic.float32"].find("system-out").text
    counts = {s: sum(r.status == s for r in results) for s in ("unsupported", "error")}
    assert suite.get("skipped") == str(counts["unsupported"]) and suite.get("errors") == str(counts["error"])


def test_check_junit_one_testcase_per_case_backend_path_device_dtype(tmp_path, capsys):
    code, out, err = run_cli(capsys, "check", "--backends", "numpy", "--cases", "self_basic", "gqa",
                             "--dtypes", "float32", "float16", "--jobs", "1", "--junit", tmp_path / "c.xml")
    assert code == 0, out + err
    suite = ET.parse(tmp_path / "c.xml").getroot().find("testsuite")
    names = sorted((c.get("classname"), c.get("name")) for c in suite.findall("testcase")
                   if " " not in c.get("name"))  # "CASE.DTYPE QUANTITY": a comparison not judged, <skipped>
    # the fused core exists in float32 only (float16 storage computes on the stages); neither case has a cache
    assert names == sorted([("mha.check.numpy.stages.cpu", f"{case}.{dtype}") for case in ("self_basic", "gqa")
                            for dtype in ("float32", "float16")]
                           + [("mha.check.numpy.fused.cpu", f"{case}.float32") for case in ("self_basic", "gqa")])
    assert suite.get("failures") == "0" and ": ok margin" in suite.find("testcase/system-out").text


def test_check_junit_failure_message_and_backends_not_run(tmp_path):
    from mutants import MutantAdapter

    from conformance.suite import junit
    from conformance.suite.cases import CASES
    from conformance.suite.compare import run_case

    results = [run_case(CASES["causal_square"], "mutant", dtype="float32", adapter=MutantAdapter("causal_off_by_one"),
                        gradients=False),
               run_case(CASES["self_basic"], "mutant", dtype="float32", adapter=MutantAdapter("causal_off_by_one"),
                        gradients=False)]
    junit.write_check(tmp_path / "c.xml", results, seconds=0.5,
                      skipped=[("torch", "-", "backend torch: torch is not installed")])
    suite = ET.parse(tmp_path / "c.xml").getroot().find("testsuite")
    cases = {(c.get("classname"), c.get("name")): c for c in suite.findall("testcase")}
    failure = cases[("mha.check.mutant.cpu", "causal_square.float32")].find("failure")
    assert failure.text.startswith("fail causal_square.float32 on mutant/cpu (highest)")
    assert results[0].worst.describe() in failure.text
    assert cases[("mha.check.mutant.cpu", "self_basic.float32")].find("failure") is None
    assert cases[("mha.check.torch.-", "not run")].find("skipped").text == "backend torch: torch is not installed"
    assert (suite.get("tests"), suite.get("failures"), suite.get("skipped")) == ("3", "1", "1")


def test_quantities_declared_not_returned_are_reported_and_not_checked():
    def no_weights_one_input(config, tensors, inputs, options):
        result = attention(config, tensors, inputs, options)
        result.pop("weights", None)
        for name in ("query", "key", "value"):
            result["grads"].pop(name)
        result["not_returned"] = {"weights": "this API returns none", "grad query": "one input",
                                  "grad key": "one input", "grad value": "one input"}
        return result

    result = V.verify_vector(no_weights_one_input, VECTORS["self_basic.float32"], require_gradients=True)
    assert result.status == V.STATUS_PASS, result.message()
    assert result.unchecked == {"weights": "this API returns none", "grad query": "one input", "grad key": "one input",
                                "grad value": "one input"}
    assert "not returned: weights (this API returns none); grad key, grad query, grad value (one input)" in result.detail
    assert sorted(c.name for c in result.comparisons) == sorted(
        ["output"] + [f"grad {n}" for n in VECTORS["self_basic.float32"].tensors])
    assert "(1 with quantities not returned)" in V.summary([result])

    def undeclared(config, tensors, inputs, options):
        result = no_weights_one_input(config, tensors, inputs, options)
        del result["not_returned"]["grad key"]
        return result

    failed = V.verify_vector(undeclared, VECTORS["self_basic.float32"])
    assert failed.status == V.STATUS_FAIL and "grads lacks key" in failed.detail

    def output_excused(config, tensors, inputs, options):
        return {"weights": attention(config, tensors, inputs, options)["weights"], "not_returned": {"output": "no"}}

    assert V.verify_vector(output_excused, VECTORS["self_basic.float32"]).status == V.STATUS_ERROR
