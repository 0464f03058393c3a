"""The NumPy reference against independent formulations and invariants."""

from __future__ import annotations

import numpy as np
import pytest
from formulations import fused_qkv, per_head_loop, scalar_loop
from hypothesis import given
from hypothesis import strategies as st
from reference_checks import assert_nan_rows, nan_key_call
from strategies import calls, configs

import weights
from impl_numpy import causal_mask, multi_head_attention
from weights import AttentionConfig
from weights.call import OPTIONAL_STAGES

pytestmark = pytest.mark.reference  # NumPy only, no framework looked for: the numpy env runs it, `all` does not again


def assert_allclose64(actual, expected, what, rtol=1e-12, atol=1e-12):
    """float64 against float64: both sides exact up to a few ulps of round-off
    per reduction (sizes here are < 10)."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    err = np.abs(actual - expected)
    err = np.where(np.isnan(actual) & np.isnan(expected), 0, err)
    bound = atol + rtol * np.abs(np.nan_to_num(expected))
    bad = ~(err <= bound)
    if bad.any():
        i = np.unravel_index(np.argmax(np.where(bad, err, -1)), err.shape)
        raise AssertionError(f"{what}: worst at {i}: got {actual[i]!r}, expected {expected[i]!r}, "
                             f"error {err[i]:.3g} > bound {bound[i]:.3g} ({int(bad.sum())} elements off)")


@given(data=st.data())
def test_matches_per_head_loop_every_option(data):
    config = data.draw(configs(dropout=True))
    tensors = weights.init(config, seed=data.draw(st.integers(0, 1000)), dtype="float64")
    query, key, value, options = data.draw(calls(config))
    out, w = multi_head_attention(config, tensors, query, key, value, return_weights=True, **options)
    expected_out, expected_w = per_head_loop(
        config, tensors, query, key, value, return_weights=True,
        **{k: v for k, v in options.items() if k != "training"},
    )
    assert_allclose64(w, expected_w, "weights")
    assert_allclose64(out, expected_out, "output")


@given(config=configs(equal_dims=True, masked_rows=("zero",)), seed=st.integers(0, 1000), causal=st.booleans(),
       B=st.integers(1, 3), T=st.integers(1, 6))
def test_matches_fused_qkv_self_attention(config, seed, causal, B, T):
    config = config.replace(num_kv_heads=config.num_heads, value_head_dim=config.head_dim)
    tensors = weights.init(config, seed=seed, dtype="float64")
    x = np.random.default_rng(seed).standard_normal((B, T, config.query_dim))
    assert_allclose64(multi_head_attention(config, tensors, x, is_causal=causal), fused_qkv(config, tensors, x, is_causal=causal),
                      "fused qkv")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_matches_scalar_loop(causal, kv_heads):
    config = AttentionConfig(num_heads=4, num_kv_heads=kv_heads, query_dim=3, key_dim=2, value_dim=5, head_dim=2,
                             value_head_dim=3, out_dim=4, scale=0.7)
    tensors = weights.init(config, seed=7, dtype="float64")
    rng = np.random.default_rng(3)
    q, k, v = rng.standard_normal((2, 3, 3)), rng.standard_normal((2, 4, 2)), rng.standard_normal((2, 4, 5))
    assert_allclose64(multi_head_attention(config, tensors, q, k, v, is_causal=causal),
                      scalar_loop(config, tensors, q, k, v, is_causal=causal), "scalar loop")


@given(data=st.data())
def test_permuting_keys_and_values_with_the_mask_changes_nothing(data):
    config = data.draw(configs())
    tensors = weights.init(config, seed=1, dtype="float64")
    query, key, value, options = data.draw(calls(config, self_attention=False))
    options.pop("is_causal", None)  # causality ties keys to positions
    options.pop("causal_alignment", None)
    S = key.shape[1]
    perm = np.random.default_rng(S).permutation(S)
    permuted = dict(options)
    for name in ("mask", "bias"):
        if name in options:
            a = options[name]
            permuted[name] = a[..., perm] if a.shape[-1] == S else a
    base = multi_head_attention(config, tensors, query, key, value, **options)
    moved = multi_head_attention(config, tensors, query, key[:, perm], value[:, perm], **permuted)
    assert_allclose64(moved, base, "permuted keys")


@given(config=configs(equal_dims=True), seed=st.integers(0, 10**6), T=st.integers(2, 7),
       alignment=st.sampled_from(["top_left", "bottom_right"]))
def test_causal_outputs_ignore_future_tokens(config, seed, T, alignment):
    tensors = weights.init(config, seed=seed % 97, dtype="float64")
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, T, config.query_dim))
    cut = int(rng.integers(1, T))
    changed = x.copy()
    changed[:, cut:] = rng.standard_normal(changed[:, cut:].shape) * 10
    a = multi_head_attention(config, tensors, x, is_causal=True, causal_alignment=alignment)
    b = multi_head_attention(config, tensors, changed, is_causal=True, causal_alignment=alignment)
    assert_allclose64(b[:, :cut], a[:, :cut], f"rows before {cut}")
    assert not np.allclose(a[:, cut:], b[:, cut:]), "changing future tokens must change later rows (test is live)"


@given(data=st.data())
def test_all_true_mask_equals_no_mask(data):
    config = data.draw(configs(modern=True))
    tensors = weights.init(config, seed=2, dtype="float64")
    query, key, value, options = data.draw(calls(config, modern=True))
    modern = {k: options[k] for k in ("positions", "key_positions", "past_key", "past_value", "segment_ids",
                                      "key_segment_ids", "is_causal", "causal_alignment") if k in options}
    B, T = query.shape[0], query.shape[1]
    S = key.shape[1] + (0 if options.get("past_key") is None else options["past_key"].shape[2])  # every key
    shape = data.draw(st.sampled_from([(T, S), (B, T, S), (B, 1, T, S), (B, config.num_heads, T, S)]))
    a = multi_head_attention(config, tensors, query, key, value, mask=np.ones(shape, bool), **modern)
    b = multi_head_attention(config, tensors, query, key, value, **modern)
    np.testing.assert_array_equal(a, b, err_msg="an all-True mask must be bit-identical to no mask")


def staged(config, tensors, query, key, value, **options):
    """The stage-by-stage path: asking for a trace turns the fused fast path off."""
    return multi_head_attention(config, tensors, query, key, value, trace=[], **options)


@given(data=st.data(), chunk=st.sampled_from([1, 2, 3, 4, 8]))
def test_chunked_equals_staged(data, chunk):
    config = data.draw(configs(dropout=True, modern=True))
    tensors = weights.init(config, seed=3, dtype="float64")
    query, key, value, options = data.draw(calls(config, modern=True))
    expected = staged(config, tensors, query, key, value, **options)
    chunked = multi_head_attention(config, tensors, query, key, value, chunk_size=chunk, **options)
    assert_allclose64(chunked, expected, f"chunk_size={chunk}", rtol=1e-11, atol=1e-12)


@given(data=st.data())
def test_fused_fast_path_equals_staged(data):
    """Without trace or weights, float64 runs logits..attend fused (chunked.py's
    core); it must agree with the stages, every option included."""
    config = data.draw(configs(dropout=True, modern=True))
    tensors = weights.init(config, seed=4, dtype="float64")
    query, key, value, options = data.draw(calls(config, modern=True))
    expected = staged(config, tensors, query, key, value, **options)
    fused = multi_head_attention(config, tensors, query, key, value, **options)
    assert_allclose64(fused, expected, "fused fast path", rtol=1e-11, atol=1e-12)
    with_weights, _ = multi_head_attention(config, tensors, query, key, value, return_weights=True, **options)
    np.testing.assert_array_equal(with_weights, expected, err_msg="return_weights takes the stages too")


def test_masked_row_policies():
    config = AttentionConfig(num_heads=2, query_dim=4, head_dim=2)
    tensors = weights.init(config, seed=0, dtype="float64")
    x = np.random.default_rng(0).standard_normal((1, 3, 4))
    mask = np.ones((1, 1, 3, 3), bool)
    mask[0, 0, 1] = False  # query 1 sees nothing
    results = {}
    for policy in ("zero", "uniform", "nan"):
        cfg = config.replace(masked_row=policy)
        out, w = multi_head_attention(cfg, tensors, x, mask=mask, return_weights=True)
        results[policy] = (out, w)
        assert np.isfinite(w[0, :, [0, 2]]).all(), f"{policy}: other rows stay finite"
    assert (results["zero"][1][0, :, 1] == 0).all()
    assert (results["uniform"][1][0, :, 1] == 1 / 3).all()
    assert np.isnan(results["nan"][1][0, :, 1]).all() and np.isnan(results["nan"][0][0, 1]).all()
    # "zero": the row's context is 0, so its output is the output bias alone.
    np.testing.assert_allclose(results["zero"][0][0, 1], tensors["output.bias"], rtol=0, atol=1e-15)
    # "uniform": the context is the mean of the values (Keras' and Flax's answer).
    v = np.einsum("BSD,DKV->BKSV", x, tensors["value.kernel"]) + tensors["value.bias"][None, :, None]
    ctx = v.mean(axis=2)  # (B, K, V)
    expected = np.einsum("BKV,KVO->BO", ctx, tensors["output.kernel"]) + tensors["output.bias"]
    np.testing.assert_allclose(results["uniform"][0][:, 1], expected, rtol=1e-12, atol=1e-12)


def test_masked_positions_have_weight_exactly_zero():
    config = AttentionConfig(num_heads=2, query_dim=4, head_dim=2)
    tensors = weights.init(config, seed=0, dtype="float32")
    x = np.random.default_rng(0).standard_normal((2, 5, 4)).astype(np.float32) * 30  # large logits
    _, w = multi_head_attention(config, tensors, x, is_causal=True, return_weights=True)
    hidden = ~causal_mask(5, 5)
    assert (w[..., hidden] == 0).all(), f"max weight on a masked key: {np.abs(w[..., hidden]).max()}"


def test_large_logits_do_not_overflow():
    config = AttentionConfig(num_heads=1, query_dim=2, head_dim=2, scale=1.0)
    tensors = {name: np.ones(shape) for name, shape in config.tensor_shapes().items()}
    x = np.full((1, 3, 2), 300.0)  # logits ~ 3.6e5: exp would overflow without max subtraction
    x[0, 1] = 301.0
    out, w = multi_head_attention(config, tensors, x, return_weights=True)
    assert np.isfinite(out).all() and np.isfinite(w).all()
    np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-12)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_low_precision_rule_softmax_in_float32(dtype):
    """16-bit storage: logits rounded to the dtype, softmax computed in float32
    then rounded. Check against doing exactly that by hand."""
    from weights import dtype_from_name

    config = AttentionConfig(num_heads=2, query_dim=4, head_dim=2)
    tensors = weights.init(config, seed=5, dtype=dtype)
    x = np.random.default_rng(5).standard_normal((1, 3, 4)).astype(dtype_from_name(dtype))
    trace = []
    multi_head_attention(config, tensors, x, trace=trace)
    stages = {e.stage: e.value for e in trace}
    assert all(v.dtype == dtype_from_name(dtype) for v in stages.values()), {k: v.dtype for k, v in stages.items()}
    logits32 = stages["mask"].astype(np.float32)
    e = np.exp(logits32 - logits32.max(-1, keepdims=True))
    expected = (e / e.sum(-1, keepdims=True)).astype(dtype_from_name(dtype))
    np.testing.assert_array_equal(stages["softmax"], expected)


def test_trace_names_every_stage_in_order():
    from impl_numpy import STAGES

    optional = OPTIONAL_STAGES
    plain = AttentionConfig(num_heads=2, query_dim=4, head_dim=2)
    every = AttentionConfig(num_heads=2, query_dim=4, head_dim=2, rope={}, qk_norm={"type": "rms"},
                            logit_softcap=5.0, use_sinks=True, window_left=1, alibi=True, local_chunk=2,
                            query_temperature={"beta": 0.1, "floor": 2.0}, qkv_clip=1.0,
                            output_gate={"scope": "head"}, value_norm={"type": "rms", "weight": False},
                            key_multiplier=0.5, value_scale=2.0)
    # differential attention (value.pair, differential) takes no output gate: its stages in a config of their own
    differential = AttentionConfig(num_heads=2, query_dim=4, head_dim=2, differential={"lambda_init": 0.2})
    with_differential = ("value.pair", "differential")
    for config, expected in ((plain, tuple(s for s in STAGES if s not in optional)),
                             (every, tuple(s for s in STAGES if s not in with_differential)),
                             (differential, tuple(s for s in STAGES if s not in optional or s in with_differential))):
        trace = []
        multi_head_attention(config, weights.init(config, seed=0), np.ones((1, 2, 4), np.float32), trace=trace)
        assert tuple(e.stage for e in trace) == expected, (config, [e.stage for e in trace])


def test_seeded_dropout_is_reproducible_and_rescales():
    config = AttentionConfig(num_heads=2, query_dim=4, head_dim=2, dropout=0.5)
    tensors = weights.init(config, seed=0, dtype="float64")
    x = np.random.default_rng(1).standard_normal((2, 6, 4))
    a = multi_head_attention(config, tensors, x, training=True, seed=11)
    b = multi_head_attention(config, tensors, x, training=True, seed=11)
    c = multi_head_attention(config, tensors, x, training=True, seed=12)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    keep = np.ones((2, 2, 6, 6), bool)
    np.testing.assert_allclose(  # keep everything: 1/(1-p) rescales the weights
        multi_head_attention(config, tensors, x, training=True, dropout_mask=keep),
        per_head_loop(config, tensors, x, x, x, dropout_mask=keep), rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(multi_head_attention(config, tensors, x, training=False),
                                  multi_head_attention(config, tensors, x))


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("kind", ["mask", "bias", "causal"])
def test_a_nan_key_reaches_exactly_the_rows_that_see_it(kind, fast):
    """A NaN in key 4 makes its logit NaN for every query. A position hidden by
    a bool mask, by a -inf bias (a mask too: docs/spec.md) or by the causal mask is
    set to -inf whatever its logit, so exactly the rows that see key 4 are
    NaN, on the stages (trace) and on the fast path, and the -inf bias gives
    the bool mask's very output."""
    config, tensors, (q, k, v), options, sees_key = nan_key_call(kind)
    trace = {} if fast else {"trace": []}
    out = multi_head_attention(config, tensors, q, k, v, **options, **trace)
    assert_nan_rows(out, sees_key)
    if kind == "bias":
        masked = multi_head_attention(config, tensors, q, k, v, mask=np.isfinite(options["bias"]), **trace)
        np.testing.assert_array_equal(out, masked)
