"""`mha check` judges every path a user can run, each as a column of its own.

Each core backend names its paths (adapter.PATHS: the stages, its fast
path, the chunked core, an in-place cache); run_case(path=...) runs a case on
one of them, and a bug planted in one fast path alone fails that column,
where the check as it was (every case on its own options, which ask for the
weights and so run the stages) passed it.
"""

from __future__ import annotations

import dataclasses
import importlib
import json

import numpy as np
import pytest

from conformance.suite import backends, check
from conformance.suite.cases import CASES
from conformance.suite.compare import DEFAULT_PATH, STATUS_FAIL, STATUS_PASS, run_case

# Cases that reach the fast paths' features: plain, masks and bias, causal, GQA, a cache, RoPE + QK-norm.
PLANT_CASES = ("self_basic", "mask_and_bias_causal", "gqa", "decode_cache", "qk_norm_rms_head")
EXPECTED_PATHS = {"numpy": ("stages", "fused", "chunked", "in_place"), "torch": ("stages", "sdpa", "in_place"),
                  "tf": ("stages", "fused", "chunked", "in_place"), "jax": ("stages", "fused", "chunked", "in_place")}
MARKS = {"numpy": [], "torch": [pytest.mark.torch], "tf": [pytest.mark.tf], "jax": [pytest.mark.jax]}


def adapter_or_skip(backend_id):
    try:
        return backends.load(backend_id)
    except backends.BackendUnavailable as err:
        pytest.skip(str(err))


def per_backend(*names):
    return [pytest.param(name, marks=MARKS[name], id=name) for name in names]


@pytest.mark.parametrize("backend_id", per_backend("numpy", "torch", "tf", "jax"))
def test_each_core_backend_names_its_paths(backend_id):
    adapter = adapter_or_skip(backend_id)
    assert tuple(adapter.PATHS) == EXPECTED_PATHS[backend_id]
    fast = "sdpa" if backend_id == "torch" else "fused"
    assert adapter.FAST_PATH == fast
    assert check.paths_of(adapter, check.DEFAULT_PATH_KINDS) == ["stages", fast, "in_place"]
    # torch's one chunked path is DeepSeek V4's block-wise one (COMPRESSED_CHUNKED: tests/test_check_paths_v4.py)
    assert check.paths_of(adapter, check.PATH_KINDS) == list(EXPECTED_PATHS[backend_id]) + (
        ["chunked"] if backend_id == "torch" else [])


def test_a_backend_with_one_path_runs_it_as_the_default():
    class OnePath:  # a native layer or a user's function: no PATHS
        pass

    assert check.paths_of(OnePath(), check.DEFAULT_PATH_KINDS) == [DEFAULT_PATH]


def test_a_path_that_does_not_exist_for_a_case_gives_no_result():
    """The in-place cache needs a cache; NumPy's fused core never takes 16-bit storage (its stages round
    every result to it): no row, not an 'unsupported' one."""
    assert run_case(CASES["self_basic"], "numpy", dtype="float32", path="in_place") is None
    assert run_case(CASES["self_basic"], "numpy", dtype="float16", path="fused") is None
    ran = run_case(CASES["decode_cache"], "numpy", dtype="float16", path="in_place")
    assert ran.status == STATUS_PASS and ran.path == "in_place", ran.message


# -- each path runs what it names (a spy on the path's own core) ------------------------------------------

def _spies(backend_id):
    """(module, function) of each path's own core, as the mirror's dispatch calls it."""
    return {
        "numpy": {"fused": ("impl_numpy.chunked", "fused_forward"), "chunked": ("impl_numpy.chunked", "fused_forward")},
        "torch": {"sdpa": ("impl_torch.attention", "sdpa_attend")},
        "tf": {"fused": ("impl_tf.attention", "_attention"), "chunked": ("impl_tf.attention", "chunked_attention"),
               "in_place": ("impl_tf.attention", "in_place_fused")},
        "jax": {"fused": ("impl_jax.attention", "fused_attention"), "chunked": ("impl_jax.attention",
                                                                                "chunked_attention")},
    }[backend_id]


@pytest.mark.parametrize("backend_id", per_backend("numpy", "torch", "tf", "jax"))
def test_each_path_runs_its_own_core_and_the_stages_do_not(backend_id, monkeypatch):
    adapter = adapter_or_skip(backend_id)
    if backend_id == "jax":
        import jax

        jax.clear_caches()  # the spy sees a trace, so every program must be traced afresh
    calls: dict[str, int] = {}
    for path, (module_name, function) in _spies(backend_id).items():
        module = importlib.import_module(module_name)
        original = getattr(module, function)

        def spy(*args, _original=original, _path=path, **kwargs):
            calls[_path] = calls.get(_path, 0) + 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, function, spy)
    case = CASES["decode_cache"]  # has a cache: every path exists for it
    for path in adapter.PATHS:
        calls.clear()
        result = run_case(case, backend_id, dtype="float64", adapter=adapter, path=path)
        assert result.status == STATUS_PASS and result.path == path, (path, result.message)
        spied = set(_spies(backend_id))
        ran = {p for p in spied if calls.get(p)}
        if path == "stages":
            assert not ran, f"the stages path called the cores of {sorted(ran)}"
        elif path in spied:
            assert path in ran, f"the {path} path never called its core ({_spies(backend_id)[path]}); calls {calls}"
    if backend_id == "jax":
        jax.clear_caches()


# -- a bug planted in one fast path fails that column, and the check as it was passed it ----------------

def _plant_wrong_scale(backend_id, monkeypatch):
    """The fast path's own scale 10% off (the stages untouched): a realistic port bug that only the
    fast path's column can see."""
    if backend_id == "numpy":
        from impl_numpy import chunked

        original = chunked.fused_forward
        monkeypatch.setattr(chunked, "fused_forward", lambda config, call, **kw: original(
            dataclasses.replace(config, scale=config.effective_scale * 1.1), call, **kw))
    elif backend_id == "torch":
        from impl_torch import attention

        original = attention.sdpa_attend
        monkeypatch.setattr(attention, "sdpa_attend", lambda config, q, k, v, **kw: original(
            dataclasses.replace(config, scale=config.effective_scale * 1.1), q, k, v, **kw))
    elif backend_id == "tf":
        from impl_tf import attention

        original = attention._attention
        monkeypatch.setattr(attention, "_attention", lambda q, k, v, scale, **kw: original(q, k, v, scale=scale * 1.1,
                                                                                            **kw))
    else:
        import jax

        from impl_jax import attention

        original = attention.fused_attention
        monkeypatch.setattr(attention, "fused_attention", lambda q, k, v, allowed, bias, scale, *a, **kw: original(
            q, k, v, allowed, bias, scale * 1.1, *a, **kw))
        jax.clear_caches()


@pytest.mark.parametrize("backend_id", per_backend("numpy", "torch", "tf", "jax"))
def test_a_bug_in_one_fast_path_fails_its_column_and_only_it(backend_id, monkeypatch):
    adapter = adapter_or_skip(backend_id)
    _plant_wrong_scale(backend_id, monkeypatch)
    results, skipped = check.run_check([backend_id], dtypes=["float32"], case_names=list(PLANT_CASES), jobs=1,
                                       progress=False, compile_cache=None)
    assert not skipped, skipped
    by_path: dict[str, list] = {}
    for r in results:
        by_path.setdefault(r.path, []).append(r)
    fast = adapter.FAST_PATH
    failed = [r.case for r in by_path[fast] if r.status == STATUS_FAIL]
    assert len(failed) == len(PLANT_CASES), f"{fast}: only {failed} of {PLANT_CASES} failed"
    stages = [(r.case, r.status) for r in by_path["stages"] if r.status != STATUS_PASS]
    assert not stages, f"the stages column should not see a fast path's bug: {stages}"
    if backend_id == "tf":
        return  # the check as it was took Keras's gradients through the fused path (its vjp asked for no weights)
    # mha check as it was: every case on its own options (return_weights=True but for two cases), no use_sdpa
    before = [run_case(CASES[name], backend_id, dtype="float32", adapter=adapter) for name in PLANT_CASES]
    caught_before = {r.case for r in before if r.status != STATUS_PASS}
    # decode_cache asks for no weights, so NumPy's and JAX's old check ran their fused path there alone;
    # torch's never set use_sdpa
    assert caught_before == ({"decode_cache"} if backend_id in ("numpy", "jax") else set()), caught_before
    if backend_id == "jax":
        import jax

        jax.clear_caches()


def test_the_path_is_in_the_json_the_junit_and_the_table(tmp_path):
    from conformance.suite import junit, report

    results = [r for r in (run_case(CASES["decode_cache"], "numpy", dtype="float32", path=p)
                           for p in ("stages", "fused", "in_place"))]
    assert [json.loads(json.dumps(r.to_json()))["path"] for r in results] == ["stages", "fused", "in_place"]
    names = [c.classname for c in junit.check_cases(results)]
    assert names == ["mha.check.numpy.stages.cpu", "mha.check.numpy.fused.cpu", "mha.check.numpy.in_place.cpu"]
    rows = report.matrix(results)
    assert [(row["backend"], row["path"], row["dtype"]) for row in rows] == [
        ("numpy", "stages", "float32"), ("numpy", "fused", "float32"), ("numpy", "in_place", "float32")]
    assert report.MATRIX_COLUMNS[:4] == ("backend", "path", "device", "dtype")
    fused = results[1]
    assert fused.message.startswith("forward only: impl_numpy has one backward pass"), fused.message
    assert not any(c.name.startswith("grad ") for c in fused.comparisons)
    assert any(c.name.startswith("grad ") for c in results[0].comparisons)
    assert np.isfinite(fused.margin)


@pytest.mark.jax
def test_jax_runs_a_cases_stages_and_fused_path_as_one_program_judged_as_apart(monkeypatch):
    """run_case_paths (what `mha check` runs) hands impl_jax a case's stages and fused calls together
    (forward_and_vjp_paths: one compiled program); each path is judged as run_case judges it alone, with the
    same verdict and the same answer to round-off; the in-place path (forward only) runs alone; a joint run
    that fails leaves each path to run alone."""
    from conformance.suite.compare import run_case_paths

    adapter = adapter_or_skip("jax")
    alone_calls = []
    alone = adapter.forward_and_vjp
    monkeypatch.setattr(adapter, "forward_and_vjp", lambda *a, **kw: alone_calls.append(a[3]) or alone(*a, **kw))
    paths = ["stages", "fused", "in_place"]
    for name in ("mask_and_bias_causal", "decode_cache"):
        case = CASES[name]
        alone_calls.clear()
        together = run_case_paths(case, "jax", paths, dtype="float32", adapter=adapter, keep_arrays=True)
        assert not alone_calls, f"{name}: stages and fused should have run as one program"
        apart = [run_case(case, "jax", dtype="float32", adapter=adapter, keep_arrays=True, path=p) for p in paths]
        apart = [r for r in apart if r is not None]
        assert [r.path for r in together] == [r.path for r in apart]
        for joint, single in zip(together, apart):
            assert joint.status == single.status == STATUS_PASS, (name, joint.path, joint.message, single.message)
            a, b = joint.arrays["backend_output"], single.arrays["backend_output"]
            size = float(np.max(np.abs(b))) or 1.0
            assert np.max(np.abs(a - b)) <= 64 * np.finfo(np.float32).eps * size, (name, joint.path)
            assert [c.name for c in joint.comparisons] == [c.name for c in single.comparisons]

    def broken(*a, **kw):
        raise RuntimeError("a joint program that cannot be built")

    monkeypatch.setattr(adapter, "forward_and_vjp_paths", broken)
    alone_calls.clear()
    fallback = run_case_paths(CASES["gqa"], "jax", paths, dtype="float32", adapter=adapter)
    assert [(r.path, r.status) for r in fallback] == [("stages", STATUS_PASS), ("fused", STATUS_PASS)]
    assert len(alone_calls) == 2  # each path alone, as run_case runs it
