"""The modern features in the NumPy spec: against an independent port
(tests/mutants.py, written from the contract's words), decoding with the
cache against the full causal call, the fused/chunked path against the
stages, the VJP against finite differences, and the call's validation."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from modern_checks import DECODE_CONFIGS, check_in_place_decode, decode_in_place, decode_reference
from mutants import port
from test_numpy_backward import check_against_fd

import weights
from impl_numpy import multi_head_attention
from impl_numpy.backward import multi_head_attention_vjp
from weights import AttentionConfig

pytestmark = pytest.mark.reference  # NumPy only, no framework looked for: the numpy env runs it, `all` does not again

YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
LLAMA3 = {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}


@st.composite
def modern_calls(draw):
    """A config drawing every modern feature, and a call (float64) with a cache or segments."""
    K = draw(st.integers(1, 2))
    N = K * draw(st.integers(1, 2))
    H = 2 * draw(st.integers(1, 4))
    rope = draw(st.one_of(st.none(), st.fixed_dictionaries({
        "rotary_dim": st.sampled_from([None, 2]), "interleaved": st.booleans(),
        "theta": st.sampled_from([100.0, 10000.0]), "scaling": st.sampled_from([None, YARN, LLAMA3])})))
    config = AttentionConfig(
        num_heads=N, num_kv_heads=K, query_dim=6, head_dim=H, rope=rope,
        qk_norm=draw(st.one_of(st.none(), st.fixed_dictionaries({
            "type": st.sampled_from(["rms", "layer"]), "scope": st.sampled_from(["head", "all"])}))),
        logit_softcap=draw(st.sampled_from([None, 0.5, 4.0])), use_sinks=draw(st.booleans()),
        window_left=draw(st.integers(-1, 3)), window_right=draw(st.integers(-1, 2)),
        masked_row=draw(st.sampled_from(["zero", "uniform"])),
    )
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    B, T = draw(st.integers(1, 2)), draw(st.integers(1, 6))
    P = draw(st.integers(0, 4))
    S = T if P == 0 and draw(st.booleans()) else draw(st.integers(1, 6))
    causal = draw(st.booleans())
    inputs = {"query": rng.standard_normal((B, T, 6)), "key": rng.standard_normal((B, S, 6)),
              "value": rng.standard_normal((B, S, 6))}
    if P:
        inputs["past_key"] = rng.standard_normal((B, K, P, H))
        inputs["past_value"] = rng.standard_normal((B, K, P, H))
    if draw(st.booleans()):
        inputs["positions"] = rng.integers(0, 50, size=(B, T))
        inputs["key_positions"] = rng.integers(0, 50, size=(B, S))
    if draw(st.booleans()):
        inputs["segment_ids"] = rng.integers(0, 2, size=(B, T))
        inputs["key_segment_ids"] = rng.integers(0, 2, size=(B, P + S))
    if draw(st.booleans()):
        inputs["mask"] = rng.random((B, 1, T, P + S)) < 0.7
    options = {"is_causal": causal, "causal_alignment": "bottom_right" if P or draw(st.booleans()) else "top_left"}
    return config, weights.init(config, seed=seed % 1000, dtype="float64"), inputs, options


@settings(max_examples=60, deadline=None)
@given(modern_calls())
def test_stages_equal_the_independent_port_and_the_chunked_path(call):
    config, tensors, inputs, options = call
    out, w, present_key, present_value = multi_head_attention(config, tensors, **inputs, **options,
                                                              return_weights=True, return_cache=True)
    ported = port(config.to_dict(), tensors, inputs, {**options, "dtype": "float64", "training": False,
                                                      "return_weights": True, "return_cache": True})
    for name, got in (("output", out), ("weights", w), ("present_key", present_key),
                      ("present_value", present_value)):
        np.testing.assert_allclose(got, ported[name], rtol=1e-10, atol=1e-12, err_msg=name)
    for chunk in (1, 2, 5):
        fused, fk, fv = multi_head_attention(config, tensors, **inputs, **options, chunk_size=chunk, return_cache=True)
        np.testing.assert_allclose(fused, out, rtol=1e-10, atol=1e-12, err_msg=f"chunk_size={chunk}")
        assert fk.tobytes() == present_key.tobytes() and fv.tobytes() == present_value.tobytes()
    # the plain fast path (no chunk_size, float64) takes the same core
    np.testing.assert_allclose(multi_head_attention(config, tensors, **inputs, **options), out, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("features", [
    {"rope": {}},
    {"rope": {"interleaved": True, "rotary_dim": 2, "scaling": YARN}, "qk_norm": {"type": "rms"}},
    {"rope": {}, "window_left": 2, "use_sinks": True, "logit_softcap": 3.0},
    {"qk_norm": {"type": "layer", "scope": "all"}, "window_left": 0},
], ids=["rope", "yarn_partial_norm", "window_sinks_softcap", "norm_all_window_0"])
def test_decoding_token_by_token_equals_the_full_causal_call(features, dtype):
    config = AttentionConfig(num_heads=4, num_kv_heads=2, query_dim=8, head_dim=4, **features)
    tensors = weights.init(config, seed=3, dtype=dtype)
    x = np.random.default_rng(0).standard_normal((2, 7, 8)).astype(dtype)
    full = multi_head_attention(config, tensors, x, is_causal=True)
    prompt = 3
    out, k, v = multi_head_attention(config, tensors, x[:, :prompt], is_causal=True, return_cache=True)
    rows = [out]
    for i in range(prompt, 7):
        out, k, v = multi_head_attention(config, tensors, x[:, i:i + 1], past_key=k, past_value=v, is_causal=True,
                                         causal_alignment="bottom_right", return_cache=True)
        rows.append(out)
    assert k.shape == (2, 2, 7, 4)
    tol = 1e-12 if dtype == "float64" else 2e-6
    np.testing.assert_allclose(np.concatenate(rows, axis=1), full, rtol=tol, atol=tol)


def test_gradients_through_every_modern_stage_match_finite_differences():
    config = AttentionConfig(num_heads=4, num_kv_heads=2, query_dim=6, head_dim=4, rope={"rotary_dim": 2},
                             qk_norm={"type": "layer", "scope": "head"}, logit_softcap=2.0, use_sinks=True,
                             window_left=2)
    rng = np.random.default_rng(5)
    tensors = weights.init(config, seed=5, dtype="float64")
    inputs = {"query": rng.standard_normal((2, 3, 6)), "key": rng.standard_normal((2, 3, 6)),
              "value": rng.standard_normal((2, 3, 6)), "past_key": rng.standard_normal((2, 2, 2, 4)),
              "past_value": rng.standard_normal((2, 2, 2, 4))}
    options = {"is_causal": True, "causal_alignment": "bottom_right"}
    d_out = rng.standard_normal((2, 3, 6))
    check_against_fd(config, tensors, inputs, options, d_out, "modern")
    _, grads = multi_head_attention_vjp(config, tensors, d_output=d_out, **inputs, **options)
    assert {"past_key", "past_value", "sinks", "query.norm.scale", "key.norm.bias"} <= set(grads)


def test_norm_all_scope_gradients_match_finite_differences():
    config = AttentionConfig(num_heads=2, query_dim=6, head_dim=4, qk_norm={"type": "rms", "scope": "all"},
                             rope={"interleaved": True}, window_right=1)
    rng = np.random.default_rng(6)
    tensors = weights.init(config, seed=6, dtype="float64")
    inputs = {"query": rng.standard_normal((2, 4, 6)), "segment_ids": np.array([0, 0, 1, 1]),
              "positions": np.array([0, 1, 0, 1]), "key_positions": np.array([0, 1, 0, 1])}
    check_against_fd(config, tensors, inputs, {"is_causal": False}, rng.standard_normal((2, 4, 6)), "norm all")


def test_a_fully_masked_row_with_sinks_gives_zero_whatever_masked_row_says():
    for policy in ("zero", "uniform", "nan"):
        config = AttentionConfig(num_heads=2, query_dim=4, head_dim=2, use_sinks=True, masked_row=policy)
        tensors = weights.init(config, seed=0, dtype="float64")
        x = np.random.default_rng(1).standard_normal((1, 3, 4))
        mask = np.ones((1, 1, 3, 3), bool)
        mask[0, 0, 1] = False
        out, w = multi_head_attention(config, tensors, x, mask=mask, return_weights=True)
        assert np.all(w[0, :, 1] == 0), policy
        assert np.allclose(out[0, 1], tensors["output.bias"]), policy
        assert np.all(w.sum(-1)[0, :, [0, 2]] < 1)  # the sink takes some of every row's mass


def _error(**kwargs):
    config = kwargs.pop("config", AttentionConfig(num_heads=2, query_dim=4, head_dim=2, rope={}))
    tensors = kwargs.pop("tensors", weights.init(config, seed=0))
    x = np.zeros((2, 3, 4), np.float32)
    with pytest.raises(ValueError) as info:
        multi_head_attention(config, tensors, x, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_bad_modern_calls_name_the_argument():
    cache = np.zeros((2, 2, 4, 2), np.float32)
    assert "positions" in _error(positions=np.arange(4))
    assert "positions" in _error(positions=np.arange(3.0))
    assert "past_value" in _error(past_key=cache)
    assert "past_key" in _error(past_key=cache[:, :1], past_value=cache[:, :1])
    assert "bottom_right" in _error(past_key=cache, past_value=cache, is_causal=True)
    assert "key_segment_ids" in _error(past_key=cache, past_value=cache, segment_ids=np.zeros(3, np.int64),
                                       causal_alignment="bottom_right")
    normed = AttentionConfig(num_heads=2, query_dim=4, head_dim=2, qk_norm={"type": "rms"})
    tensors = weights.init(normed, seed=0)
    del tensors["key.norm.scale"]
    assert "key.norm.scale" in _error(config=normed, tensors=tensors)


# -- an in-place cache (cache_length=): the caller's buffers, written where the new keys go --------------------

@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("config_name", list(DECODE_CONFIGS))
@pytest.mark.parametrize("traced", [False, True], ids=["fused", "stages"])
def test_decoding_in_place_equals_the_full_causal_call(config_name, dtype, traced):
    """A prompt and then one token at a time into one zeroed buffer pair: the rows equal the full causal
    call's (float64 reference), the buffers' first TOTAL positions its present cache, nothing written past
    them, and every step hands back the very buffers it was given."""
    tensors, x, want, _, _ = decode_reference(config_name, dtype)
    config = DECODE_CONFIGS[config_name]

    def step(t, part, pk, pv, P):
        return multi_head_attention(config, t, part, past_key=pk, past_value=pv, cache_length=P, is_causal=True,
                                    causal_alignment="bottom_right", return_cache=True,
                                    trace=[] if traced else None)

    outputs, pk, pv, same = decode_in_place(step, tensors, x, lambda shape: np.zeros(shape, dtype))
    assert same, "a step returned a new array instead of the buffers it was given"
    tol = 1e-12 if dtype == "float64" else 2e-5

    def compare(name, got, expected):
        np.testing.assert_allclose(got, expected, rtol=tol, atol=tol, err_msg=name)

    check_in_place_decode(outputs, pk, pv, want, compare)


@settings(max_examples=40, deadline=None)
@given(modern_calls(), st.integers(0, 3))
def test_an_in_place_cache_computes_what_the_cache_passed_whole_does(call, spare):
    """Bit for bit on both paths: cache_length P over buffers of P + S + spare positions equals the call with
    past_key[:, :, :P]; the buffers then hold past_key and the new keys; the spare positions, NaN here to
    show they are never read, stay as they were."""
    config, tensors, inputs, options = call
    inputs = dict(inputs)
    B, S = inputs["key"].shape[:2]
    K, H = config.num_kv_heads, config.head_dim
    P = inputs["past_key"].shape[2] if "past_key" in inputs else 0
    whole = {name: inputs.pop(name) for name in ("past_key", "past_value") if name in inputs}
    for traced in (None, []):
        expected = multi_head_attention(config, tensors, **inputs, **whole, **options, return_cache=True, trace=traced)
        buffers = [np.full((B, K, P + S + spare, H), np.nan) for _ in range(2)]
        for buffer, name in zip(buffers, ("past_key", "past_value")):
            if name in whole:
                buffer[:, :, :P] = whole[name]
        got = multi_head_attention(config, tensors, **inputs, **options, past_key=buffers[0], past_value=buffers[1],
                                   cache_length=P, return_cache=True, trace=traced)
        assert got[1] is buffers[0] and got[2] is buffers[1]
        assert got[0].tobytes() == expected[0].tobytes(), "output"
        for buffer, present in zip(buffers, expected[1:]):
            assert buffer[:, :, :P + S].tobytes() == present.tobytes()
            assert np.isnan(buffer[:, :, P + S:]).all()


def test_an_in_place_cache_refuses_a_buffer_it_cannot_write():
    config = AttentionConfig(num_heads=2, query_dim=4, head_dim=2)
    tensors = weights.init(config, seed=0)  # float32
    x = np.zeros((1, 1, 4), np.float32)

    def error(past_key):
        with pytest.raises(ValueError) as info:
            multi_head_attention(config, tensors, x, past_key=past_key, past_value=np.zeros((1, 2, 4, 2), np.float32),
                                 cache_length=1)
        return str(info.value)

    frozen = np.zeros((1, 2, 4, 2), np.float32)
    frozen.flags.writeable = False
    assert error(frozen) == ("past_key with cache_length is written in place: it must be a writeable numpy array "
                             "of the storage dtype float32: got a read-only float32 array")
    assert error(np.zeros((1, 2, 4, 2))).endswith("got dtype float64")
    assert error(np.zeros((1, 2, 4, 2)).tolist()).endswith("got a list")
    with pytest.raises(ValueError) as info:
        multi_head_attention(config, tensors, x, past_key=np.zeros((1, 2, 4, 2), np.float32),
                             past_value=np.zeros((1, 2, 4, 2), np.float32), cache_length=4)
    assert str(info.value) == ("cache_length must be between 0 and C - S = 4 - 1 = 3 (the buffers hold C = 4 "
                               "positions and the call writes S = 1 more): got 4")


def test_a_sink_below_float32_round_off_keeps_its_gradient_in_float32():
    """The sink's weight beside a logit of about 24 is e^-24 ~ 4e-11, under float32's unit round-off:
    taken as 1 - sum(w) it cancels to exactly 0 in float32 and so did the sink's gradient (random_case
    924238 of the unseen-seed sweep, margin 1060). Taken as exp(sink - max) / total, the float32
    gradient is the float64 one to float32's relative round-off."""
    config = AttentionConfig(num_heads=1, query_dim=4, head_dim=4, use_sinks=True)
    tensors = weights.init(config, seed=0, dtype="float64")
    tensors["sinks"] = np.array([-1.0])
    tensors["query.kernel"] = np.eye(4).reshape(4, 1, 4) * 5.0  # (D, N, H): logits q . k of about 25
    tensors["key.kernel"] = np.eye(4).reshape(4, 1, 4)
    for name in ("query.bias", "key.bias"):
        tensors[name] = np.zeros_like(tensors[name])
    x = np.array([[[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]]]) * np.sqrt(10.0)  # (B, T, D): |x|^2 = 10
    d_out = np.random.default_rng(1).standard_normal((1, 2, 4))
    _, want = multi_head_attention_vjp(config, tensors, x, d_output=d_out)
    f32 = {name: t.astype(np.float32) for name, t in tensors.items()}
    _, got = multi_head_attention_vjp(config, f32, x.astype(np.float32), d_output=d_out.astype(np.float32))
    sink64, sink32 = float(want["sinks"][0]), float(got["sinks"][0])
    assert 0 < abs(sink64) < 1e-8, f"the case must put the sink below float32's round-off: d_sink {sink64}"
    assert abs(sink32 - sink64) <= 1e-5 * abs(sink64), f"float32 d_sink {sink32} against float64 {sink64}"
