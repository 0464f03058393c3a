"""impl_jax against the float64 NumPy reference, on the named case grid.

Tolerances come only from conformance.suite.tolerance (the one policy), through
conformance.suite.compare.run_case as `mha check` uses it; nothing here picks a
number. Bit-exact properties (round trips, mask builders, error wording,
x64 on/off) are compared exactly, with the differing values in the message.

Importing impl_jax.adapter switches on JAX's x64 mode (float64 is a
conformance dtype); tests that need it off use the `jax.enable_x64(False)`
context manager.
"""

from __future__ import annotations

import functools
import os

import numpy as np
import pytest

INSTALL = "JAX/Flax not installed: pip install -c constraints/cpu.txt '.[jax]'"
jax = pytest.importorskip("jax", reason=INSTALL)
pytest.importorskip("flax", reason=INSTALL)

import jax.numpy as jnp  # noqa: E402
from assertions import assert_bit_equal, ulps_between  # noqa: E402
from flax import nnx  # noqa: E402
from reference_checks import (  # noqa: E402
    MASK_BUILDER_BAD_CALLS,
    assert_case_conforms,
    assert_gradients_conform,
    bad_calls,
    error_of,
)

import impl_jax  # noqa: E402
import impl_jax.adapter as adapter  # noqa: E402  (switches x64 on)
import impl_jax.attention as jax_attention  # noqa: E402
import impl_jax.functional as jax_functional  # noqa: E402
import impl_numpy  # noqa: E402
import impl_numpy.adapter as numpy_adapter  # noqa: E402
import weights  # noqa: E402
from conformance.suite.cases import (  # noqa: E402
    CASES,
    DTYPE_NAMES,
    MHA_CASES,
    cast_inputs,
    cast_tensors,
    make_inputs,
    make_tensors,
    output_cotangent,
)
from conformance.suite.compare import case_policy, expected_for, judge_selection  # noqa: E402
from conformance.suite.tolerance import compare, max_finite_abs, policy_for  # noqa: E402
from weights.call import OPTIONAL_STAGES, result_names  # noqa: E402

pytestmark = pytest.mark.jax

NO_GPU = "no GPU: jax.devices('gpu') fails (a GPU machine needs a CUDA jaxlib: pip install 'jax[cuda12]')"
needs_gpu = pytest.mark.skipif(not impl_jax.gpu_available(), reason=NO_GPU)


# -- references and helpers ---------------------------------------------------------------

@functools.cache
def reference(name: str):
    """float64 NumPy reference on float64 inputs: forward with trace, vjp."""
    case = CASES[name]
    tensors, inputs = make_tensors(case), make_inputs(case)
    fwd = numpy_adapter.forward(case.config, tensors, inputs, case.options("float64"), trace=True)
    vjp = numpy_adapter.vjp(case.config, tensors, inputs, case.options("float64"), output_cotangent(case))
    return fwd, vjp


def logits_of(name: str) -> np.ndarray:
    return dict(reference(name)[0]["trace"])["logits"]


def compared(label, actual, expected, name, dtype, quantity, **kwargs):
    """The policy's Comparison of actual against expected (not raising: callers assert .ok)."""
    case = CASES[name]
    tol = policy_for(case.config, dtype=dtype, quantity=quantity, B=case.B, T=case.T, S=case.S_total,
                     reference=expected, logits=logits_of(name), **kwargs)
    return compare(f"{name}/{dtype}/{label}", actual, expected, tol)


def case_arrays(name: str, dtype: str):
    case = CASES[name]
    return case, cast_tensors(make_tensors(case), dtype), cast_inputs(make_inputs(case), dtype)


def call_kwargs(case, inputs) -> dict:
    """apply's keyword arguments for a case (everything but query, key, value)."""
    return dict(mask=inputs.get("mask"), bias=inputs.get("bias"), dropout_mask=inputs.get("dropout_mask"),
                is_causal=case.is_causal, causal_alignment=case.causal_alignment, training=case.training)


class Recorder:
    """An adapter that keeps its last answers (so the grid calls JAX once)."""

    def __init__(self, inner):
        self.inner, self.forward_answer, self.vjp_answer = inner, None, None

    def devices(self):
        return self.inner.devices()

    def forward(self, *args, **kwargs):
        self.forward_answer = self.inner.forward(*args, **kwargs)
        return self.forward_answer

    def vjp(self, *args, **kwargs):
        self.vjp_answer = self.inner.vjp(*args, **kwargs)
        return self.vjp_answer


# -- forward, weights, gradients over every case and dtype --------------------------------

@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("name", list(MHA_CASES))
def test_case_matches_reference(name, dtype):
    """Output, weights and every gradient (jax.vjp), judged exactly as `mha check` does."""
    case = CASES[name]
    recorder = Recorder(adapter)
    assert_case_conforms(case, dtype, "jax", recorder)
    want = weights.dtype_from_name(dtype)
    fwd, back = recorder.forward_answer, recorder.vjp_answer
    index = case.config.indexer is not None  # the indexer's selection (and its cache) are answered too
    keys = result_names(case.return_weights, case.return_cache, index, index)
    assert list(fwd) == keys, (
        f"forward answered keys {list(fwd)} with return_weights={case.return_weights}, "
        f"return_cache={case.return_cache}")
    expected_grads = expected_for(case, dtype)["grads"]
    assert list(back["grads"]) == list(expected_grads), f"gradient names {list(back['grads'])} != {list(expected_grads)}"
    for label, array in [("output", fwd["output"]), *((f"grad {g}", a) for g, a in back["grads"].items())]:
        assert isinstance(array, np.ndarray) and array.dtype == want, (
            f"{label}: {type(array).__name__} of dtype {array.dtype}, expected a NumPy {want}")
    # vjp's own forward value is judged too (run_case judges forward()'s); with an indexer against the reference
    # attending to the backend's own admissible selection, as run_case judges it (16-bit near-ties:
    # indexer_ties_near)
    own = None
    if index:
        _, own = judge_selection(case, dtype, fwd["selection"], case.options(dtype))
    exp = expected_for(case, dtype, own)
    tol = case_policy(case, dtype, "output", "output", exp["output"], selection=own)
    result = compare(f"{name}/{dtype}/vjp output", back["output"], exp["output"], tol)
    assert result.ok, result.describe()


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_self_attention_grads_fold_into_query(dtype):
    """key and value default to the query: one gradient, for query, as in the reference."""
    case = CASES["self_basic"]
    tensors = cast_tensors(make_tensors(case), dtype)
    inputs = {"query": cast_inputs(make_inputs(case), dtype)["query"]}
    d_out = output_cotangent(case).astype(weights.dtype_from_name(dtype))
    got = adapter.vjp(case.config, tensors, inputs, case.options(dtype), d_out)["grads"]
    t64, q64 = cast_tensors(tensors, "float64"), inputs["query"].astype(np.float64)
    _, want, magnitudes = impl_numpy.multi_head_attention_vjp(case.config, t64, q64, d_output=d_out.astype(np.float64),
                                                              gradient_magnitudes=True)
    assert list(got) == list(want) and "key" not in got, f"gradient names {list(got)} != {list(want)}"
    for g in want:
        assert (cmp := compared(f"grad {g}", got[g], want[g], case.name, dtype, "grad", scale_floor=max_finite_abs(magnitudes[g]))).ok, cmp.describe()


@pytest.mark.filterwarnings("ignore:invalid value encountered in subtract:RuntimeWarning")  # -inf - -inf in compare()
@pytest.mark.parametrize("name", ["mask_and_bias_causal", "dropout_train"])
def test_trace_stages_match_reference(name):
    """Every stage a plain layer runs, named as the reference's trace names it (impl_numpy.STAGES
    less weights.call.OPTIONAL_STAGES), against the float64 reference's stage."""
    case, tensors, inputs = case_arrays(name, "float32")
    got = adapter.forward(case.config, tensors, inputs, case.options("float32"), trace=True)["trace"]
    want = reference(name)[0]["trace"]
    plain = [s for s in impl_numpy.STAGES if s not in OPTIONAL_STAGES]
    assert [s for s, _ in got] == [s for s, _ in want] == plain, f"stages {[s for s, _ in got]}"
    assert impl_jax.STAGES == impl_numpy.STAGES, f"{impl_jax.STAGES} != {impl_numpy.STAGES}"
    failures = []
    for (stage, value), (_, expected) in zip(got, want):
        try:
            assert (cmp := compared(f"stage {stage}", value, expected, name, "float32", "stage")).ok, cmp.describe()
        except AssertionError as err:
            failures.append(str(err))
    assert not failures, "\n".join(failures)


def _stage_call(stage, dtype, module, as_array):
    """One stage on non-negative data with long reductions; arrays made by `as_array`."""
    rng = np.random.default_rng(len(stage))
    dt = weights.dtype_from_name(dtype)
    u = lambda *shape: as_array(rng.random(shape).astype(dt))  # noqa: E731
    logits = as_array((rng.standard_normal((2, 2, 8, 512)) * 3).astype(dt))
    calls = {
        "project": lambda: module.project(u(2, 8, 256), u(256, 2, 4) / 16, u(2, 4)),
        "logits": lambda: module.logits(u(2, 4, 8, 256), u(2, 2, 8, 256), 0.0625),
        "mask": lambda: module.mask(logits, None, as_array(rng.random((2, 1, 8, 512)).astype(np.float32))),
        "softmax": lambda: module.softmax(logits, "zero"),
        "dropout": lambda: module.dropout(u(2, 2, 8, 512), as_array(rng.random((2, 2, 8, 512)) < 0.7), 0.3),
        "attend": lambda: module.attend(u(2, 4, 8, 512) / 512, u(2, 2, 512, 4)),
        "output": lambda: module.output(u(2, 8, 256), u(32, 8, 4) / 16, u(4)),
    }
    return calls[stage]()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("stage", ["project", "logits", "mask", "softmax", "dropout", "attend", "output"])
def test_precision_rule_16bit_stages(stage, dtype):
    """The spec's precision rule: a 16-bit stage is its float32 arithmetic
    rounded once to 16 bits. On non-negative data two float32 evaluations
    differ by far less than a 16-bit ulp, so the rounded results are equal or
    one ulp apart; arithmetic in 16 bits lands several ulps away."""
    from impl_numpy import functional as numpy_functional

    got = _stage_call(stage, dtype, jax_functional, jnp.asarray)
    assert isinstance(got, jax.Array), f"{stage}: returned {type(got).__name__}, not a jax.Array"
    got = np.asarray(got)
    want = _stage_call(stage, dtype, numpy_functional, np.asarray)
    assert got.dtype == want.dtype, f"{stage}: dtype {got.dtype}, the spec's {want.dtype}"
    ulps = ulps_between(got, want, dtype)
    worst = np.unravel_index(int(np.argmax(ulps)), ulps.shape)
    assert ulps.max() <= 1, (
        f"{stage} {dtype}: {ulps.max():g} ulps from the spec at {list(worst)} "
        f"(got {got[worst]!r}, spec {want[worst]!r}); {int((ulps > 1).sum())} of {ulps.size} beyond 1 ulp")


# -- jit, grad, vmap of the pure apply ------------------------------------------------------

JIT_APPLY = jax.jit(impl_jax.apply, static_argnames=impl_jax.STATIC_ARGNAMES)


def test_jit_matches_eager_and_reference():
    name = "mask_and_bias_causal"
    case, tensors, inputs = case_arrays(name, "float32")
    args = (case.config, tensors, inputs["query"], inputs["key"], inputs["value"])
    eager_out, eager_w = impl_jax.apply(*args, return_weights=True, **call_kwargs(case, inputs))
    jit_out, jit_w = JIT_APPLY(*args, return_weights=True, **call_kwargs(case, inputs))
    for label, got, eager in (("output", jit_out, eager_out), ("weights", jit_w, eager_w)):
        assert (cmp := compared(f"jit vs eager {label}", np.asarray(got), np.asarray(eager), name, "float32", label)).ok, cmp.describe()
        assert (cmp := compared(f"jit {label}", np.asarray(got), reference(name)[0][label], name, "float32", label)).ok, cmp.describe()


def test_grad_matches_reference_jit_and_eager():
    """jax.grad of <apply(...), d_output> for inputs and every tensor, jitted and eager."""
    name = "gqa"
    case, tensors, inputs = case_arrays(name, "float32")
    d_out = jnp.asarray(output_cotangent(case).astype(np.float32))
    extra = call_kwargs(case, inputs)

    def loss(params, query, key, value):
        return jnp.sum(impl_jax.apply(case.config, params, query, key, value, **extra) * d_out)

    grad = jax.grad(loss, argnums=(0, 1, 2, 3))
    xs = [jnp.asarray(inputs[n]) for n in ("query", "key", "value")]
    params = {n: jnp.asarray(t) for n, t in tensors.items()}
    jitted = jax.jit(grad)(params, *xs)
    eager = grad(params, *xs)
    for g_params, g_query, g_key, g_value in (jitted, eager):
        grads = {"query": g_query, "key": g_key, "value": g_value, **g_params}
        assert_gradients_conform(case, "float32", {n: np.asarray(g) for n, g in grads.items()})
    for n in jitted[0]:
        assert (cmp := compared(f"grad {n} jit vs eager", np.asarray(jitted[0][n]), np.asarray(eager[0][n]), name, "float32", "grad",
              scale_floor=max_finite_abs(expected_for(case, "float32")["magnitudes"][n]))).ok, cmp.describe()


def test_vmap_over_inputs_and_over_parameters_matches_loop():
    """vmap (jitted) over a stack of input sets (mask too), and over a stack of
    weight sets, against eager calls one by one."""
    name = "padding_mask"
    case = CASES[name]
    dtype = "float32"
    rng = np.random.default_rng(11)
    c = case.config
    E = 3
    queries = rng.standard_normal((E, case.B, case.T, c.query_dim)).astype(np.float32)
    keys = rng.standard_normal((E, case.B, case.S, c.key_dim)).astype(np.float32)
    values = rng.standard_normal((E, case.B, case.S, c.value_dim)).astype(np.float32)
    masks = rng.random((E, case.B, 1, 1, case.S)) < 0.7
    masks[..., 0] = True
    tensors = cast_tensors(make_tensors(case), dtype)

    def one(q, k, v, m):
        return impl_jax.apply(c, tensors, q, k, v, mask=m)

    stacked = np.asarray(jax.jit(jax.vmap(one))(queries, keys, values, masks))
    for e in range(E):
        want = numpy_adapter.forward(c, make_tensors(case), {"query": queries[e], "key": keys[e], "value": values[e],
                                                              "mask": masks[e]}, {"return_weights": False})["output"]
        eager = np.asarray(one(queries[e], keys[e], values[e], masks[e]))
        assert (cmp := compared(f"vmap[{e}] vs eager", stacked[e], eager, name, dtype, "output")).ok, cmp.describe()
        assert (cmp := compared(f"vmap[{e}] vs reference", stacked[e], want, name, dtype, "output")).ok, cmp.describe()

    ensemble = [cast_tensors(weights.init(c, seed=s, dtype="float64"), dtype) for s in (1, 2)]
    params = jax.tree.map(lambda *ts: jnp.stack(ts), *ensemble)
    q, k, v, m = queries[0], keys[0], values[0], masks[0]
    by_params = np.asarray(jax.jit(jax.vmap(lambda p: impl_jax.apply(c, p, q, k, v, mask=m)))(params))
    for e, member in enumerate(ensemble):
        eager = np.asarray(impl_jax.apply(c, member, q, k, v, mask=m))
        assert (cmp := compared(f"vmap over params[{e}] vs eager", by_params[e], eager, name, dtype, "output")).ok, cmp.describe()


# -- dropout seeds, precision option ---------------------------------------------------------

def test_seed_and_rng_give_jax_bernoulli_keep_mask():
    name = "dropout_train"
    case, tensors, inputs = case_arrays(name, "float32")
    c = case.config
    args = (c, tensors, inputs["query"], inputs["key"], inputs["value"])
    shape = (case.B, c.num_heads, case.T, case.S)
    keep = np.asarray(jax.random.bernoulli(jax.random.key(5), 1.0 - c.dropout, shape))
    explicit = JIT_APPLY(*args, training=True, dropout_mask=keep)
    by_seed = JIT_APPLY(*args, training=True, seed=5)
    by_rng = JIT_APPLY(*args, training=True, rng=jax.random.key(5))
    other = JIT_APPLY(*args, training=True, rng=jax.random.key(6))
    assert_bit_equal("seed=5 vs explicit mask", by_seed, explicit)
    assert_bit_equal("rng=key(5) vs explicit mask", by_rng, explicit)
    differ = float(np.max(np.abs(np.asarray(other) - np.asarray(by_seed))))
    assert differ > 0, f"keys 5 and 6 gave the same output (max difference {differ})"
    with pytest.raises(ValueError) as info:
        impl_jax.apply(*args, training=True, seed=5, rng=jax.random.key(5))
    assert str(info.value) == "pass seed or rng, not both: got seed=5 and an rng key", str(info.value)


def test_bad_precision_is_refused():
    case, tensors, inputs = case_arrays("self_basic", "float32")
    with pytest.raises(ValueError) as info:
        impl_jax.apply(case.config, tensors, inputs["query"], precision="fp8")
    assert str(info.value) == "precision must be one of highest, tf32, default: got 'fp8'", str(info.value)


# -- float64 and x64 ---------------------------------------------------------------------------

def test_float64_is_computed_in_float64():
    """A float64 call returns float64 and meets float64's tolerance, which a
    float32 computation of the same call misses by orders of magnitude."""
    name = "mask_and_bias_causal"
    case, tensors, inputs = case_arrays(name, "float64")
    args = (case.config, tensors, inputs["query"], inputs["key"], inputs["value"])
    out = JIT_APPLY(*args, **call_kwargs(case, inputs))
    assert out.dtype == jnp.float64, f"float64 call returned {out.dtype}"
    want = reference(name)[0]["output"]
    result = compared("float64 output", np.asarray(out), want, name, "float64", "output")
    assert result.ok, result.describe()
    in_float32 = np.asarray(JIT_APPLY(*args, dtype="float32", **call_kwargs(case, inputs)))
    tol = policy_for(case.config, dtype="float64", quantity="output", B=case.B, T=case.T, S=case.S, reference=want,
                     logits=logits_of(name))
    as_if_float32 = compare("float32 computation judged as float64", in_float32, want, tol)
    assert in_float32.dtype == np.float32 and not as_if_float32.ok and as_if_float32.margin > 1e3, (
        f"a float32 computation should miss the float64 policy: {as_if_float32.describe()} (float64: margin "
        f"{result.margin:.3g})")


def test_float64_refused_without_x64():
    case, tensors, inputs = case_arrays("self_basic", "float64")
    with jax.enable_x64(False):
        for label, call in (
            ("apply", lambda: impl_jax.apply(case.config, tensors, inputs["query"])),
            ("apply dtype=float64", lambda: impl_jax.apply(case.config, cast_tensors(tensors, "float32"),
                                                           inputs["query"], dtype="float64")),
            ("layer", lambda: impl_jax.MultiHeadAttention.from_tensors(case.config, tensors)),
        ):
            with pytest.raises(ValueError) as info:
                call()
            assert str(info.value) == jax_attention.X64_MESSAGE, f"{label}: {info.value}"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_x64_mode_does_not_change_other_dtypes(dtype):
    """float32 / 16-bit results are bit-identical with x64 on (as the adapter sets it) and off."""
    name = "mask_and_bias_causal"
    case, tensors, inputs = case_arrays(name, dtype)
    args = (case.config, tensors, inputs["query"], inputs["key"], inputs["value"])
    assert jax.config.jax_enable_x64, "impl_jax.adapter should have switched x64 on"
    on = JIT_APPLY(*args, return_weights=True, **call_kwargs(case, inputs))
    with jax.enable_x64(False):
        off = JIT_APPLY(*args, return_weights=True, **call_kwargs(case, inputs))
        off = [np.asarray(x) for x in off]
    for label, a, b in zip(("output", "weights"), on, off):
        assert_bit_equal(f"{dtype} {label}, x64 on vs off", np.asarray(a), b)


# -- masks -------------------------------------------------------------------------------------

@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_causal_mask_equals_reference(alignment):
    jitted = jax.jit(impl_jax.causal_mask, static_argnums=(0, 1, 2))
    for T in range(1, 7):
        for S in range(1, 7):
            want = impl_numpy.causal_mask(T, S, alignment)
            calls = [("eager", lambda: impl_jax.causal_mask(T, S, alignment))]
            if (T, S) in ((4, 6), (6, 4), (5, 5)):  # one compile each: a few shapes suffice
                calls.append(("jit", lambda: jitted(T, S, alignment)))
            for label, call in calls:
                got = np.asarray(call())
                assert got.dtype == want.dtype and np.array_equal(got, want), (
                    f"{label} causal_mask({T}, {S}, {alignment!r}): differs at {np.argwhere(got != want).tolist()}")


def test_padding_mask_equals_reference():
    jitted = jax.jit(impl_jax.padding_mask, static_argnums=1)
    for lengths, S in (([3, 0, 5], 5), ([1], 1), ([2, 2], 4), (np.array([4, 1], np.int32), 4)):
        want = impl_numpy.padding_mask(np.asarray(lengths), S)
        for label, got in (("eager", impl_jax.padding_mask(lengths, S)),
                           ("jit", jitted(jnp.asarray(np.asarray(lengths)), S))):
            got = np.asarray(got)
            assert got.dtype == want.dtype and got.shape == want.shape and np.array_equal(got, want), (
                f"{label} padding_mask({lengths}, {S}): jax {got.astype(int).tolist()}, "
                f"numpy {want.astype(int).tolist()}")


@pytest.mark.parametrize("call", list(MASK_BUILDER_BAD_CALLS.values()), ids=list(MASK_BUILDER_BAD_CALLS))
def test_mask_builder_errors_match_reference(call):
    fn, args, kwargs = call
    got = error_of(getattr(impl_jax, fn), *args, **kwargs)
    want = error_of(getattr(impl_numpy, fn), *args, **kwargs)
    assert got == want, f"jax: {got!r}\nnumpy: {want!r}"


# -- error wording -----------------------------------------------------------------------------

BAD_CALLS = bad_calls()
VALUE_CHECKS = ("nan_bias", "posinf_bias")  # need concrete values: not checked inside jit (documented)
BAD_CONFIG = weights.AttentionConfig(num_heads=2, query_dim=8, head_dim=4, dropout=0.1)
BAD_TENSORS = weights.init(BAD_CONFIG, seed=0, dtype="float64")


@pytest.mark.parametrize("bad", list(BAD_CALLS))
def test_error_wording_matches_reference(bad):
    """apply (NumPy and jax.Array arguments), the jitted apply and the layer say the reference's words."""
    call = dict(query=np.random.default_rng(1).standard_normal((2, 5, 8)))
    call.update(BAD_CALLS[bad])
    query = call.pop("query")
    want = error_of(impl_numpy.multi_head_attention, BAD_CONFIG, BAD_TENSORS, query, **call)
    got = error_of(impl_jax.apply, BAD_CONFIG, BAD_TENSORS, query, **call)
    assert got == want, f"apply:\njax: {got!r}\nnumpy: {want!r}"
    as_jax = {k: (jnp.asarray(v) if isinstance(v, np.ndarray) else v) for k, v in call.items()}
    jax_tensors = {n: jnp.asarray(t) for n, t in BAD_TENSORS.items()}
    got = error_of(impl_jax.apply, BAD_CONFIG, jax_tensors, jnp.asarray(query), **as_jax)
    assert got == want, f"apply on jax arrays:\njax: {got!r}\nnumpy: {want!r}"
    if bad not in VALUE_CHECKS:
        got = error_of(JIT_APPLY, BAD_CONFIG, jax_tensors, jnp.asarray(query), **as_jax)
        assert got == want, f"jitted apply:\njax: {got!r}\nnumpy: {want!r}"
    layer = impl_jax.MultiHeadAttention.from_tensors(BAD_CONFIG, BAD_TENSORS)
    got = error_of(layer, query, **call)
    assert got == want, f"layer:\njax: {got!r}\nnumpy: {want!r}"


@pytest.mark.parametrize("bad", ["features", "float_mask", "mask_shape", "nan_bias", "causal_alignment",
                                 "dropout_mask_without_training", "dtype_name"])
def test_error_wording_adapter(bad):
    call = dict(query=np.random.default_rng(1).standard_normal((2, 5, 8)))
    call.update(BAD_CALLS[bad])
    inputs = {k: call.pop(k) for k in ("query", "key", "value", "mask", "bias", "dropout_mask") if k in call}
    options = {"return_weights": True, **call}
    want = error_of(numpy_adapter.forward, BAD_CONFIG, BAD_TENSORS, inputs, options)
    for label, fn, args in (("forward", adapter.forward, ()), ("vjp", adapter.vjp, (np.zeros((2, 5, 8)),))):
        got = error_of(fn, BAD_CONFIG, BAD_TENSORS, inputs, options, *args)
        assert got == want, f"adapter.{label}:\njax: {got!r}\nnumpy: {want!r}"


def test_tensor_errors_match_reference():
    config = weights.AttentionConfig(num_heads=2, query_dim=8, head_dim=4)
    tensors = weights.init(config, seed=0, dtype="float32")
    query = np.zeros((1, 3, 8), np.float32)
    broken = dict(tensors)
    del broken["key.bias"]
    broken["extra"] = np.zeros(3, np.float32)
    broken["query.kernel"] = np.zeros((8, 2, 5), np.float32)
    broken["value.bias"] = broken["value.bias"].astype(np.float64)
    want = error_of(impl_numpy.multi_head_attention, config, broken, query)
    for label, fn, args in (
        ("apply", impl_jax.apply, (config, broken, query)),
        ("apply on jax arrays", impl_jax.apply, (config, {k: jnp.asarray(v) for k, v in broken.items()}, query)),
        ("layer", impl_jax.MultiHeadAttention.from_tensors, (config, broken)),
        ("adapter", adapter.forward, (config, broken, {"query": query}, {})),
    ):
        got = error_of(fn, *args)
        assert got == want, f"{label}:\njax: {got!r}\nnumpy: {want!r}"
    nan = dict(tensors)
    nan["output.bias"] = np.full_like(nan["output.bias"], np.nan)
    want = error_of(numpy_adapter.forward, config, nan, {"query": query}, {})
    for label, fn in (("layer", lambda: impl_jax.MultiHeadAttention.from_tensors(config, nan)),
                      ("adapter", lambda: adapter.forward(config, nan, {"query": query}, {}))):
        got = error_of(fn)
        assert got == want, f"{label} with a NaN tensor:\njax: {got!r}\nnumpy: {want!r}"


def test_d_output_shape_error_matches_reference():
    case, tensors, inputs = case_arrays("cross_basic", "float32")
    d_out = np.zeros((case.B, case.T + 1, case.config.out_dim), np.float32)
    want = error_of(numpy_adapter.vjp, case.config, tensors, inputs, case.options("float32"), d_out)
    got = error_of(adapter.vjp, case.config, tensors, inputs, case.options("float32"), d_out)
    assert got == want, f"jax: {got!r}\nnumpy: {want!r}"


# -- the layer ---------------------------------------------------------------------------------

LAYER_CASES = ["cross_dims", "gqa", "value_head_dim", "no_biases", "out_dim"]


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("name", LAYER_CASES)
def test_layer_round_trip_is_bit_exact(name, dtype):
    config = CASES[name].config
    tensors = weights.init(config, seed=3, dtype=dtype)
    layer = impl_jax.MultiHeadAttention.from_tensors(config, tensors)
    back = layer.to_tensors()
    assert list(back) == list(tensors), f"names {list(back)} != {list(tensors)}"
    for key, original in tensors.items():
        assert isinstance(back[key], np.ndarray), f"{key}: {type(back[key]).__name__}, not a NumPy array"
        assert_bit_equal(f"{key} after the round trip", back[key], original)
        assert weights.tensor_sha256(back[key]) == weights.tensor_sha256(original), f"{key}: sha256 differs"
    drawn = impl_jax.MultiHeadAttention(config, seed=3, dtype=dtype).to_tensors()
    for key, original in tensors.items():
        assert_bit_equal(f"{key} drawn by the layer with seed 3", drawn[key], original)


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_from_file_is_bit_exact(tmp_path, dtype):
    config = CASES["gqa"].config
    path = tmp_path / f"w.{dtype}.safetensors"
    weights.save(path, config, weights.init(config, seed=4, dtype=dtype))
    _, loaded = weights.load(path)
    back = impl_jax.MultiHeadAttention.from_file(path).to_tensors()
    assert list(back) == list(loaded), f"names {list(back)} != {list(loaded)}"
    for key in loaded:
        assert_bit_equal(f"{key} from file", back[key], loaded[key])


def test_layer_is_an_nnx_module_in_the_canonical_layout():
    config = CASES["gqa"].config
    layer = impl_jax.MultiHeadAttention(config, seed=0, dtype="float32")
    assert isinstance(layer, nnx.Module), f"{type(layer).__mro__}"
    flat = nnx.to_flat_state(nnx.state(layer, nnx.Param))
    found = {".".join(map(str, path)): (type(v).__name__, tuple(v[...].shape)) for path, v in flat}
    want = {name: ("Param", shape) for name, shape in config.tensor_shapes().items()}
    assert found == want, f"nnx.Param state {found} != canonical {want}"


def test_layer_from_file_matches_reference(tmp_path):
    name = "mask_and_bias_causal"
    case = CASES[name]
    tensors, inputs = make_tensors(case), make_inputs(case)
    path = tmp_path / "w.safetensors"
    weights.save(path, case.config, tensors)
    layer = impl_jax.MultiHeadAttention.from_file(path)
    out, w = layer(inputs["query"], inputs["key"], inputs["value"], return_weights=True, **call_kwargs(case, inputs))
    assert out.dtype == jnp.float64, f"layer output dtype {out.dtype}"
    assert (cmp := compared("layer output", np.asarray(out), reference(name)[0]["output"], name, "float64", "output")).ok, cmp.describe()
    assert (cmp := compared("layer weights", np.asarray(w), reference(name)[0]["weights"], name, "float64", "weights")).ok, cmp.describe()


def test_nnx_grad_and_jit_through_the_layer():
    """nnx.grad of the layer gives the canonical gradients; nnx.jit runs its call."""
    name = "masked_rows_uniform"
    case, tensors, inputs = case_arrays(name, "float32")
    layer = impl_jax.MultiHeadAttention.from_tensors(case.config, tensors)
    d_out = jnp.asarray(output_cotangent(case).astype(np.float32))
    extra = call_kwargs(case, inputs)
    q, k, v = (jnp.asarray(inputs[n]) for n in ("query", "key", "value"))

    def loss(module, q, k, v):
        out = module(q, k, v, **extra)
        return jnp.sum(out * d_out), out

    @nnx.jit
    def grads_of(module, q, k, v):
        return nnx.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(module, q, k, v)

    (g_module, g_q, g_k, g_v), out = grads_of(layer, q, k, v)
    flat = {".".join(map(str, path)): np.asarray(g[...]) for path, g in nnx.to_flat_state(g_module)}
    flat.update({"query": np.asarray(g_q), "key": np.asarray(g_k), "value": np.asarray(g_v)})
    assert_gradients_conform(case, "float32", flat)
    assert (cmp := compared("nnx.jit output", np.asarray(out), reference(name)[0]["output"], name, "float32", "output")).ok, cmp.describe()


# -- devices -----------------------------------------------------------------------------------

@pytest.mark.skipif(impl_jax.gpu_available(), reason="this machine has a GPU")
def test_gpu_request_without_gpu_is_refused():
    config = CASES["self_basic"].config
    message = "device gpu requested but JAX sees no GPU (jax.devices('gpu') fails)"
    case, tensors, inputs = case_arrays("self_basic", "float32")
    for label, call in (
        ("layer", lambda: impl_jax.MultiHeadAttention(config, device="gpu")),
        ("adapter.forward", lambda: adapter.forward(config, tensors, inputs, {}, device="gpu")),
    ):
        assert error_of(call) == message, f"{label}: {error_of(call)!r}"
    assert adapter.devices() == ["cpu"], f"devices() {adapter.devices()}"


def test_device_names_and_cpu_placement():
    config = CASES["self_basic"].config
    got = error_of(impl_jax.MultiHeadAttention, config, device="tpu")
    assert got == "device must be one of cpu, gpu: got 'tpu'", got
    layer = impl_jax.MultiHeadAttention(config, device="cpu")
    platforms = {d.platform for t in layer.params.values() for d in t.devices()}
    assert platforms == {"cpu"}, f"parameters on {platforms}"


GPU_CASES = ["self_basic", "gqa", "mask_and_bias_causal", "masked_rows_nan", "large_logits", "dropout_train"]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("name", GPU_CASES)
def test_gpu_matches_reference(name, dtype):
    assert adapter.devices() == ["cpu", "gpu"], f"devices() {adapter.devices()}"
    assert_case_conforms(CASES[name], dtype, "jax", adapter, device="gpu")


@pytest.mark.gpu
@needs_gpu
def test_gpu_layer_places_parameters_and_output_on_the_gpu():
    name = "mask_and_bias_causal"
    case, tensors, inputs = case_arrays(name, "float32")
    layer = impl_jax.MultiHeadAttention.from_tensors(case.config, tensors, device="gpu")
    platforms = {d.platform for t in layer.params.values() for d in t.devices()}
    assert platforms == {"gpu"}, f"parameters on {platforms}"
    out = layer(inputs["query"], inputs["key"], inputs["value"], **call_kwargs(case, inputs))
    assert {d.platform for d in out.devices()} == {"gpu"}, f"output on {out.devices()}"
    assert (cmp := compared("gpu layer output", np.asarray(out), reference(name)[0]["output"], name, "float32", "output")).ok, cmp.describe()


@pytest.mark.gpu
@needs_gpu
def test_gpu_tf32_only_when_asked():
    """precision="tf32" passes the TF32 policy; the default "highest" passes float32's."""
    name = "large_logits"
    case, tensors, inputs = case_arrays(name, "float32")
    for precision in ("tf32", "highest"):
        out = adapter.forward(case.config, tensors, inputs, case.options("float32"), device="gpu",
                              precision=precision)["output"]
        assert (cmp := compared(f"gpu {precision}", out, reference(name)[0]["output"], name, "float32", "output", precision=precision)).ok, cmp.describe()


def test_mha_check_reuses_jax_compiled_programs(tmp_path):
    """`mha check` keeps impl_jax's compiled programs (impl_jax/programs.py) and a second run still passes
    from them, loading every one (no file rewritten); --no-compile-cache writes nothing. In fresh processes."""
    import subprocess
    import sys

    def check(cache_dir, *extra):
        argv = [sys.executable, "-m", "conformance.cli", "check", "--backends", "jax", "--dtypes", "float32",
                "--cases", "self_basic", "causal_square", "--jobs", "1", *extra]
        done = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "MHA_CACHE_DIR": str(cache_dir)},
                              timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
        return {p.name: p.stat().st_mtime_ns for p in (cache_dir / "jax").rglob("*") if p.is_file()}

    first = check(tmp_path / "on")
    assert len(first) >= 4, first  # one program per (case, path) with and without the trace at least
    assert check(tmp_path / "on") == first  # the second run compiled and wrote nothing
    assert check(tmp_path / "off", "--no-compile-cache") == {}


def test_float16_result_one_step_from_the_reference_passes():
    """Found by the 1000-case sweep (seed 267): JAX's float16 output landed one
    float16 step from the float64 value where the NumPy float16 reference
    happened to be nearly exact; the policy allows one step (tolerance.py)."""
    from conformance.suite.cases import random_case
    from conformance.suite.compare import STATUS_PASS, run_case

    result = run_case(random_case(267), "jax", dtype="float16")
    assert result.status == STATUS_PASS, result.worst.describe() if result.worst else result.message


def test_clear_cache_releases_jax_compiled_programs():
    """Each compiled program holds ~100 memory mappings; a 1000-case sweep that
    kept them all hit vm.max_map_count and LLVM aborted the process. The
    sweeps call clear_cache, and `mha check` releases them after each chunk."""
    from conformance.suite.compare import clear_cache, run_case

    run_case(CASES["self_basic"], "jax", dtype="float32")
    assert adapter.program(adapter.cpu_compile())._cache_size() >= 1
    clear_cache()
    assert adapter.program(adapter.cpu_compile())._cache_size() == 0


def test_cpu_compile_modes_both_conform():
    """The adapter compiles CPU programs with FAST_CPU_COMPILE unless told
    otherwise (`mha check --xla-full-opt`); each mode compiles its own
    program, and both pass the same case, with a gradient check."""
    from conformance.suite.compare import STATUS_PASS, clear_cache, run_case

    clear_cache()
    assert adapter.cpu_compile() == "fast"
    try:
        for mode in ("fast", "default"):
            adapter.set_cpu_compile(mode)
            result = run_case(CASES["causal_bottom_right"], "jax", dtype="float32")
            assert result.status == STATUS_PASS, (mode, result.worst.describe() if result.worst else result.message)
            assert adapter.program(mode)._cache_size() == 1, mode
    finally:
        adapter.set_cpu_compile("fast")
    with pytest.raises(ValueError, match="got 'O3'"):
        adapter.set_cpu_compile("O3")


def test_a_compile_option_this_xla_does_not_know_is_dropped(monkeypatch):
    """A newer XLA drops options (jax 0.11.2's refuses xla_cpu_use_fusion_emitters: every CPU result of a GPU
    machine's `mha check` was an error): the fast CPU programs compile with the options it knows."""
    monkeypatch.setattr(adapter, "FAST_CPU_COMPILE", {**adapter.FAST_CPU_COMPILE, "xla_no_such_option_here": 1})
    adapter.cpu_compile_options.cache_clear()
    try:
        assert adapter.cpu_compile_options() == {k: v for k, v in adapter.FAST_CPU_COMPILE.items()
                                                 if k != "xla_no_such_option_here"}
    finally:
        adapter.cpu_compile_options.cache_clear()
    assert "xla_no_such_option_here" not in adapter.cpu_compile_options()


@pytest.mark.parametrize("full_opt", [False, True])
def test_mha_check_sets_the_cpu_compile_mode(monkeypatch, full_opt):
    """run_check (and so `mha check [--xla-full-opt]`) tells the adapter which mode to compile in."""
    from conformance.suite.check import run_check

    asked = []
    monkeypatch.setattr(adapter, "set_cpu_compile", asked.append)
    results, _ = run_check(["jax"], dtypes=["float32"], case_names=["self_basic"], jobs=1, progress=False,
                           xla_full_opt=full_opt)
    assert [(r.path, r.status) for r in results] == [("stages", "pass"), ("fused", "pass")], [r.message for r in results]
    assert asked == ["default" if full_opt else "fast"], asked


# -- the chunked path (chunk_size=): exact online softmax over blocks, no (T, S) array -----------

CHUNK_REFUSAL = ("chunk_size cannot be combined with return_weights or trace: the chunked path never forms the "
                 "(T, S) weights")


@functools.partial(jax.jit, static_argnames=("config", "static"))
def _chunked_program(config, params, arrays, d_output, *, static):
    """apply(..., chunk_size=) and its jax.vjp, one compiled program (as impl_jax.adapter does for the plain
    path): query, key, value and the cache differentiated, the present cache returned beside the output."""
    inputs = {n: arrays[n] for n in ("query", "key", "value", "past_key", "past_value") if n in arrays}
    # the other inputs, the indexer's too (its index cache: a decode case of a layer with an indexer needs it)
    others = {n: arrays.get(n) for n in (*numpy_adapter.OPTIONAL_INPUTS, *numpy_adapter.INDEXER_INPUTS)
              if n not in ("past_key", "past_value")}

    def f(params, inputs):
        result = impl_jax.apply(config, params, inputs["query"], inputs.get("key"), inputs.get("value"),
                                past_key=inputs.get("past_key"), past_value=inputs.get("past_value"), **others,
                                **dict(static))
        out, *rest = result if isinstance(result, tuple) else (result,)
        return out, rest  # [selection][, present_key, present_value[, present_index_keys]]

    out, pull, cache = jax.vjp(f, params, inputs, has_aux=True)
    d_params, d_inputs = pull(d_output.astype(out.dtype))
    return out, cache, d_params, d_inputs


class ChunkedAdapter:
    """The conformance adapter's interface over apply(..., chunk_size=): lets
    run_case judge the chunked path exactly as `mha check` judges the plain one."""

    def __init__(self, chunk_size: int):
        self.chunk_size = chunk_size

    def devices(self):
        return ["cpu"]

    def _run(self, config, tensors, inputs, options, d_output):
        assert not options.get("return_weights"), "the chunked path returns no weights: judge cases without them"
        static = (("is_causal", bool(options.get("is_causal", False))),
                  ("causal_alignment", options.get("causal_alignment", "top_left")),
                  ("training", bool(options.get("training", False))), ("dtype", options.get("dtype")),
                  ("return_cache", bool(options.get("return_cache", False))), ("chunk_size", self.chunk_size),
                  ("return_selection", config.indexer is not None))  # the selection judged, as the adapters do
        arrays = {n: np.asarray(a) for n, a in inputs.items() if a is not None}
        dtype = weights.dtype_from_name(options["dtype"])
        if d_output is None:
            d_output = np.zeros((arrays["query"].shape[0], arrays["query"].shape[1], config.out_dim), dtype)
        return _chunked_program(config, dict(tensors), arrays, np.asarray(d_output), static=static)

    def forward(self, config, tensors, inputs, options, *, device="cpu", precision="highest", trace=False):
        if trace:
            raise NotImplementedError("the chunked path has no stage trace")
        out, rest, _, _ = self._run(config, tensors, inputs, options, None)
        selection = config.indexer is not None
        return weights.call.split_result((out, *rest) if rest else out, False, bool(options.get("return_cache", False)),
                                         return_selection=selection, index_cache=selection)

    def vjp(self, config, tensors, inputs, options, d_output, *, device="cpu", precision="highest"):
        out, _, d_params, d_inputs = self._run(config, tensors, inputs, options, d_output)
        grads = {n: np.asarray(d_inputs[n]) for n in ("query", "key", "value", "past_key", "past_value")
                 if n in d_inputs}
        grads.update({n: np.asarray(d_params[n]) for n in config.tensor_shapes()})
        return {"output": np.asarray(out), "grads": grads}


def without_weights(case):
    """The same case (same name, so the same inputs) asking for no weights."""
    import dataclasses

    return dataclasses.replace(case, return_weights=False)


# A chunked program compiles in 2-4 s here (nested scans, their VJP), so the
# default run takes the cases where blocks matter, in float32, plus float64
# and 16-bit for the trickiest; the whole grid in every dtype is `slow`.
CHUNKED_FAST = {
    "float32": ["gqa", "query_len_1", "key_len_1", "causal_bottom_right_long_query", "bias_neg_inf",
                "mask_and_bias_causal", "masked_rows_uniform", "masked_rows_nan", "dropout_train",
                "window_left_causal", "window_both_bottom_right", "cache_window_gqa", "softcap_masked_rows",
                "sinks_masked_rows", "segments_packed", "rope_yarn"],
    "float64": ["masked_rows_nan", "dropout_train", "modern_everything", "qk_norm_layer_all"],
    "float16": ["causal_bottom_right", "decode_cache"],
    "bfloat16": ["mask_and_bias_causal", "modern_everything"],
}


@pytest.mark.parametrize(("name", "dtype"), [
    pytest.param(name, dtype, marks=() if name in CHUNKED_FAST[dtype] else pytest.mark.slow)
    for dtype in DTYPE_NAMES for name in MHA_CASES])
def test_chunked_case_matches_reference(name, dtype):
    """Every case of the grid (masks, bias, -inf bias, both causal alignments,
    fully masked rows under each policy, GQA/MQA, dropout mask, T or S = 1)
    through chunk_size=2: several query and key blocks, the last one
    overlapping its neighbour (T, S = 5 or 6), output and every gradient
    judged against the float64 reference as `mha check` judges them."""
    assert_case_conforms(without_weights(CASES[name]), dtype, "jax", ChunkedAdapter(2))


@pytest.mark.parametrize(("name", "chunk_size"), [
    ("causal_bottom_right_long_query", 1), ("mask_and_bias_causal", 3), ("masked_rows_uniform", 4),
    ("dropout_train", 64), *(pytest.param(name, chunk, marks=pytest.mark.slow) for chunk in (1, 3, 4, 64) for name in (
        "causal_bottom_right", "causal_bottom_right_long_query", "mask_and_bias_causal", "masked_rows_uniform",
        "dropout_train", "mqa"))])
def test_chunked_block_sizes(name, chunk_size):
    """Blocks of one row/column, blocks that divide or overlap, one block for everything."""
    assert_case_conforms(without_weights(CASES[name]), "float32", "jax", ChunkedAdapter(chunk_size))


def _moderate_call(masked_row: str, T: int, S: int, *, dropout: float = 0.0, seed: int = 0):
    """GQA config and inputs with a random (B, 1, T, S) mask, fully masked rows
    (by the mask and by -inf bias), a float bias and, if dropout, a keep-mask."""
    config = weights.AttentionConfig(num_heads=4, num_kv_heads=2, query_dim=16, head_dim=8, value_head_dim=6,
                                     out_dim=12, masked_row=masked_row, dropout=dropout)
    tensors = weights.init(config, seed=seed, dtype="float64")
    rng = np.random.default_rng(seed + 1)
    q, k = rng.standard_normal((2, T, 16)), rng.standard_normal((2, S, 16))
    v = rng.standard_normal((2, S, 16))
    mask = rng.random((2, 1, T, S)) < 0.6
    mask[0, 0, 3] = False  # a fully masked row
    bias = rng.standard_normal((2, 4, T, S))
    bias[1, 2, T - 2] = -np.inf  # a fully masked row of one head, by bias
    call = dict(mask=mask, bias=bias)
    if dropout:
        call.update(training=True, dropout_mask=rng.random((2, 4, T, S)) >= dropout)
    return config, tensors, (q, k, v), call


def _judge_forward_and_grads(label, config, tensors, xs, call, dtype, chunk_size):
    """apply's output (chunked, or plain when chunk_size is None; no weights asked
    for) and its jax.vjp (jitted) against the float64 NumPy reference, under the policy."""
    from conformance.suite.tolerance import assert_close

    B, T, S = xs[0].shape[0], xs[0].shape[1], xs[1].shape[1]
    t, x = cast_tensors(tensors, dtype), [a.astype(weights.dtype_from_name(dtype)) for a in xs]
    t64, x64 = cast_tensors(t, "float64"), [a.astype(np.float64) for a in x]
    c = {k: v for k, v in call.items()}
    trace = []
    want = impl_numpy.multi_head_attention(config, t64, *x64, trace=trace, **c)
    logits = dict((e.stage, e.value) for e in trace)["logits"]
    d_out = np.random.default_rng(5).standard_normal(want.shape)
    _, want_grads, magnitudes = impl_numpy.multi_head_attention_vjp(config, t64, *x64, d_output=d_out,
                                                                     gradient_magnitudes=True, **c)
    same = {}
    if dtype in ("float16", "bfloat16"):
        low = impl_numpy.multi_head_attention(config, t, *x, **c)
        same["output"] = float(np.nanmax(np.abs(low.astype(np.float64) - want), initial=0.0))
    dims = dict(config=config, dtype=dtype, B=B, T=T, S=S, logits=logits)

    @jax.jit
    def forward_and_vjp(params, q, k, v):
        out, pull = jax.vjp(lambda *a: impl_jax.apply(config, *a, chunk_size=chunk_size, **c), params, q, k, v)
        return out, pull(d_out.astype(out.dtype))

    out, (g_params, g_q, g_k, g_v) = forward_and_vjp(t, *x)
    assert out.dtype == weights.dtype_from_name(dtype), f"{label}: output dtype {out.dtype}"
    judged = [assert_close(f"{label} output", np.asarray(out), want, quantity="output",
                           same_precision_error=same.get("output"), **dims)]
    if dtype in ("float16", "bfloat16"):
        return judged  # 16-bit gradients: judged on the grid (test_chunked_case_matches_reference)
    got = {"query": g_q, "key": g_k, "value": g_v, **g_params}
    judged += [assert_close(f"{label} grad {name}", np.asarray(got[name]), want_grads[name], quantity="grad",
                            scale_floor=max_finite_abs(magnitudes[name]), **dims) for name in want_grads]
    return judged


def _assert_judged(judged, config, gradients=True):
    """The output, and with gradients query, key, value and every canonical tensor, all within tolerance."""
    names = {c.name.rsplit(" ", 1)[-1] for c in judged}
    want = {"output"} | ({"query", "key", "value", *config.tensor_shapes()} if gradients else set())
    assert names == want and all(c.ok and c.margin <= 1 for c in judged), (
        sorted(names ^ want), [c.describe() for c in judged if not c.ok])


CHUNKED_MODERATE_FAST = {("zero", "top_left", 37, 53), ("uniform", "bottom_right", 53, 37), ("nan", "bottom_right", 37, 53)}


@pytest.mark.parametrize(("masked_row", "alignment", "T", "S"), [
    pytest.param(*combo, marks=() if combo in CHUNKED_MODERATE_FAST else pytest.mark.slow)
    for combo in ((m, a, T, S) for m in ("zero", "uniform", "nan") for a in ("top_left", "bottom_right")
                  for T, S in ((37, 53), (53, 37)))])
def test_chunked_forward_and_grads_float64(masked_row, alignment, T, S):
    """Lengths over several blocks that do not divide them, causal in both
    alignments (T > S bottom_right hides whole query blocks), mask, bias with
    -inf, fully masked rows, GQA, H != V, O != D: output and every gradient
    (jax.vjp through the scans) against the float64 reference."""
    config, tensors, xs, call = _moderate_call(masked_row, T, S)
    call.update(is_causal=True, causal_alignment=alignment)
    _assert_judged(_judge_forward_and_grads(f"{masked_row} {alignment} T={T} S={S}", config, tensors, xs, call,
                                            "float64", 8), config)


@pytest.mark.parametrize("masked_row", [pytest.param("zero", marks=pytest.mark.slow), "uniform", "nan"])
def test_chunked_dropout_mask_forward_and_grads(masked_row):
    """An explicit keep-mask: the running sum takes the weights before dropout,
    the numerator after (as impl_numpy/chunked.py); uniform rows too."""
    config, tensors, xs, call = _moderate_call(masked_row, 29, 41, dropout=0.3)
    _assert_judged(_judge_forward_and_grads(f"dropout {masked_row}", config, tensors, xs, call, "float64", 8), config)


@pytest.mark.parametrize("dtype", [pytest.param("float32", marks=pytest.mark.slow),
                                   pytest.param("float16", marks=pytest.mark.slow), "bfloat16"])
def test_chunked_moderate_length_other_dtypes(dtype):
    config, tensors, xs, call = _moderate_call("uniform", 45, 45)
    call.update(is_causal=True)
    _assert_judged(_judge_forward_and_grads(f"{dtype} causal", config, tensors, xs, call, dtype, 16), config,
                   gradients=dtype not in ("float16", "bfloat16"))


def test_chunked_skips_the_key_blocks_the_causal_mask_hides():
    """NaN in the values of the last keys reaches every row of the plain path
    (0 weight times NaN is NaN); the chunked path never multiplies by the
    blocks it skips, so query blocks that cannot see those keys stay finite,
    and equal the plain path's rows without the NaN."""
    config = weights.AttentionConfig(num_heads=2, query_dim=8, head_dim=4)
    tensors = weights.init(config, seed=0, dtype="float32")
    rng = np.random.default_rng(3)
    T, chunk = 32, 8
    x = rng.standard_normal((1, T, 8)).astype(np.float32)
    v = x.copy()
    v[0, -chunk:] = np.nan  # the values of the last key block
    plain = np.asarray(impl_jax.apply(config, tensors, x, x, v, is_causal=True))
    assert np.isnan(plain).all(), "the plain path should spread the NaN to every row"
    chunked = np.asarray(JIT_APPLY(config, tensors, x, x, v, is_causal=True, chunk_size=chunk))
    clean = np.asarray(impl_jax.apply(config, tensors, x, x, x, is_causal=True))
    hidden_rows = slice(0, T - chunk)  # query blocks 0..2 never see the last key block
    assert np.isfinite(chunked[:, hidden_rows]).all(), (
        f"rows that cannot see the last key block are not finite: {np.argwhere(~np.isfinite(chunked[0, hidden_rows]))[:5]}")
    assert np.isnan(chunked[:, T - chunk:]).all(), "rows that see the NaN keys should be NaN"
    err = float(np.abs(chunked[:, hidden_rows] - clean[:, hidden_rows]).max())
    assert err <= 1e-5 * float(np.abs(clean).max()), f"chunked rows differ from the plain path's by {err:.3g}"


def test_chunked_holds_no_t_by_s_array():
    """XLA's own buffer assignment for the compiled chunked program: the
    temporaries plus the output stay within a few times the inputs and
    output, where one (B, N, T, S) float32 array is 256 MiB."""
    config = weights.AttentionConfig(num_heads=4, query_dim=64, head_dim=16)
    tensors = weights.init(config, seed=0, dtype="float32")
    T, chunk = 4096, 256
    x = np.zeros((1, T, 64), np.float32)
    io = 2 * x.nbytes
    ts = config.num_heads * T * T * 4
    block = config.num_heads * chunk * chunk * 4
    for causal in (False, True):
        compiled = jax.jit(lambda p, q: impl_jax.apply(config, p, q, is_causal=causal, chunk_size=chunk)).lower(
            tensors, x).compile()
        memory = compiled.memory_analysis()
        used = memory.temp_size_in_bytes + memory.output_size_in_bytes
        budget = 4 * io + 8 * block
        assert used < budget, (f"causal={causal}: temporaries {memory.temp_size_in_bytes / 2**20:.1f} MiB + output "
                               f"{memory.output_size_in_bytes / 2**20:.1f} MiB > budget {budget / 2**20:.1f} MiB "
                               f"(one (B, N, T, S) array: {ts / 2**20:.0f} MiB)")


def test_chunked_seed_draws_the_plain_paths_keep_mask():
    case, tensors, inputs = case_arrays("dropout_train", "float32")
    args = (case.config, tensors, inputs["query"], inputs["key"], inputs["value"])
    plain = np.asarray(JIT_APPLY(*args, training=True, seed=5))
    chunked = np.asarray(JIT_APPLY(*args, training=True, seed=5, chunk_size=2))
    assert (cmp := compared("seed=5 chunked vs plain", chunked, plain, case.name, "float32", "output")).ok, cmp.describe()


def test_chunked_layer_vmap_and_eager():
    """The layer passes chunk_size through; vmap over inputs and eager calls agree with the reference."""
    name = "mask_and_bias_causal"
    case, tensors, inputs = case_arrays(name, "float32")
    layer = impl_jax.MultiHeadAttention.from_tensors(case.config, tensors)
    want = reference(name)[0]["output"]
    kw = call_kwargs(case, inputs)
    out = layer(inputs["query"], inputs["key"], inputs["value"], chunk_size=2, **kw)
    assert (cmp := compared("layer chunked", np.asarray(out), want, name, "float32", "output")).ok, cmp.describe()
    stacked = jax.vmap(lambda q: impl_jax.apply(case.config, tensors, q, inputs["key"], inputs["value"], chunk_size=3,
                                                **kw))(jnp.stack([inputs["query"]] * 2))
    for e in range(2):
        assert (cmp := compared(f"vmap[{e}] chunked", np.asarray(stacked[e]), want, name, "float32", "output")).ok, cmp.describe()


@pytest.mark.parametrize("extra", [dict(return_weights=True), dict(trace=[]), dict(chunk_size=0),
                                   dict(chunk_size=-3), dict(chunk_size=2.0), dict(chunk_size=True),
                                   dict(chunk_size="8")], ids=str)
def test_chunked_refusals_match_reference(extra, monkeypatch):
    """The reference's words, from apply on NumPy arrays, the jitted apply and
    the layer, before any projection runs."""
    call = {"chunk_size": 4, **extra}
    query = np.random.default_rng(1).standard_normal((2, 5, 8))
    config = weights.AttentionConfig(num_heads=2, query_dim=8, head_dim=4)
    tensors = weights.init(config, seed=0, dtype="float64")
    want = error_of(impl_numpy.multi_head_attention, config, tensors, query, **call)

    def project(*args, **kwargs):
        raise AssertionError("a projection ran before chunk_size was checked")

    from impl_jax import chunked as jax_chunked

    monkeypatch.setattr(jax_functional, "project", project)
    monkeypatch.setattr(jax_chunked, "project", project)
    got = error_of(impl_jax.apply, config, tensors, query, **call)
    assert got == want, f"apply:\njax: {got!r}\nnumpy: {want!r}"
    if "trace" not in extra:
        got = error_of(JIT_APPLY, config, tensors, query, **call)
        assert got == want, f"jitted apply:\njax: {got!r}\nnumpy: {want!r}"
    got = error_of(impl_jax.MultiHeadAttention.from_tensors(config, tensors), query, **call)
    assert got == want, f"layer:\njax: {got!r}\nnumpy: {want!r}"
    if "return_weights" in extra:
        assert got == CHUNK_REFUSAL, got


# -- the fused fast path (no weights, no trace: logits .. attend in one expression) ------------

FAST_FLOAT64 = ["mqa", "causal_bottom_right_long_query", "mask_and_bias_causal", "masked_rows_nan"]


@pytest.mark.parametrize(("name", "dtype"), [*((name, "float32") for name in MHA_CASES),
                                             *((name, "float64") for name in FAST_FLOAT64)])
def test_fast_path_case_matches_reference(name, dtype):
    """The grid without weights: float32 and float64 calls take functional.fused_attention
    (dropout cases the stages); output and every gradient judged as `mha check` judges them."""
    assert_case_conforms(without_weights(CASES[name]), dtype, "jax", adapter)


@pytest.mark.parametrize(("masked_row", "alignment", "T", "S"), [
    ("zero", "top_left", 37, 53), ("uniform", "bottom_right", 53, 37), ("nan", "bottom_right", 37, 53),
    ("nan", "top_left", 53, 37)])
def test_fast_path_forward_and_grads_float64(masked_row, alignment, T, S):
    """GQA, H != V, a random mask, a bias with -inf, fully masked rows (by the
    mask, the bias and bottom_right causality) under each policy: the fused
    path's output and its jax.vjp against the float64 reference."""
    config, tensors, xs, call = _moderate_call(masked_row, T, S)
    call.update(is_causal=True, causal_alignment=alignment)
    _assert_judged(_judge_forward_and_grads(f"fused {masked_row} {alignment} T={T} S={S}", config, tensors, xs,
                                            call, "float64", None), config)


def test_fast_path_is_taken_only_when_nothing_needs_the_stages(monkeypatch):
    """The stages run when weights, the trace or dropout need them, or in 16
    bits (whose stage-by-stage rounding the fused path would skip); otherwise
    fused_attention replaces logits .. attend."""
    name = "mask_and_bias_causal"
    case, tensors, inputs = case_arrays(name, "float32")
    args = (case.config, tensors, inputs["query"], inputs["key"], inputs["value"])
    stages = []
    for stage in ("logits", "softmax", "attend"):
        original = getattr(jax_functional, stage)
        monkeypatch.setattr(jax_functional, stage,
                            lambda *a, _f=original, _s=stage, **k: stages.append(_s) or _f(*a, **k))
    fused = []
    original_fused = jax_attention.fused_attention
    monkeypatch.setattr(jax_attention, "fused_attention", lambda *a, **k: fused.append(1) or original_fused(*a, **k))

    def paths(**options):
        stages.clear(), fused.clear()
        impl_jax.apply(*args, **call_kwargs(case, inputs), **options)
        return ("fused" if fused else "") + ("stages" if stages == ["logits", "softmax", "attend"] else "")

    dropout_case, dropout_tensors, dropout_inputs = case_arrays("dropout_train", "float32")
    assert paths() == "fused", paths()
    assert paths(return_weights=True) == "stages"
    assert paths(trace=[]) == "stages"
    assert paths(dtype="bfloat16") == "stages"
    stages.clear(), fused.clear()
    impl_jax.apply(dropout_case.config, dropout_tensors, dropout_inputs["query"], dropout_inputs["key"],
                   dropout_inputs["value"], **call_kwargs(dropout_case, dropout_inputs))
    assert stages == ["logits", "softmax", "attend"] and not fused, (stages, fused)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # NaN logits in the reference
@pytest.mark.parametrize("hidden_by", ["padding_mask", "causal", "neg_inf_bias"])
def test_fast_path_nan_key_hidden_by_the_mask_reaches_no_row(hidden_by):
    """A NaN in a key that the mask (or causality) hides from a row: the stages
    set that logit to -inf by a select, so the row stays finite (only a NaN
    value spreads, through 0 * NaN); the fused path must not add -inf to the
    NaN logit and make every row NaN, nor may the chunked path (blocks of 4:
    the NaN key in the overlapping last block). A -inf bias is a mask too
    (the spec's mask() selects on it). Expected: the float64 NumPy stages."""
    from conformance.suite.tolerance import assert_close

    config = weights.AttentionConfig(num_heads=2, query_dim=8, head_dim=4)
    tensors = weights.init(config, seed=0, dtype="float32")
    rng = np.random.default_rng(0)
    T = S = 6
    q, k, v = (rng.standard_normal((2, L, 8)).astype(np.float32) for L in (T, S, S))
    k[:, -1] = np.nan  # the last key: padding in one call, the future of every other row in the other
    padding = impl_numpy.padding_mask(np.array([S - 1, S - 2]), S)  # (B, 1, 1, S)
    call = {"padding_mask": dict(mask=padding), "causal": dict(is_causal=True),
            "neg_inf_bias": dict(bias=np.where(padding, 0.0, -np.inf))}[hidden_by]  # a -inf bias is a mask (README)
    t64 = cast_tensors(tensors, "float64")
    trace = []
    want = impl_numpy.multi_head_attention(config, t64, q.astype(np.float64), k.astype(np.float64),
                                           v.astype(np.float64), trace=trace, **call)
    assert np.isfinite(want[:, :-1]).all(), "the reference should keep the rows that cannot see the NaN key finite"
    for label, fn, chunk in (("eager", impl_jax.apply, None), ("jit", JIT_APPLY, None), ("chunked", JIT_APPLY, 4),
                             ("stages", lambda *a, **kw: impl_jax.apply(*a, return_weights=True, **kw)[0], None)):
        got = np.asarray(fn(config, tensors, q, k, v, chunk_size=chunk, **call))
        assert np.array_equal(np.isnan(got), np.isnan(want)), (
            f"{hidden_by} {label}: NaN rows {np.isnan(got).any(-1).astype(int).tolist()}, "
            f"reference {np.isnan(want).any(-1).astype(int).tolist()}")
        assert_close(f"{hidden_by} {label} output", got, want, config=config, dtype="float32", quantity="output",
                     B=2, T=T, S=S, logits=dict((e.stage, e.value) for e in trace)["logits"])


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # 0 * NaN in the reference
@pytest.mark.parametrize("training", [False, True])
def test_masked_row_zero_is_zero_weights_times_v_on_every_path(training):
    """masked_row="zero": a fully masked row's weights are 0 and its context is
    0 x V, as the stages compute it, so a NaN in a value column makes that
    row's column NaN (0 x NaN), as on the spec's stages and fast path; the
    fused and chunked paths must not select a plain 0 there. Dropout keeps
    0 weights 0. Expected: the float64 NumPy stages."""
    from conformance.suite.tolerance import assert_close

    config = weights.AttentionConfig(num_heads=2, query_dim=8, head_dim=4, dropout=0.25)
    tensors = weights.init(config, seed=0, dtype="float32")
    rng = np.random.default_rng(0)
    B, T, S = 2, 5, 5
    q, k, v = (rng.standard_normal((B, L, 8)).astype(np.float32) for L in (T, S, S))
    v[0, 1, 0] = np.nan  # one value feature of key 1 (batch 0): every value column it feeds is NaN
    mask = np.ones((T, S), bool)
    mask[2] = False  # row 2 sees no key
    mask[0, 1] = False  # row 0 does not see key 1: still NaN through 0 x NaN, as every row
    call = dict(mask=mask)
    if training:
        call.update(training=True, dropout_mask=rng.random((B, 2, T, S)) >= 0.25)
    trace = []
    want = impl_numpy.multi_head_attention(config, cast_tensors(tensors, "float64"), q.astype(np.float64),
                                           k.astype(np.float64), v.astype(np.float64), trace=trace, **call)
    assert np.isnan(want[0]).all() and np.isfinite(want[1]).all(), "the reference should spread the NaN in batch 0 only"
    for label, chunk in (("plain", None), ("chunked", 2)):
        got = np.asarray(JIT_APPLY(config, tensors, q, k, v, chunk_size=chunk, **call))
        assert np.array_equal(np.isnan(got), np.isnan(want)), (
            f"{label} training={training}: NaN at {np.argwhere(np.isnan(got) != np.isnan(want))[:5].tolist()} "
            f"differs from the reference")
        assert_close(f"{label} training={training} output", got, want, config=config, dtype="float32",
                     quantity="output", B=B, T=T, S=S, logits=dict((e.stage, e.value) for e in trace)["logits"])
