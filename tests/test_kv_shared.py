"""Issue 42's contract fields on the NumPy reference: a kv_shared layer (Gemma 3n's num_kv_shared_layers) against an
independent per-head formulation, its refusals, and the defaults of key_multiplier / value_scale / kv_shared kept
out of a file. The mirrors and the grid: conformance/suite/cases.py's _sharing_grid; the mutants:
tests/test_mutants.py."""

from __future__ import annotations

import json

import numpy as np
import pytest

import weights
from impl_numpy import multi_head_attention
from weights import AttentionConfig
from weights.rope import rope_tables

pytestmark = pytest.mark.reference

# query_dim 5 != key_dim 7: a shared layer reads no key input, so key_dim does not constrain its call (the sweep
# of unseen seeds found a query standing in for the key refused for key_dim: random_993002, in every path)
SHARED = dict(num_heads=4, num_kv_heads=2, query_dim=5, key_dim=7, head_dim=6, qk_norm={"type": "rms"},
              rope={"rotary_dim": 4}, scale=1.0, window_left=3, kv_shared=True)


def _independent(config, tensors, query, past_key, past_value):
    """Each head written out: q projected, normed, turned at positions P - T .. P - 1; every key of the cache as
    given; causal bottom-right and the window; softmax; the output projection."""
    B, T, _ = query.shape
    N, K, H, P = config.num_heads, config.num_kv_heads, config.head_dim, past_key.shape[2]
    q = (query @ tensors["query.kernel"].reshape(query.shape[-1], -1) + tensors["query.bias"].reshape(-1))
    q = q.reshape(B, T, N, H)
    q = q / np.sqrt((q * q).mean(-1, keepdims=True) + config.qk_norm.eps) * tensors["query.norm.scale"]
    inv_freq, factor = rope_tables(config.rope, None)
    angles = (P - T + np.arange(T))[:, None] * inv_freq[None, :]  # (T, R/2)
    cos, sin = np.cos(angles)[None, :, None] * factor, np.sin(angles)[None, :, None] * factor
    R = config.rope.rotary_dim
    x1, x2 = q[..., : R // 2], q[..., R // 2: R]
    q = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, q[..., R:]], axis=-1)
    out = np.zeros((B, T, N, config.value_head_dim))
    for n in range(N):
        k, v = past_key[:, n // (N // K)], past_value[:, n // (N // K)]  # (B, P, H)
        logits = np.einsum("bth,bph->btp", q[:, :, n], k) * config.effective_scale
        i, j = P - T + np.arange(T)[:, None], np.arange(P)[None, :]
        logits = np.where((j <= i) & (j >= i - config.window_left), logits, -np.inf)
        w = np.exp(logits - logits.max(-1, keepdims=True))
        out[:, :, n] = np.einsum("btp,bpv->btv", w / w.sum(-1, keepdims=True), v)
    return out.reshape(B, T, -1) @ tensors["output.kernel"].reshape(-1, config.out_dim) + tensors["output.bias"]


@pytest.mark.parametrize("T", [1, 3])
def test_shared_layer_matches_the_independent_formulation(T):
    config = AttentionConfig(**SHARED)
    tensors = weights.init(config, seed=4, dtype="float64")
    rng = np.random.default_rng(T)
    query, past_key, past_value = (rng.standard_normal(s) for s in ((2, T, 5), (2, 2, 8, 6), (2, 2, 8, 6)))
    expected = _independent(config, tensors, query, past_key, past_value)
    call = dict(past_key=past_key, past_value=past_value, is_causal=True, causal_alignment="bottom_right")
    buffers = [np.concatenate([x, np.zeros((2, 2, 3, 6))], axis=2) for x in (past_key, past_value)]
    before = [b.copy() for b in buffers]
    for name, kwargs in (("stages", dict(return_weights=True)), ("fused", {}), ("chunked", dict(chunk_size=2)),
                         ("in_place", dict(past_key=buffers[0], past_value=buffers[1], cache_length=8))):
        got = multi_head_attention(config, tensors, query, **{**call, **kwargs, "return_cache": True})
        out, present_key = got[0], got[-2]
        np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-12, err_msg=name)
        assert np.array_equal(present_key[:, :, :8], past_key), f"{name}: the cache must come back as given"
        assert present_key.shape[2] == (11 if name == "in_place" else 8), (name, present_key.shape)
    assert all(np.array_equal(b, a) for b, a in zip(buffers, before)), "an in-place shared call wrote its buffers"


@pytest.mark.parametrize("change, message", [
    (dict(key=np.ones((1, 2, 7))), r"^key and value must not be given with kv_shared \(the layer has no key"),
    (dict(past_key=None, past_value=None), r"^kv_shared needs past_key and past_value .*got none$"),
    (dict(past_key=np.ones((1, 2, 1, 6)), past_value=np.ones((1, 2, 1, 6))),
     r"^kv_shared needs a cache of at least the queries' T = 2 tokens .*got a cache of 1$"),
    (dict(key_positions=np.arange(2)), r"^key_positions is not taken with kv_shared .*got shape \(2,\)$"),
])
def test_shared_call_refusals(change, message):
    config = AttentionConfig(**SHARED)
    call = dict(past_key=np.ones((1, 2, 4, 6)), past_value=np.ones((1, 2, 4, 6)), is_causal=True,
                causal_alignment="bottom_right")
    with pytest.raises(ValueError, match=message) as err:
        multi_head_attention(config, weights.init(config, seed=0), np.ones((1, 2, 5)), **{**call, **change})
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("fields, message", [
    (dict(key_multiplier="2"), r"^key_multiplier must be a finite number: got '2'$"),
    (dict(value_scale=float("nan")), r"^value_scale must be a finite number: got nan$"),
    (dict(kv_shared=1), r"^kv_shared must be true or false: got 1$"),
    (dict(kv_shared=True, value_scale=0.5), r"^value_scale must be 1 with kv_shared .*got 0\.5$"),
    (dict(kv_shared=True, value_norm={"type": "rms"}), r"^value_norm must be null with kv_shared"),
    (dict(kv_shared=True, qk_norm={"type": "rms", "after_rope": True}), r"^qk_norm\.after_rope must be false with"),
    (dict(key_multiplier=2.0, use_value_bias=False, rope={}, latent={"kv_rank": 4, "rope_dim": 2, "query_rank": None}),
     r"^key_multiplier must be 1 with latent .*got 2\.0$"),
])
def test_config_refusals(fields, message):
    with pytest.raises(ValueError, match=message) as err:
        AttentionConfig(num_heads=2, query_dim=8, head_dim=4, **fields)
    assert "\n" not in str(err.value)


def test_defaults_stay_out_of_the_file_and_the_rest_round_trips():
    plain = AttentionConfig(num_heads=2, query_dim=8, head_dim=4)
    assert not {"key_multiplier", "value_scale", "kv_shared"} & set(json.loads(plain.to_json()))
    assert not plain.is_modern
    used = plain.replace(key_multiplier=0.37, value_scale=1.7, kv_shared=False)
    assert json.loads(used.to_json())["key_multiplier"] == 0.37 and used.is_modern
    assert AttentionConfig.from_json(used.to_json()) == used
    shared = AttentionConfig(**SHARED)
    assert sorted(shared.tensor_shapes()) == ["output.bias", "output.kernel", "query.bias", "query.kernel",
                                              "query.norm.scale"]
    assert AttentionConfig.from_json(shared.to_json()) == shared


# -- a sweep of unseen seeds with the fields drawn ------------------------------------------------------------

def sharing_variants(seed: int):
    """random_case(seed) with key_multiplier and value_scale drawn from [0.2, 3] (no latent layer), and turned
    kv_shared where its config allows: no key or value input, a cache of P + T (+ 0..2) entries, the case's
    positions, segments and selection dropped, bottom-right wherever a cache precedes the queries."""
    import dataclasses

    from conformance.suite.cases import random_case

    case = random_case(seed)
    rng = np.random.default_rng(seed + 42)
    c = case.config
    out = []
    if c.latent is None:
        knobs = c.replace(key_multiplier=float(rng.uniform(0.2, 3.0)), value_scale=float(rng.uniform(0.2, 3.0)))
        out.append(dataclasses.replace(case, name=f"{case.name}_knobs", config=knobs))
    if (c.latent is None and c.indexer is None and c.value_norm is None and c.qkv_clip is None
            and not (c.qk_norm is not None and c.qk_norm.after_rope) and case.selection is None):
        P = case.P + case.T + int(rng.integers(0, 3))
        aligned = P > case.T or case.is_causal or c.window_left >= 0 or c.window_right >= 0
        out.append(dataclasses.replace(
            case, name=f"{case.name}_shared", config=c.replace(kv_shared=True), S=0, P=P, self_attention=False,
            positions=None, mask=None if case.mask == "empty_rows" else case.mask, training=False,
            causal_alignment="bottom_right" if aligned else case.causal_alignment))
    return out


def _assert_sweep_passes(seeds):
    from conformance.suite.cases import DTYPE_NAMES
    from conformance.suite.compare import STATUS_PASS, run_case

    runs, bad, worst = 0, [], 0.0
    for seed in seeds:
        for case in sharing_variants(seed):
            for dtype in DTYPE_NAMES:
                for path in ("stages", "fused", "chunked", "in_place"):
                    r = run_case(case, "numpy", dtype=dtype, path=path)
                    if r is None or r.status == "unsupported":
                        continue
                    runs += 1
                    if r.status != STATUS_PASS:
                        bad.append(f"{case.name} {dtype} {path}: {r.status} {r.message or r.worst.describe()}")
                    elif r.margin == r.margin:
                        worst = max(worst, r.margin)
    assert not bad, f"{len(bad)} of {runs} runs failed:\n" + "\n".join(bad[:20])
    print(f"{len(seeds)} seeds, {runs} runs on numpy's four paths in four dtypes: 0 failures, worst margin {worst:.3g}")


def test_sweep_of_unseen_seeds_small():
    _assert_sweep_passes(range(993_000, 993_012))  # the first of the seeds the slow sweep takes (random_993002 among them)


@pytest.mark.slow
def test_sweep_of_unseen_seeds():
    """1000 seeds no other test uses (993000-993999): 16,390 runs, 0 failures, worst margin 0.862 (bfloat16,
    chunked) on a 2-core AMD EPYC VM, 2026-11-29, 70 s."""
    _assert_sweep_passes(range(993_000, 994_000))
