"""Judging a framework backend on the case grid, the way `mha check` does.

Framework tests go through conformance.suite.compare.run_case, so they use exactly
the tolerance policy of the suite (scales, gradient magnitudes, same-precision
errors) and their failures read like `mha check`'s.
"""

from __future__ import annotations

import numpy as np
import pytest

from conformance.suite.compare import STATUS_PASS, CaseResult, judge_gradients, run_case


class WithOptions:
    """An adapter that adds fixed call options (e.g. use_sdpa=True)."""

    def __init__(self, adapter, **extra):
        self.adapter, self.extra = adapter, extra

    def devices(self):
        return self.adapter.devices()

    def forward(self, config, tensors, inputs, options, **kwargs):
        return self.adapter.forward(config, tensors, inputs, {**options, **self.extra}, **kwargs)

    def vjp(self, config, tensors, inputs, options, d_output, **kwargs):
        return self.adapter.vjp(config, tensors, inputs, {**options, **self.extra}, d_output, **kwargs)


def describe(result: CaseResult) -> str:
    lines = [f"{result.case} {result.backend}/{result.device}/{result.dtype}: {result.status} {result.message}"]
    lines += [c.describe() for c in result.comparisons if not c.ok]
    if result.divergence is not None:
        lines.append(result.divergence.describe())
    if "traceback" in result.arrays:
        lines.append(result.arrays["traceback"])
    return "\n".join(lines)


def assert_case_conforms(case, dtype, backend_id, adapter, *, gradients=True, device="cpu", precision="highest") -> CaseResult:
    result = run_case(case, backend_id, dtype=dtype, adapter=adapter, gradients=gradients, device=device,
                      precision=precision)
    assert result.status == STATUS_PASS, describe(result)
    return result


def assert_gradients_conform(case, dtype, grads, *, precision="highest") -> None:
    """Gradients obtained some other way (a layer's own backward) under the policy."""
    failures = [c.describe() for c in judge_gradients(case, dtype, grads, precision=precision) if not c.ok]
    assert not failures, f"{case.name} {dtype}:\n" + "\n".join(failures)


def error_of(fn, *args, **kwargs) -> str:
    with pytest.raises(ValueError) as info:
        fn(*args, **kwargs)
    return str(info.value)


def bad_calls():
    """(id, changes to a valid call): each must raise the reference's ValueError,
    in the same words from every backend (config: N 2, D 8, H 4, dropout 0.1)."""
    rng = np.random.default_rng(7)
    B, T, S, D = 2, 5, 5, 8
    x = rng.standard_normal((B, T, D))
    nan_bias = np.zeros((B, 1, T, S))
    nan_bias[0, 0, 1, 2] = np.nan
    return {
        "rank": dict(query=x[0]),
        "features": dict(query=rng.standard_normal((B, T, 7))),
        "batch": dict(key=rng.standard_normal((3, S, D))),
        "length": dict(key=x, value=rng.standard_normal((B, S + 1, D))),
        "empty": dict(query=np.zeros((0, T, D))),
        "int_query": dict(query=np.ones((B, T, D), dtype=np.int64)),
        "float_mask": dict(mask=np.ones((T, S))),
        "int_mask": dict(mask=np.ones((T, S), dtype=np.int64)),
        "mask_shape": dict(mask=np.ones((B, T, S + 1), dtype=bool)),
        "mask_rank": dict(mask=np.ones((1, 1, 1, T, S), dtype=bool)),
        "bias_shape": dict(bias=np.zeros((3, 1, T, S))),
        "int_bias": dict(bias=np.zeros((T, S), dtype=np.int64)),
        "nan_bias": dict(bias=nan_bias),
        "posinf_bias": dict(bias=np.full((T, S), np.inf)),
        "causal_alignment": dict(is_causal=True, causal_alignment="bottom"),
        "is_causal": dict(is_causal="yes"),
        "dropout_mask_without_training": dict(dropout_mask=np.ones((B, 2, T, S), dtype=bool)),
        "dropout_mask_shape": dict(training=True, dropout_mask=np.ones((B, 1, T, S), dtype=bool)),
        "dropout_mask_dtype": dict(training=True, dropout_mask=np.ones((B, 2, T, S))),
        "training_without_mask_or_seed": dict(training=True),
        "seed_type": dict(training=True, seed=1.5),
        "dtype_name": dict(dtype="float8"),
    }


# (mask builder name, args, kwargs): each must raise impl_numpy's ValueError in its words.
MASK_BUILDER_BAD_CALLS = {
    "alignment": ("causal_mask", (3, 4, "bottom"), {}),
    "float_lengths": ("padding_mask", (np.array([1.0, 2.0]), 3), {}),
    "2d_lengths": ("padding_mask", (np.array([[1, 2]]), 3), {}),
    "too_long": ("padding_mask", (np.array([1, 4]), 3), {}),
    "negative": ("padding_mask", (np.array([-1]), 3), {}),
}


# -- non-finite inputs: the same small calls for every framework's tests --------------

def nan_key_call(kind: str):
    """A NaN in key 4 (B 1, T = S = 5, D 8, two heads, float64) and a call that
    hides key 4 from rows 0-2 by `kind`: "mask" (bool), "bias" (-inf) or
    "causal" (which hides it from rows 0-3). Returns config, tensors, (q, k, v),
    the call's NumPy options, and the rows that see key 4 (T,) bool: exactly
    those rows are NaN in the spec."""
    import weights

    config = weights.AttentionConfig(num_heads=2, query_dim=8, head_dim=4)
    tensors = weights.init(config, seed=5, dtype="float64")
    rng = np.random.default_rng(5)
    q, k, v = rng.standard_normal((1, 5, 8)), rng.standard_normal((1, 5, 8)), rng.standard_normal((1, 5, 8))
    k[0, 4, 0] = np.nan
    visible = np.ones((5, 5), bool)
    visible[:3, 4] = False
    options = {"mask": {"mask": visible}, "bias": {"bias": np.where(visible, 0.0, -np.inf)},
               "causal": {"is_causal": True}}[kind]
    if kind == "causal":
        visible = np.tril(np.ones((5, 5), bool))
    return config, tensors, (q, k, v), options, visible[:, 4]


def assert_nan_rows(out, sees_key) -> None:
    """out (1, T, O): its NaN rows are exactly the rows that see the NaN key."""
    rows = np.isnan(np.asarray(out)[0]).any(axis=-1)
    assert np.array_equal(rows, sees_key), f"NaN rows {rows.tolist()}, rows that see key 4 {sees_key.tolist()}"


def bias_masked_rows_call(masked_row: str):
    """Rows masked by a -inf bias alone (no bool mask; B 2, T 3, S 5, float64):
    batch 0's query 1 sees no key, batch 1's query 2 key 0 only. Returns
    config, tensors, (q, k, v), bias, d_output and the spec's gradients
    (impl_numpy's hand-written vjp) of query, key and value."""
    import impl_numpy
    import weights

    config = weights.AttentionConfig(num_heads=2, query_dim=8, head_dim=4, masked_row=masked_row)
    tensors = weights.init(config, seed=6, dtype="float64")
    rng = np.random.default_rng(6)
    q, k, v = rng.standard_normal((2, 3, 8)), rng.standard_normal((2, 5, 8)), rng.standard_normal((2, 5, 8))
    bias = rng.standard_normal((2, 3, 5))
    bias[0, 1] = -np.inf
    bias[1, 2, 1:] = -np.inf
    d_out = rng.standard_normal((2, 3, 8))
    _, want = impl_numpy.multi_head_attention_vjp(config, tensors, q, k, v, d_output=d_out, bias=bias)
    return config, tensors, (q, k, v), bias, d_out, want


def assert_spec_gradients(got: dict, want: dict) -> None:
    """Gradients of query, key and value: NaN exactly where the spec's are, 1e-12 elsewhere (float64)."""
    for name in ("query", "key", "value"):
        g, w = np.asarray(got[name]), want[name]
        assert np.array_equal(np.isnan(g), np.isnan(w)), (
            f"grad {name}: NaN at {np.argwhere(np.isnan(g)).tolist()}, the spec's at {np.argwhere(np.isnan(w)).tolist()}")
        err = np.abs(np.nan_to_num(g) - np.nan_to_num(w)).max()
        assert err <= 1e-12, f"grad {name}: max abs difference to the spec's vjp {err:.3g} (tolerance 1e-12)"
