"""The frontier fields of the contract (docs/spec-frontier.md) in the NumPy reference, each against an
independent formulation: ALiBi as the explicit bias it is, local chunks as the explicit mask they are, the
temperature, the clip and the gate written out per head in float64; and the config's one-line errors.

(The hand port of tests/mutants.py is a second, whole formulation: test_mutants.py runs it over every case,
the frontier ones included, and its bugs are the frontier mutants.)"""

from __future__ import annotations

import json

import numpy as np
import pytest

import weights
from impl_numpy import multi_head_attention
from weights import AttentionConfig
from weights.alibi import bloom_slopes

pytestmark = pytest.mark.reference  # NumPy only, no framework looked for: the numpy env runs it, `all` does not again

BASE = dict(num_heads=4, num_kv_heads=2, query_dim=8, head_dim=4)


def _inputs(seed, B=2, T=5, D=8):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((B, T, D)), rng


def test_alibi_is_the_bias_it_adds():
    """alibi=True equals the plain layer given the bias -slope_n |i - j| (default positions, no cache)."""
    config = AttentionConfig(**BASE, alibi=True)
    tensors = weights.init(config, seed=3, dtype="float64")
    tensors["alibi.slopes"] = bloom_slopes(4)
    x, _ = _inputs(1)
    plain = config.replace(alibi=False)
    T = x.shape[1]
    distance = np.abs(np.arange(T)[:, None] - np.arange(T)[None, :])
    bias = -bloom_slopes(4)[None, :, None, None] * distance[None, None]
    without = {n: t for n, t in tensors.items() if n != "alibi.slopes"}
    want = multi_head_attention(plain, without, x, bias=bias, is_causal=True)
    for chunk_size in (None, 2):
        got = multi_head_attention(config, tensors, x, is_causal=True, chunk_size=chunk_size)
        np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-13)


def test_alibi_reads_the_cache_offset_and_explicit_positions():
    """Decoding over a cache: the new query at P sees key j at distance P - j; explicit positions move both."""
    config = AttentionConfig(**BASE, alibi=True)
    tensors = weights.init(config, seed=5, dtype="float64")
    x, rng = _inputs(2, T=1)
    past_key, past_value = rng.standard_normal((2, 2, 6, 4)), rng.standard_normal((2, 2, 6, 4))
    slopes = tensors["alibi.slopes"]
    without = {n: t for n, t in tensors.items() if n != "alibi.slopes"}
    plain = config.replace(alibi=False)
    distance = 6 - np.arange(7)  # the query at position 6, keys at 0..6
    bias = -slopes[None, :, None, None] * distance[None, None, None, :]
    want = multi_head_attention(plain, without, x, x, x, past_key=past_key, past_value=past_value, bias=bias)
    got = multi_head_attention(config, tensors, x, x, x, past_key=past_key, past_value=past_value)
    np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-13)
    # flash-attention's bottom-right rule for T != S without a cache: the caller passes positions
    x, _ = _inputs(3, T=3)
    keys = np.random.default_rng(4).standard_normal((2, 6, 8))
    positions = 3 + np.arange(3)  # S - T + i
    i, j = positions[:, None], np.arange(6)[None, :]
    bias = -slopes[None, :, None, None] * np.abs(i - j)[None, None]
    want = multi_head_attention(plain, without, x, keys, keys, bias=bias)
    got = multi_head_attention(config, tensors, x, keys, keys, positions=positions)
    np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-13)


def test_rounded_alibi_is_falcons_bias():
    """alibi_bias_dtype="bfloat16" equals the plain layer given Falcon-RW's bias written out with ml_dtypes:
    bf16(bf16(m_n) * bf16(p_j)) on key j, whatever the query (causal, over a cache, positions past 256 where
    bfloat16 integers come in steps of 2), on the stages and the chunked path; and it is not the exact one."""
    import ml_dtypes

    bf16 = ml_dtypes.bfloat16
    config = AttentionConfig(**BASE, alibi=True, alibi_bias_dtype="bfloat16")
    tensors = weights.init(config, seed=7, dtype="float64")
    tensors["alibi.slopes"] = np.array([0.71, 0.3, 0.113, 0.0177])  # not bfloat16 numbers: they round too
    without = {n: t for n, t in tensors.items() if n != "alibi.slopes"}
    plain = config.replace(alibi=False, alibi_bias_dtype=None)
    x, rng = _inputs(8, T=3)
    past_key, past_value = rng.standard_normal((2, 2, 300, 4)), rng.standard_normal((2, 2, 300, 4))
    keys = np.arange(303, dtype=np.float64)  # the cache at 0..299, the new keys at 300..302
    slope = tensors["alibi.slopes"].astype(bf16).astype(np.float64)
    bias = (slope[:, None] * keys.astype(bf16).astype(np.float64)[None, :]).astype(bf16).astype(np.float64)
    bias = np.broadcast_to(bias[None, :, None, :], (1, 4, 3, 303))
    want = multi_head_attention(plain, without, x, x, x, past_key=past_key, past_value=past_value, bias=bias,
                                is_causal=True, causal_alignment="bottom_right")
    for chunk_size in (None, 64):
        got = multi_head_attention(config, tensors, x, x, x, past_key=past_key, past_value=past_value,
                                   is_causal=True, causal_alignment="bottom_right", chunk_size=chunk_size)
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    exact = multi_head_attention(config.replace(alibi_bias_dtype=None), tensors, x, x, x, past_key=past_key,
                                 past_value=past_value, is_causal=True, causal_alignment="bottom_right")
    assert np.abs(exact - want).max() > 1e-3, np.abs(exact - want).max()


def test_local_chunk_is_the_mask_it_makes():
    """local_chunk=C equals the plain layer given the mask floor(p_i / C) == floor(p_j / C), per-row positions."""
    config = AttentionConfig(**BASE, local_chunk=3)
    tensors = weights.init(config, seed=6, dtype="float64")
    x, _ = _inputs(7, T=8)
    positions = np.array([np.arange(8) + 2, np.arange(8) + 5])  # (B, T): the chunk borders fall differently
    mask = (positions[:, :, None] // 3 == positions[:, None, :] // 3)[:, None]
    want = multi_head_attention(config.replace(local_chunk=None), tensors, x, mask=mask, is_causal=True)
    for chunk_size in (None, 2):
        got = multi_head_attention(config, tensors, x, positions=positions, key_positions=positions,
                                   is_causal=True, chunk_size=chunk_size)
        np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-13)


def _per_head(config, tensors, x, positions):
    """The temperature, the clip and the gate written out head by head in float64 (no RoPE, no norm)."""
    t = tensors
    N, G = config.num_heads, config.group_size
    c = config.qkv_clip or np.inf
    out = np.zeros((x.shape[0], x.shape[1], config.out_dim)) + t["output.bias"]
    for n in range(N):
        kv = n // G
        q = np.clip(x @ t["query.kernel"][:, n] + t["query.bias"][n], -c, c)
        k = np.clip(x @ t["key.kernel"][:, kv] + t["key.bias"][kv], -c, c)
        v = np.clip(x @ t["value.kernel"][:, kv] + t["value.bias"][kv], -c, c)
        temp = config.query_temperature
        if temp is not None:
            q = q * (1 + temp.beta * np.log(1 + np.floor((positions + temp.offset) / temp.floor)))[None, :, None]
        logits = q @ k.transpose(0, 2, 1) * config.effective_scale
        w = np.exp(logits - logits.max(-1, keepdims=True))
        ctx = (w / w.sum(-1, keepdims=True)) @ v  # (B, T, V)
        if config.output_gate is not None:
            gate = x @ t["gate.kernel"][:, n] + (t["gate.bias"][n] if "gate.bias" in t else 0)
            ctx = ctx * (1 / (1 + np.exp(-gate)))[..., None] if gate.ndim == 2 else ctx / (1 + np.exp(-gate))
        out += ctx @ t["output.kernel"][n]
    return out


@pytest.mark.parametrize("fields", [
    dict(query_temperature={"beta": 0.5, "floor": 2.0, "offset": 1}),
    dict(query_temperature={"beta": -0.2, "floor": 3.0, "offset": 0}),
    dict(qkv_clip=0.3),
    dict(output_gate={"scope": "element", "bias": True}),
    dict(output_gate={"scope": "head", "bias": True}),
    dict(output_gate={"scope": "head"}, qkv_clip=0.5, query_temperature={"beta": 0.1, "floor": 1.0}),
], ids=["temperature_offset1", "temperature_negative_beta", "clip", "gate_element", "gate_head", "together"])
def test_temperature_clip_gate_per_head(fields):
    config = AttentionConfig(**BASE, **fields)
    tensors = weights.init(config, seed=8, dtype="float64")
    x, _ = _inputs(9, T=6)
    x = 3 * x  # projections beyond the clip
    positions = np.arange(6)
    want = _per_head(config, tensors, x, positions)
    for chunk_size in (None, 4):
        got = multi_head_attention(config, tensors, x, chunk_size=chunk_size)
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("fields, message", [
    (dict(alibi=1), "alibi must be true or false: got 1"),
    (dict(alibi_bias_dtype="bfloat16"), "alibi_bias_dtype needs alibi true (it says how ALiBi's bias is rounded): "
                                        "got alibi_bias_dtype='bfloat16' with alibi false"),
    (dict(alibi=True, alibi_bias_dtype="int8"), "alibi_bias_dtype must be one of bfloat16, float16, float32 or "
                                                "null: got 'int8'"),
    (dict(local_chunk=0), "local_chunk must be a positive integer: got 0"),
    (dict(local_chunk=2.0), "local_chunk must be a positive integer: got 2.0"),
    (dict(qkv_clip=0), "qkv_clip must be a finite number > 0: got 0"),
    (dict(qkv_clip=-1.5), "qkv_clip must be a finite number > 0: got -1.5"),
    (dict(query_temperature={"beta": 0.1}), "query_temperature is missing floor"),
    (dict(query_temperature={"beta": 0.1, "floor": 0}), "query_temperature.floor must be a finite number > 0: got 0"),
    (dict(query_temperature={"beta": 0.1, "floor": 2, "offset": 2}),
     "query_temperature.offset must be 0 or 1: got 2"),
    (dict(query_temperature={"beta": 0.1, "floor": 2, "scale": 1}),
     "query_temperature has unknown fields: 'scale'; accepted: beta, floor, offset, position"),
    (dict(query_temperature={"beta": 0.1, "floor": 2, "position": "index"}),
     "query_temperature.position must be one of positions, cache_index: got 'index'"),
    (dict(output_gate={"scope": "feature"}), "output_gate.scope must be one of element, head: got 'feature'"),
    (dict(output_gate={"scope": "head", "bias": "yes"}), "output_gate.bias must be true or false: got 'yes'"),
    (dict(output_gate="element"), "output_gate must be an object or null: got 'element'"),
])
def test_frontier_config_errors_name_the_field(fields, message):
    with pytest.raises(ValueError) as info:
        AttentionConfig(**BASE, **fields)
    assert str(info.value) == message


def test_wrong_slope_and_gate_shapes_are_named(tmp_path):
    config = AttentionConfig(**BASE, alibi=True, output_gate={"scope": "head", "bias": True})
    tensors = weights.init(config, seed=0)
    assert tensors["alibi.slopes"].shape == (4,) and tensors["gate.kernel"].shape == (8, 4)
    bad = dict(tensors, **{"alibi.slopes": np.ones(3, np.float32), "gate.bias": np.ones((4, 4), np.float32)})
    with pytest.raises(ValueError) as info:
        multi_head_attention(config, bad, np.ones((1, 2, 8), np.float32))
    assert "alibi.slopes has shape (3,), expected (4,)" in str(info.value)
    assert "gate.bias has shape (4, 4), expected (4,)" in str(info.value)


def test_a_file_without_frontier_fields_holds_none_of_them(tmp_path):
    """Defaults stay out of the file: a plain layer's config JSON is what it was before the fields existed."""
    config = AttentionConfig(num_heads=2, query_dim=4, head_dim=2, rope={})
    stored = json.loads(config.to_json())
    assert not {"alibi", "local_chunk", "query_temperature", "qkv_clip", "output_gate"} & set(stored)
    used = config.replace(alibi=True, output_gate={"scope": "element"})
    stored = json.loads(used.to_json())
    assert stored["alibi"] is True and stored["output_gate"] == {"scope": "element", "bias": False}
    assert AttentionConfig.from_json(used.to_json()) == used


LATENT = dict(num_heads=4, query_dim=8, head_dim=6, value_head_dim=5, use_value_bias=False, rope={})


@pytest.mark.parametrize("fields, message", [
    (dict(latent={"kv_rank": 4}), "latent is missing rope_dim"),
    (dict(latent={"kv_rank": 0, "rope_dim": 2}), "latent.kv_rank must be a positive integer: got 0"),
    (dict(latent={"kv_rank": 4, "rope_dim": 3}), "latent.rope_dim must be even (features rotate in pairs): got 3"),
    (dict(latent={"kv_rank": 4, "rope_dim": 6}), "latent.rope_dim must be less than head_dim (the key's other "
                                                  "features come from the latent): got rope_dim=6, head_dim=6"),
    (dict(latent={"kv_rank": 4, "rope_dim": 2}, rope=None),
     "latent needs rope (it turns the rope_dim features and the shared key): got rope null"),
    (dict(latent={"kv_rank": 4, "rope_dim": 2}, rope={"rotary_dim": 4}),
     "rope.rotary_dim must equal latent.rope_dim or be null: got rotary_dim=4, rope_dim=2"),
    (dict(latent={"kv_rank": 4, "rope_dim": 2}, use_value_bias=True),
     "use_value_bias must be false with latent (the values are the latent's up-projection, which has no bias): "
     "got true"),
    (dict(latent={"kv_rank": 4, "rope_dim": 2}, qk_norm={"type": "rms"}),
     "qk_norm must be null with latent (the latent has its own norms): got {'type': 'rms'}"),
    (dict(latent={"kv_rank": 4, "rope_dim": 2, "query_rank": 0}),
     "latent.query_rank must be a positive integer: got 0"),
])
def test_latent_config_errors_name_the_field(fields, message):
    with pytest.raises(ValueError) as info:
        AttentionConfig(**{**LATENT, **fields})
    assert str(info.value) == message


def test_latent_trace_and_cache_widths():
    """The expanded form traces LATENT_STAGES in order; the cache holds C + R values per token per layer, as
    past_key (B, 1, P, C) and past_value (B, 1, P, R), and a cache of the wrong width is one line."""
    from weights.call import LATENT_STAGES

    config = AttentionConfig(**LATENT, latent={"query_rank": 5, "kv_rank": 3, "rope_dim": 2})
    tensors = weights.init(config, seed=1, dtype="float64")
    x, rng = _inputs(2, T=2)
    past_key, past_value = rng.standard_normal((2, 1, 4, 3)), rng.standard_normal((2, 1, 4, 2))
    trace = []
    out, present_key, present_value = multi_head_attention(
        config, tensors, x, x, x, past_key=past_key, past_value=past_value, return_cache=True, trace=trace)
    optional = {"query.temperature", "softcap", "alibi", "gate.project", "gate"}
    assert [e.stage for e in trace] == [s for s in LATENT_STAGES if s not in optional]
    assert present_key.shape == (2, 1, 6, 3) and present_value.shape == (2, 1, 6, 2)
    assert present_key.shape[-1] + present_value.shape[-1] == 3 + 2  # C + R values per token
    np.testing.assert_array_equal(present_key[:, :, :4], past_key)
    # the absorbed form (the fused path) writes the same cache and the same output
    fused = multi_head_attention(config, tensors, x, x, x, past_key=past_key, past_value=past_value,
                                 return_cache=True)
    np.testing.assert_allclose(fused[0], out, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(fused[1], present_key, rtol=0, atol=0)
    with pytest.raises(ValueError) as info:
        multi_head_attention(config, tensors, x, x, x, past_key=rng.standard_normal((2, 1, 4, 6)),
                             past_value=past_value)
    assert str(info.value) == ("past_key must have shape (B, 1, P, C) = (2, 1, P, 3) (a latent layer caches its "
                               "normed latent in past_key and its rotated shared key in past_value): got (2, 1, 4, 6)")
