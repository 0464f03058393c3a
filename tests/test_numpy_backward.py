"""The hand-written VJP against central finite differences in float64."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import calls, configs

import weights
from conformance.cases import CASES, make_inputs, make_tensors, output_cotangent
from impl_numpy import multi_head_attention, multi_head_attention_vjp

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


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c.config.masked_row != "nan"])
def test_case_grid_gradients(name):
    case = CASES[name]
    inputs = make_inputs(case)
    tensors = make_tensors(case)
    call = {k: inputs[k] for k in ("query", "key", "value")}
    call.update({k: inputs[k] for k in ("past_key", "past_value") if k in inputs})  # differentiated too
    options = {k: v for k, v in inputs.items() if k not in call}  # masks, bias, positions, segment ids
    options.update(is_causal=case.is_causal, causal_alignment=case.causal_alignment, training=case.training)
    check_against_fd(case.config, tensors, call, options, output_cotangent(case), name)


@settings(max_examples=25)
@given(data=st.data())
def test_random_gradients(data):
    config = data.draw(configs(dropout=True, masked_rows=("zero", "uniform")))
    tensors = weights.init(config, seed=data.draw(st.integers(0, 99)), dtype="float64")
    query, key, value, options = data.draw(calls(config, self_attention=False))
    d_out = np.random.default_rng(0).standard_normal((query.shape[0], query.shape[1], config.out_dim))
    check_against_fd(config, tensors, {"query": query, "key": key, "value": value}, options, d_out, "random", points=3)


def test_self_attention_folds_key_and_value_gradients_into_query():
    config = weights.AttentionConfig(num_heads=2, query_dim=4, head_dim=3)
    tensors = weights.init(config, seed=0, dtype="float64")
    x = np.random.default_rng(0).standard_normal((2, 3, 4))
    d = np.random.default_rng(1).standard_normal((2, 3, 4))
    _, self_grads = multi_head_attention_vjp(config, tensors, x, d_output=d, is_causal=True)
    _, split = multi_head_attention_vjp(config, tensors, x, x.copy(), x.copy(), d_output=d, is_causal=True)
    assert set(self_grads) == {"query"} | set(config.tensor_shapes())
    np.testing.assert_allclose(self_grads["query"], split["query"] + split["key"] + split["value"], rtol=1e-12, atol=1e-14)


def test_nan_policy_rows_give_nan_gradients():
    case = CASES["masked_rows_nan"]
    inputs = make_inputs(case)
    _, grads = multi_head_attention_vjp(case.config, make_tensors(case), inputs["query"], inputs["key"], inputs["value"],
                                        d_output=output_cotangent(case), mask=inputs["mask"])
    assert np.isnan(grads["value"]).any(), "a NaN weight row must poison the value gradient, as autodiff does"
