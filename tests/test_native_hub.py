"""keras-hub and torchtune as native backends (conformance/native/keras_hub.py, torchtune.py).

Their extras live in their own env (`tox -e hub`, marker hub): keras-hub needs the full tensorflow
package, which cannot sit beside the `tf` extra's tensorflow-cpu. Without them every test here skips
with the reason the registry gives ("not installed ... install the keras-hub extra").

Every expected value comes from the float64 reference (impl_numpy) through the suite's own judge
(conformance.suite.compare.run_case) or its tolerance policy (conformance.suite.tolerance.policy_for):
- the named case grid: what each API expresses runs and passes (or fails exactly as its
  known_difference says, by no more than float32 arithmetic explains), the rest is refused with a
  reason naming the backend;
- RoPE with explicit positions (gaps between them, so that they change the output);
- decoding with the cache: a prefill, then two one-token steps, each step fed the backend's own
  present cache, must reproduce the rows and the cache of one causal call over the whole sequence;
  and the gradients of a decode step, the past included;
- a query row with no allowed key (0 on both, the case's masked_row honoured or refused);
- the refusals' wording, and two by-design facts measured: CachedMultiHeadAttention.call ignores
  sliding_window; torchtune normalises q and k after RoPE.
"""

from __future__ import annotations

import numpy as np
import pytest

import weights
from conformance.suite import backends
from conformance.suite.cases import CASES
from conformance.suite.compare import STATUS_FAIL, STATUS_PASS, STATUS_UNSUPPORTED, run_case
from conformance.suite.tolerance import UNIT_ROUNDOFF, compare, policy_for
from impl_numpy import multi_head_attention
from impl_numpy.backward import multi_head_attention_vjp

pytestmark = pytest.mark.hub

HUB = ("keras-hub", "torchtune")

# What each API expresses: the cases that run (float32 and float64 alike).
SUPPORTED = {
    # keras MultiHeadAttention's limits (one use_bias, no GQA, default scale, no additive bias, one mask for all
    # heads, 0 for a fully masked row with scores); RoPE half-split (interleaved by the q/k permutation), partial,
    # linear and yarn; the cache (B, 2, S, N, H); no window/softcap/QK-norm/sinks/segments argument
    "keras-hub": {"self_basic", "cross_basic", "cross_dims", "value_head_dim", "out_dim", "no_biases", "query_len_1",
                  "key_len_1", "causal_square", "causal_top_left", "causal_bottom_right",
                  "causal_bottom_right_long_query", "padding_mask", "mask_bts", "mask_ts", "masked_rows_zero",
                  "no_weights", "rope_half", "rope_interleaved", "rope_partial", "rope_yarn", "rope_linear_per_batch",
                  "return_cache_no_past", "edge_yarn_ramp_ends"},  # yarn's truncate false included
    # forward(x, y): key and value from one input (the grid's cross cases give two); whole-head RoPE without
    # scaling; RMSNorm per head; no additive bias; the cache with GQA (the decode tests below)
    "torchtune": {"self_basic", "out_dim", "no_query_bias", "no_output_bias", "no_biases", "causal_square",
                  "rope_half", "return_cache_no_past", "qk_norm_rms_head"},
}
assert all(names <= set(CASES) for names in SUPPORTED.values())
FLOAT32_OVER_FLOAT64 = UNIT_ROUNDOFF["float32"] / UNIT_ROUNDOFF["float64"]


def _adapter(backend_id):
    try:
        return backends.load(backend_id)
    except backends.BackendUnavailable as err:
        pytest.skip(str(err))


def _describe(result) -> str:
    lines = [f"{result.backend} {result.dtype} {result.case}: {result.status}"
             + (f" (margin {result.margin:.3g})" if result.comparisons else "")]
    lines += [f"    {c.describe()}" for c in result.comparisons if not c.ok]
    return "\n".join(lines + ([f"    message: {result.message}"] if result.message else []))


def _problem(adapter, backend_id: str, name: str, dtype: str, result) -> str | None:
    if result.status not in (STATUS_PASS, STATUS_FAIL, STATUS_UNSUPPORTED):
        return f"crashed:\n{_describe(result)}"
    if name not in SUPPORTED[backend_id]:
        if result.status != STATUS_UNSUPPORTED or not result.message.startswith(f"{backend_id}: "):
            return f"expected unsupported with a reason naming the backend:\n{_describe(result)}"
        return None
    expected = adapter.known_difference(CASES[name], dtype)
    if expected is None:
        return None if result.status == STATUS_PASS else f"expected to pass:\n{_describe(result)}"
    if result.status != STATUS_FAIL:
        return f"expected to fail ({expected}):\n{_describe(result)}"
    assert expected.startswith("float64: "), expected  # the grid's known differences are all precision findings
    too_far = [c for c in result.comparisons if not c.margin / FLOAT32_OVER_FLOAT64 <= 1.0]
    return (f"fails by more than float32 arithmetic explains ({expected}):\n"
            + "\n".join(f"    {c.describe()}" for c in too_far)) if too_far else None


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("backend_id", HUB)
def test_case_grid(backend_id, dtype):
    """Every named case: supported ones pass (or fail as documented), the rest are refused with a reason."""
    adapter = _adapter(backend_id)
    problems = []
    for name, case in CASES.items():
        problem = _problem(adapter, backend_id, name, dtype, run_case(case, backend_id, dtype=dtype, adapter=adapter))
        if problem:
            problems.append(f"[{name}] {problem}")
    assert not problems, f"{len(problems)} case(s) break the contract:\n" + "\n".join(problems)


@pytest.mark.parametrize("backend_id", HUB)
def test_low_precision(backend_id):
    """bfloat16 and float16 through the same judge (its 16-bit rule: 3x the same-dtype reference's error)."""
    adapter = _adapter(backend_id)
    problems = [f"[{name} {dtype}] {p}" for dtype in ("float16", "bfloat16") for name in ("self_basic", "rope_half")
                if (p := _problem(adapter, backend_id, name, dtype,
                                  run_case(CASES[name], backend_id, dtype=dtype, adapter=adapter)))]
    assert not problems, "\n".join(problems)


# -- helpers for calls outside the grid ------------------------------------------------------

def _close(name, got, expected, config, *, quantity="output", T, S, max_position=None, scale_floor=0.0):
    """The policy's comparison for float32 results against the float64 reference."""
    tol = policy_for(config, dtype="float32", quantity=quantity, B=np.shape(expected)[0], T=T, S=S,
                     reference=expected, max_position=max_position, scale_floor=scale_floor)
    return compare(name, got, expected, tol)


def _config(backend_id, *, interleaved=False, **kw):
    heads = dict(num_heads=4, num_kv_heads=2) if backend_id == "torchtune" else dict(num_heads=2)
    return weights.AttentionConfig(query_dim=8, head_dim=4, rope={"interleaved": interleaved}, **{**heads, **kw})


def _f32(x):
    return np.asarray(x, dtype=np.float32)


# -- RoPE with positions ----------------------------------------------------------------------

@pytest.mark.parametrize("interleaved", [False, True], ids=["half-split", "interleaved"])
@pytest.mark.parametrize("backend_id", HUB)
def test_rope_positions(backend_id, interleaved):
    """Explicit per-batch positions with gaps (so that they change the output, RoPE being relative): the
    backend matches the reference with them, and is far from the reference with the default 0..T-1."""
    adapter = _adapter(backend_id)
    config = _config(backend_id, interleaved=interleaved)
    tensors = {n: _f32(t) for n, t in weights.init(config, seed=21, dtype="float64").items()}
    x = _f32(np.random.default_rng(22).standard_normal((2, 5, 8)))
    positions = np.array([[0, 3, 4, 10, 11], [7, 8, 30, 31, 90]], dtype=np.int64)  # (B, T)
    inputs = {"query": x, "key": x, "value": x, "positions": positions, "key_positions": positions.copy()}
    got = adapter.forward(config, tensors, inputs, {"dtype": "float32", "is_causal": True, "return_weights": True})
    t64, x64 = {n: t.astype(np.float64) for n, t in tensors.items()}, x.astype(np.float64)
    out, w = multi_head_attention(config, t64, x64, x64, x64, is_causal=True, positions=positions,
                                  key_positions=positions, return_weights=True)
    default = multi_head_attention(config, t64, x64, x64, x64, is_causal=True)
    checks = [_close("output", got["output"], out, config, T=5, S=5, max_position=90),
              _close("weights", got["weights"], w, config, quantity="weights", T=5, S=5, max_position=90)]
    assert all(c.ok for c in checks), "\n".join(c.describe() for c in checks)
    moved = float(np.abs(got["output"] - default).max())
    assert moved > 1e-2, f"{backend_id}: positions had no effect (max change {moved:.3g} from the default positions)"


# -- decoding with the cache ------------------------------------------------------------------

DECODE = [("keras-hub", False), ("keras-hub", True), ("torchtune", False), ("torchtune", True)]


@pytest.mark.parametrize("backend_id,interleaved", DECODE,
                         ids=[f"{b}-{'interleaved' if i else 'half-split'}" for b, i in DECODE])
def test_decode_steps_reproduce_one_causal_call(backend_id, interleaved):
    """Prefill 4 tokens (return_cache), then two one-token steps, each fed the backend's own present cache
    (causal bottom_right): every step's output and weights are the reference's rows for that token in
    one causal call over all 6 tokens, and the final cache is the reference's whole present cache."""
    adapter = _adapter(backend_id)
    config = _config(backend_id, interleaved=interleaved)
    tensors = {n: _f32(t) for n, t in weights.init(config, seed=31, dtype="float64").items()}
    x = _f32(np.random.default_rng(32).standard_normal((2, 6, 8)))
    t64, x64 = {n: t.astype(np.float64) for n, t in tensors.items()}, x.astype(np.float64)
    out, w, present_key, present_value = multi_head_attention(config, t64, x64, x64, x64, is_causal=True,
                                                              return_weights=True, return_cache=True)
    prefill = x[:, :4]
    got = adapter.forward(config, tensors, {"query": prefill, "key": prefill, "value": prefill},
                          {"dtype": "float32", "is_causal": True, "return_cache": True, "return_weights": True})
    checks = [_close("prefill output", got["output"], out[:, :4], config, T=4, S=4),
              _close("prefill present_key", got["present_key"], present_key[:, :, :4], config, T=4, S=4)]
    for t in (4, 5):
        step = x[:, t:t + 1]
        got = adapter.forward(config, tensors, {"query": step, "key": step, "value": step,
                                                "past_key": got["present_key"], "past_value": got["present_value"]},
                              {"dtype": "float32", "is_causal": True, "causal_alignment": "bottom_right",
                               "return_cache": True, "return_weights": True})
        checks += [_close(f"step {t} output", got["output"], out[:, t:t + 1], config, T=1, S=t + 1),
                   _close(f"step {t} weights", got["weights"], w[:, :, t:t + 1, :t + 1], config, quantity="weights",
                          T=1, S=t + 1)]
    checks += [_close("present_key", got["present_key"], present_key, config, T=1, S=6),
               _close("present_value", got["present_value"], present_value, config, T=1, S=6)]
    assert all(c.ok for c in checks), "\n".join(c.describe() for c in checks)


def _decode_step_call(backend_id, interleaved):
    config = _config(backend_id, interleaved=interleaved)
    rng = np.random.default_rng(41)
    tensors = {n: _f32(t) for n, t in weights.init(config, seed=41, dtype="float64").items()}
    x = _f32(rng.standard_normal((2, 1, 8)))
    past = {"past_key": _f32(rng.standard_normal((2, config.num_kv_heads, 5, 4))),
            "past_value": _f32(rng.standard_normal((2, config.num_kv_heads, 5, 4)))}
    d_out = _f32(rng.standard_normal((2, 1, 8)))
    options = {"dtype": "float32", "is_causal": True, "causal_alignment": "bottom_right"}
    return config, tensors, x, past, d_out, options


NO_CACHE_GRADIENT = {"keras-hub": "keras-hub: no gradient through the cache update .* XlaDynamicUpdateSlice",
                     "torchtune": "torchtune: no gradient through KVCache.update .* modified by an inplace operation"}


@pytest.mark.parametrize("backend_id", HUB)
def test_gradients_through_the_cache_are_refused_in_the_frameworks_words(backend_id):
    """Neither cache is differentiable: keras-hub splices with keras.ops.slice_update (XlaDynamicUpdateSlice on
    TensorFlow: no registered gradient), torchtune's KVCache advances cache_pos in place after indexing with
    it. Both refuse such a vjp with the framework's words; the same call without a past has gradients, which
    must match the reference (so the refusal is about the cache alone)."""
    adapter = _adapter(backend_id)
    config, tensors, x, past, d_out, options = _decode_step_call(backend_id, False)
    with pytest.raises(NotImplementedError, match=NO_CACHE_GRADIENT[backend_id]):
        adapter.vjp(config, tensors, {"query": x, "key": x, "value": x, **past}, options, d_out)
    got = adapter.vjp(config, tensors, {"query": x, "key": x, "value": x}, options, d_out)["grads"]
    x64 = x.astype(np.float64)
    _, expected, magnitudes = multi_head_attention_vjp(
        config, {n: t.astype(np.float64) for n, t in tensors.items()}, x64, x64, x64, d_output=d_out.astype(np.float64),
        is_causal=True, causal_alignment="bottom_right", gradient_magnitudes=True)
    assert set(got) == set(expected), f"gradients: got {sorted(got)}, expected {sorted(expected)}"
    checks = [_close(f"grad {n}", got[n], e, config, quantity="grad", T=1, S=1,
                     scale_floor=float(np.abs(magnitudes[n]).max())) for n, e in expected.items()]
    assert all(c.ok for c in checks), "\n".join(c.describe() for c in checks if not c.ok)


# -- refusals and by-design facts ------------------------------------------------------------

REFUSALS = {
    ("keras-hub", "gqa"): "no grouped-query",
    ("keras-hub", "decode_cache"): "no grouped-query",
    ("keras-hub", "rope_llama3"): "RotaryEmbedding's rope_type is linear, dynamic or yarn",
    ("keras-hub", "window_left_causal"): "sliding_window is applied only by MultiHeadAttention.call",
    ("keras-hub", "bias"): "no additive attention bias",
    ("keras-hub", "masked_rows_uniform"): "a query row with no allowed key gives 0",
    ("torchtune", "cross_basic"): "projects the key and the value from the same input y",
    ("torchtune", "rope_partial"): "RotaryPositionalEmbeddings turns the whole head",
    ("torchtune", "rope_linear_per_batch"): "no scaling",
    ("torchtune", "segments_packed"): "BlockMask reaches flex_attention only on CUDA",
    ("torchtune", "custom_scale"): "always scales by 1/sqrt(head_dim)",
    ("torchtune", "bias"): "no additive attention bias",
    # the frontier fields (spec-frontier.md): what each library has of them, read from its source
    ("keras-hub", "alibi_causal"): "AlibiBias adds its own slopes",
    ("keras-hub", "rope_longrope_short"): "model-internal, not in keras_hub.layers",
    ("keras-hub", "latent_mla"): "no latent attention layer",
    ("torchtune", "alibi_causal"): "torchtune 0.6.1 has no ALiBi",
    ("torchtune", "local_chunk_per_batch"): "no chunked attention (no Llama 4",
    ("torchtune", "output_gate_head"): "MultiHeadAttention has no gate argument",
}


@pytest.mark.parametrize("backend_id", HUB)
def test_refusals_say_why(backend_id):
    """Each refusal names the backend and the API's reason."""
    adapter = _adapter(backend_id)
    bad = []
    for (b, name), words in REFUSALS.items():
        if b != backend_id:
            continue
        result = run_case(CASES[name], backend_id, dtype="float32", adapter=adapter)
        if result.status != STATUS_UNSUPPORTED or not result.message.startswith(f"{b}: ") or words not in result.message:
            bad.append(f"{name}: expected unsupported with {words!r}:\n{_describe(result)}")
    assert not bad, "\n".join(bad)


def test_torchtune_refuses_query_and_key_positions_that_differ():
    adapter = _adapter("torchtune")
    config = _config("torchtune")
    x = _f32(np.random.default_rng(5).standard_normal((1, 3, 8)))
    inputs = {"query": x, "key": x, "value": x, "positions": np.array([0, 1, 2]), "key_positions": np.array([0, 1, 3])}
    with pytest.raises(NotImplementedError, match="torchtune: input_pos is one tensor for the queries and the new keys"):
        adapter.forward(config, weights.init(config, seed=1, dtype="float32"), inputs, {"dtype": "float32"})


@pytest.mark.parametrize("backend_id", HUB)
def test_a_query_row_with_no_key(backend_id):
    """Both give 0 for a query row with no allowed key (measured by their probes; torchtune's grid cases with
    one are cross cases it refuses): masked_row="zero" runs and matches the reference, "nan" is refused
    with what the API gives."""
    adapter = _adapter(backend_id)
    x = _f32(np.random.default_rng(13).standard_normal((2, 4, 8)))
    mask = np.ones((2, 1, 4, 4), dtype=bool)
    mask[1, 0, 2] = False  # batch 1, query 2: no key
    inputs = {"query": x, "key": x, "value": x, "mask": mask}
    options = {"dtype": "float32", "return_weights": True}
    config = weights.AttentionConfig(num_heads=2, query_dim=8, head_dim=4, masked_row="zero")
    tensors = {n: _f32(t) for n, t in weights.init(config, seed=14, dtype="float64").items()}
    got = adapter.forward(config, tensors, inputs, options)
    x64 = x.astype(np.float64)
    out, w = multi_head_attention(config, {n: t.astype(np.float64) for n, t in tensors.items()}, x64, x64, x64,
                                  mask=mask, return_weights=True)
    checks = [_close("output", got["output"], out, config, T=4, S=4),
              _close("weights", got["weights"], w, config, quantity="weights", T=4, S=4)]
    assert all(c.ok for c in checks) and not got["weights"][1, :, 2].any(), "\n".join(c.describe() for c in checks)
    with pytest.raises(NotImplementedError, match=f"{backend_id}: a query row with no allowed key gives 0"):
        adapter.forward(config.replace(masked_row="nan"), tensors, inputs, options)


def test_keras_hub_cached_attention_ignores_sliding_window():
    """Why keras-hub refuses windows: CachedMultiHeadAttention(sliding_window=2) computes what it computes
    without the argument, while keras.layers.MultiHeadAttention(sliding_window=2) on the same weights
    does not (so the comparison can tell)."""
    _adapter("keras-hub")
    from keras_hub.layers import CachedMultiHeadAttention

    from impl_tf._keras import keras

    x = _f32(np.random.default_rng(7).standard_normal((1, 6, 8)))

    def run(cls, **kw):
        layer = cls(num_heads=2, key_dim=4, **kw)
        layer.build((1, 6, 8), (1, 6, 8))
        for v, seed in zip(layer.weights, range(100)):
            v.assign(_f32(np.random.default_rng(seed).standard_normal(v.shape)))
        return np.asarray(keras.ops.convert_to_numpy(layer(x, x)))

    plain, cached = run(CachedMultiHeadAttention), run(CachedMultiHeadAttention, sliding_window=2)
    windowed = run(keras.layers.MultiHeadAttention, sliding_window=2)
    assert np.abs(cached - plain).max() == 0.0 < 1e-2 < np.abs(windowed - plain).max(), (
        f"CachedMultiHeadAttention with sliding_window=2 moved the output by {np.abs(cached - plain).max():.3g}; "
        f"MultiHeadAttention's window by {np.abs(windowed - plain).max():.3g}")


def test_torchtune_normalises_after_rope():
    """torchtune applies q_norm/k_norm after pos_embeddings, the contract before RoPE. An RMS norm with a
    uniform scale commutes with RoPE over the whole head (a rotation keeps the RMS): then the backend
    matches the reference; with per-feature scales it cannot, and known_difference says why."""
    adapter = _adapter("torchtune")
    config = _config("torchtune", qk_norm={"type": "rms"})
    x = _f32(np.random.default_rng(9).standard_normal((2, 5, 8)))
    inputs = {"query": x, "key": x, "value": x}
    x64 = x.astype(np.float64)
    errors = {}
    for kind in ("uniform", "per_feature"):
        tensors = {n: _f32(t) for n, t in weights.init(config, seed=10, dtype="float64").items()}
        for name in ("query.norm.scale", "key.norm.scale"):
            tensors[name] = np.full(4, 1.5, np.float32) if kind == "uniform" else _f32([0.5, 2.0, 1.0, 3.0])
        got = adapter.forward(config, tensors, inputs, {"dtype": "float32", "is_causal": True})["output"]
        expected = multi_head_attention(config, {n: t.astype(np.float64) for n, t in tensors.items()}, x64, x64, x64,
                                        is_causal=True)
        errors[kind] = _close(kind, got, expected, config, T=5, S=5)
    assert errors["uniform"].ok and not errors["per_feature"].ok, "\n".join(c.describe() for c in errors.values())
    from conformance.suite.cases import Case

    why = adapter.known_difference(Case("rope_and_norm", config), "float32")
    assert why is not None and "after pos_embeddings" in why, why
