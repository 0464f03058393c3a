"""Judging a framework backend on the case grid, the way `mha check` does.

Framework tests go through conformance.compare.run_case, so they use exactly
the tolerance policy of the suite (scales, gradient magnitudes, same-precision
errors) and their failures read like `mha check`'s.
"""

from __future__ import annotations

import numpy as np
import pytest

from conformance.compare import STATUS_PASS, CaseResult, judge_gradients, run_case


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
