"""The hand-written VJP against central finite differences in float64."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import calls, configs

import weights
from conformance.suite.cases import CASES, MHA_CASES, make_inputs, make_tensors, output_cotangent
from impl_numpy import multi_head_attention, multi_head_attention_vjp

pytestmark = pytest.mark.reference  # NumPy only, no framework looked for: the numpy env runs it, `all` does not again

EPS = 1e-6


def finite_difference(f, array, index):
    plus, minus = array.copy(), array.copy()
    plus[index] += EPS
    minus[index] -= EPS
    return (f(plus) - f(minus)) / (2 * EPS)


def check_against_fd(config, tensors, inputs, options, d_out, what, points=6, seed=0):
    """Compare grads at `points` random elements of every tensor and input.
    Central differences in float64 have error ~EPS**2 * f''' + ulp/EPS ~ 1e-9."""
    _, grads = multi_head_attention_vjp(config, tensors, d_output=d_out, **inputs, **options)
    rng = np.random.default_rng(seed)
    for name, grad in grads.items():
        for _ in range(points):
            index = tuple(int(rng.integers(0, n)) for n in grad.shape)
            if name in tensors:
                def f(a, name=name):
                    t = dict(tensors, **{name: a})
                    return float((multi_head_attention(config, t, **inputs, **options) * d_out).sum())
                fd = finite_difference(f, tensors[name], index)
            else:
                def f(a, name=name):
                    return float((multi_head_attention(config, tensors, **dict(inputs, **{name: a}), **options) * d_out).sum())
                fd = finite_difference(f, inputs[name], index)
            assert abs(grad[index] - fd) <= 1e-7 + 1e-6 * abs(fd), (
                f"{what}: d{name}{list(index)} = {grad[index]!r}, finite difference {fd!r}, diff {abs(grad[index] - fd):.3g}")


@pytest.mark.parametrize("name", [n for n, c in MHA_CASES.items() if c.config.masked_row != "nan"])
def test_case_grid_gradients(name):
    case = CASES[name]
    inputs = make_inputs(case)
    tensors = make_tensors(case)
    call = {k: inputs[k] for k in ("query", "key", "value") if k in inputs}  # kv_shared: no key, value
    call.update({k: inputs[k] for k in ("past_key", "past_value") if k in inputs})  # differentiated too
    options = {k: v for k, v in inputs.items() if k not in call}  # masks, bias, positions, segment ids
    options.update(is_causal=case.is_causal, causal_alignment=case.causal_alignment, training=case.training)
    check_against_fd(case.config, tensors, call, options, output_cotangent(case), name)


@settings(max_examples=25)
@given(data=st.data())
def test_random_gradients(data):
    """Every option, the modern ones included (rope, qk_norm, windows, softcap, sinks; positions, a cache,
    segment ids): the cache's past_key and past_value are differentiated too.

    qk_norm's eps is 1e-2 here: x / sqrt(mean(x^2) + eps) turns over a width of about sqrt(eps) around
    x = 0, and a central difference of step EPS = 1e-6 is only accurate where the function is smooth at
    that scale. With eps 1e-6 and head_dim 1 a projected key of 0.002 made the difference 5.9e-5 off a
    gradient of 51.2 (the VJP was right: steps of 1e-7 and 1e-8 converge to it). eps is a constant of the
    same formula, and the case grid checks 1e-6 and 1e-5 at head_dim 4."""
    config = data.draw(configs(dropout=True, masked_rows=("zero", "uniform"), modern=True, qk_norm_eps=(1e-2,)))
    tensors = weights.init(config, seed=data.draw(st.integers(0, 99)), dtype="float64")
    query, key, value, options = data.draw(calls(config, self_attention=False, modern=True))
    inputs = {"query": query, "key": key, "value": value}
    inputs.update({name: options.pop(name) for name in ("past_key", "past_value") if name in options})
    d_out = np.random.default_rng(0).standard_normal((query.shape[0], query.shape[1], config.out_dim))
    check_against_fd(config, tensors, inputs, options, d_out, "random", points=3)


def test_self_attention_folds_key_and_value_gradients_into_query():
    config = weights.AttentionConfig(num_heads=2, query_dim=4, head_dim=3)
    tensors = weights.init(config, seed=0, dtype="float64")
    x = np.random.default_rng(0).standard_normal((2, 3, 4))
    d = np.random.default_rng(1).standard_normal((2, 3, 4))
    _, self_grads = multi_head_attention_vjp(config, tensors, x, d_output=d, is_causal=True)
    _, split = multi_head_attention_vjp(config, tensors, x, x.copy(), x.copy(), d_output=d, is_causal=True)
    assert set(self_grads) == {"query"} | set(config.tensor_shapes())
    np.testing.assert_allclose(self_grads["query"], split["query"] + split["key"] + split["value"], rtol=1e-12, atol=1e-14)


def _nan_policy_call(which):
    """A call under masked_row="nan" with fully masked query rows: the case grid's masked_rows_nan, or a
    modern one (rope, layer norm of q and k, softcap, GQA, a cache of 3 positions) whose mask empties rows."""
    if which == "masked_rows_nan":
        case = CASES[which]
        inputs = make_inputs(case)
        call = {k: inputs[k] for k in ("query", "key", "value")}
        return case.config, make_tensors(case), call, {"mask": inputs["mask"]}, output_cotangent(case)
    config = weights.AttentionConfig(num_heads=4, num_kv_heads=2, query_dim=6, head_dim=4, masked_row="nan",
                                     rope={"theta": 100.0}, qk_norm={"type": "layer"}, logit_softcap=5.0)
    rng = np.random.default_rng(5)
    B, T, S, P = 2, 4, 3, 3
    call = {"query": rng.standard_normal((B, T, 6)), "key": rng.standard_normal((B, S, 6)),
            "value": rng.standard_normal((B, S, 6)), "past_key": rng.standard_normal((B, 2, P, 4)),
            "past_value": rng.standard_normal((B, 2, P, 4))}
    mask = rng.random((B, 1, T, P + S)) < 0.7
    mask[..., 0] = True
    mask[0, 0, 2, :] = mask[1, 0, 0, :] = False  # two fully masked rows
    d_out = rng.standard_normal((B, T, config.out_dim))
    return config, weights.init(config, seed=3, dtype="float64"), call, {"mask": mask}, d_out


# The gradients the attention weights reach on the way out (ctx = w @ v, out = ctx @ Wo + bo): the value
# side and the output kernel. Everything before the logits is reached through the mask stage only.
WEIGHTED_BY_THE_WEIGHTS = {"value", "past_value", "value.kernel", "value.bias", "output.kernel"}


@pytest.mark.parametrize("which", ["masked_rows_nan", "modern_cache"])
def test_nan_policy_rows_poison_only_the_gradients_the_weights_reach(which):
    """backward.py promises: a fully masked row's NaN weights ("nan" policy) reach the value gradient, and
    not the query and key gradients (a masked position gets no gradient, as autodiff of a `where`). So NaN is
    in exactly the gradients the weights multiply (WEIGHTED_BY_THE_WEIGHTS), and every other gradient (query,
    key, past_key, their projection and norm tensors, output.bias) is NaN-free and right: those before the
    logits equal finite differences of sum(output * d_output) over the rows that are not NaN (a NaN row's
    output does not depend on them), output.bias is d_output summed over every row."""
    config, tensors, call, options, d_out = _nan_policy_call(which)
    out, grads = multi_head_attention_vjp(config, tensors, **call, **options, d_output=d_out)
    nan_rows = np.isnan(out).any(axis=-1)  # (B, T)
    assert nan_rows.sum() == 2 and not np.isnan(out[~nan_rows]).any(), f"NaN rows {np.argwhere(nan_rows).tolist()}"
    with_nan = {name for name, g in grads.items() if np.isnan(g).any()}
    expected = WEIGHTED_BY_THE_WEIGHTS & set(grads)
    assert with_nan == expected, (
        f"{which}: NaN in {sorted(with_nan)}, expected in {sorted(expected)} only; NaN counts "
        f"{ {name: int(np.isnan(g).sum()) for name, g in grads.items()} }")
    np.testing.assert_allclose(grads["output.bias"], d_out.sum(axis=(0, 1)), rtol=1e-12, atol=1e-12,
                               err_msg="output.bias: d_output summed over every row")

    def finite_rows_loss(name, a):
        changed_tensors = dict(tensors, **{name: a}) if name in tensors else tensors
        changed_call = dict(call, **{name: a}) if name in call else call
        o = multi_head_attention(config, changed_tensors, **changed_call, **options)
        return float((o * d_out)[~nan_rows].sum())

    rng = np.random.default_rng(0)
    for name in sorted(set(grads) - expected - {"output.bias"}):
        grad, array = grads[name], (tensors[name] if name in tensors else call[name])
        for _ in range(4):
            index = tuple(int(rng.integers(0, n)) for n in grad.shape)
            fd = finite_difference(lambda a, name=name: finite_rows_loss(name, a), array, index)
            assert abs(grad[index] - fd) <= 1e-7 + 1e-6 * abs(fd), (
                f"{which}: d{name}{list(index)} = {grad[index]!r}, finite difference over the rows that are not "
                f"NaN {fd!r}, diff {abs(grad[index] - fd):.3g}")


@pytest.mark.parametrize("name", ["random_differential_1012028", "random_1001932"])
def test_the_kernel_formulations_are_the_same_gradients_in_float64(name):
    """chunked_core and fold_scale (the 16-bit formulations the tolerance policy counts for chunked and fused
    results, conformance.suite.compare.kernel_same_precision) only move roundings: in float64 they are the
    stages' output and gradients to round-off."""
    from conformance.suite.cases import random_case, random_differential_case

    case = (random_differential_case if "differential" in name else random_case)(int(name.rsplit("_", 1)[1]))
    tensors, inputs = make_tensors(case), make_inputs(case)
    kwargs = dict(d_output=output_cotangent(case), is_causal=case.is_causal, causal_alignment=case.causal_alignment,
                  **{n: inputs.get(n) for n in ("mask", "bias", "positions", "key_positions", "past_key",
                                                "past_value")})
    args = (case.config, tensors, inputs["query"], inputs.get("key"), inputs.get("value"))
    out, grads = multi_head_attention_vjp(*args, **kwargs)
    out2, grads2 = multi_head_attention_vjp(*args, chunked_core=True, fold_scale=True, **kwargs)
    np.testing.assert_allclose(out2, out, rtol=1e-12, atol=1e-12 * np.abs(out).max())
    for n, g in grads.items():
        np.testing.assert_allclose(grads2[n], g, rtol=1e-10, atol=1e-10 * max(np.abs(g).max(), 1.0), err_msg=n)
