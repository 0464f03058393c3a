"""The frameworks' native attention layers as conformance backends (conformance/native).

Every native backend runs the named case grid through conformance.suite.compare.run_case
(the suite's own judge) in float32 and float64, and a few cases in float16 and
bfloat16. For each backend the test states what its API can express
(SUPPORTED, the case names that run); every other case must be reported
"unsupported" with a reason that names the backend. A supported case must pass,
unless the backend's `known_difference(case, dtype)` documents why it fails
(a measured difference from the reference), and then it must fail, for that
reason only: precision findings fail by less than float32's unit round-off
would allow; the torch NaN finding fails in the gradients only.

Time: the JAX backends compile one XLA program per case (about 1.5 s on a
small CPU) and torch-flex runs flex_attention eagerly (about 1 s a case), so
the default run gives them the refusals plus FAST cases; the whole grid is
`pytest -m slow`.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import weights
from conformance.suite import backends
from conformance.suite.cases import CASES, MHA_CASES
from conformance.suite.compare import STATUS_FAIL, STATUS_PASS, STATUS_UNSUPPORTED, run_case
from conformance.suite.tolerance import UNIT_ROUNDOFF
from impl_numpy import multi_head_attention

FRAMEWORK_MARKS = {
    "torch-native-mha": pytest.mark.torch, "torch-sdpa": pytest.mark.torch, "torch-flex": pytest.mark.torch,
    "keras-native-mha": pytest.mark.tf,
    "flax-linen-mha": pytest.mark.jax, "flax-nnx-mha": pytest.mark.jax, "jax-dpa": pytest.mark.jax,
    "onnxruntime": pytest.mark.onnx,
}
# keras-hub and torchtune: tests/test_native_hub.py (marker hub, `tox -e hub`: their extras are not in `all`)
HUB_BACKENDS = ("keras-hub", "torchtune")
NATIVE = tuple(b for b in backends.NATIVE if b not in HUB_BACKENDS)
assert set(FRAMEWORK_MARKS) == set(NATIVE), "every native backend needs its framework mark"

JAX_BACKENDS = ("flax-linen-mha", "flax-nnx-mha", "jax-dpa")

_BASIC = {"self_basic", "cross_basic", "no_biases", "query_len_1", "key_len_1", "causal_square", "causal_top_left",
          "causal_bottom_right", "padding_mask", "mask_bts", "mask_ts", "no_weights"}

# The modern cases (rope, cache, windows, softcap, QK-norm, sinks, segments): each backend runs those its API
# expresses (SUPPORTED); the rest are refused with the reason (conformance.native.refuse_modern).
MODERN = {name for name, case in CASES.items()
          if case.config.is_modern or case.P or case.positions or case.return_cache or case.selection}
PLAIN = set(CASES) - MODERN

# What each API can express: the cases that run (float32 and float64 alike).
SUPPORTED: dict[str, set[str]] = {
    # one bias flag, N*H == D == O, V == H, default scale, no GQA; NaN for a fully masked row (need_weights=True)
    "torch-native-mha": _BASIC | {"cross_dims", "mask_bnts", "bias", "bias_neg_inf", "masked_rows_nan"},
    # everything but an explicit dropout mask, and fully masked rows give 0
    "torch-sdpa": PLAIN - {"masked_rows_uniform", "masked_rows_nan", "dropout_train"},
    # every modern feature (score_mod, block_mask, lse for sinks; our rope/norm/cache around it); no dropout,
    # fully masked rows give 0 (forward only on CPU: torch 2.13 has no flex backward there)
    # (not DeepSeek V4's layer, config.compressed: its own call, MHA_CASES leaves it out)
    "torch-flex": set(MHA_CASES) - {"masked_rows_uniform", "masked_rows_nan", "dropout_train", "softcap_masked_rows"},
    # one bias flag, default scale, no GQA, no bias, one mask for all heads; 0 for a fully masked row with scores
    # and sliding_window (symmetric, top-left: |i - j| < W) for a causal left window
    "keras-native-mha": _BASIC | {"cross_dims", "value_head_dim", "out_dim", "causal_bottom_right_long_query",
                                  "masked_rows_zero", "window_left_causal"},
    # one bias flag, default scale, no GQA, V == H, no bias; uniform for a fully masked row
    "flax-linen-mha": _BASIC | {"cross_dims", "out_dim", "mask_bnts", "masked_rows_uniform"},
    # as linen but GQA, and key_dim == value_dim
    "flax-nnx-mha": _BASIC | {"out_dim", "gqa", "mqa", "mask_bnts", "masked_rows_uniform"},
    # everything but an explicit dropout mask; uniform for a fully masked row
    # and windows (local_window_size, top-left: a bottom_right window over S > T keys is refused)
    "jax-dpa": PLAIN - {"causal_bottom_right_long_query", "masked_rows_zero", "masked_rows_nan", "dropout_train"}
    | {"window_left_causal", "window_right", "alibi_causal", "long_alibi_256"},  # ALiBi through its bias argument
    # everything plain (the Attention node, or plain ops where it cannot express a case); softcap, cache,
    # RotaryEmbedding, RMS/LayerNormalization, segments in attn_mask; onnxruntime 1.30 refuses the window
    # attributes (opset 25); no sinks input
    "onnxruntime": PLAIN | {"rope_half", "rope_interleaved", "rope_partial", "rope_llama3", "rope_yarn",
                            "rope_linear_per_batch", "decode_cache", "return_cache_no_past", "softcap",
                            "softcap_masked_rows", "qk_norm_rms_head", "qk_norm_layer_all", "segments_packed",
                            "segments_packed_cache",
                            # ALiBi in the float attn_mask, local chunks in the bool one, LongRoPE's tables
                            "alibi_causal", "alibi_chunk_decode", "long_alibi_256", "local_chunk_per_batch",
                            "rope_longrope_short",
                            "rope_longrope_long",
                            # the edge group's: LongRoPE on each side of its threshold, the ramps' ends, ALiBi at
                            # explicit positions over a cache
                            "edge_longrope_at_original", "edge_longrope_past_original", "edge_llama3_ramp_ends",
                            "edge_yarn_ramp_ends", "edge_alibi_decode_positions"},
}
assert all(names <= set(CASES) for names in SUPPORTED.values())

# Supported cases a backend refuses in float64 only: ONNX defines RotaryEmbedding for float, float16 and
# bfloat16, so onnxruntime refuses a float64 graph with it (in its own words).
NOT_IN_FLOAT64: dict[str, set[str]] = {
    "onnxruntime": {name for name in SUPPORTED["onnxruntime"] if CASES[name].config.rope is not None},
}


def _supported(backend_id: str, dtype: str) -> set[str]:
    return SUPPORTED[backend_id] - (NOT_IN_FLOAT64.get(backend_id, set()) if dtype == "float64" else set())

# The slow backends' supported cases in the default run (the rest: -m slow): the JAX backends compile one
# program per case; torch-flex runs flex_attention eagerly (about 1 s a case on the 2-core VM).
FAST: dict[str, set[str]] = {
    "torch-flex": {"self_basic", "bias_neg_inf", "gqa", "decode_cache", "window_both_bottom_right", "softcap",
                   "qk_norm_layer_all", "sinks_masked_rows", "segments_packed", "modern_everything",
                   "local_chunk_per_batch", "frontier_everything", "topk_per_kv_head_window"},
    "flax-linen-mha": {"mask_bnts", "causal_bottom_right", "masked_rows_uniform"},
    "flax-nnx-mha": {"gqa", "causal_top_left", "masked_rows_uniform"},
    "jax-dpa": {"value_head_dim", "bias_neg_inf", "mask_and_bias_causal", "masked_rows_uniform", "window_right"},
}

LOW_PRECISION_CASES = ("self_basic", "mask_bts", "causal_bottom_right")
# float32's unit round-off over float64's: a float64 margin below this is an error float32 arithmetic explains
FLOAT32_OVER_FLOAT64 = UNIT_ROUNDOFF["float32"] / UNIT_ROUNDOFF["float64"]


def _param(backend_id, *rest):
    mark = FRAMEWORK_MARKS[backend_id]
    return pytest.param(backend_id, *rest, marks=[mark] if mark else [], id="-".join([backend_id, *rest]))


def _adapter(backend_id):
    try:
        return backends.load(backend_id)
    except backends.BackendUnavailable as err:
        pytest.skip(str(err))


def _describe(result) -> str:
    worst = result.worst
    lines = [f"{result.backend} {result.dtype} {result.case}: {result.status}"
             + (f" (margin {result.margin:.3g})" if result.comparisons else "")]
    lines += [f"    {c.describe()}" for c in result.comparisons if not c.ok] or (
        [f"    worst: {worst.describe()}"] if worst is not None and result.status == STATUS_FAIL else [])
    if result.message:
        lines.append(f"    message: {result.message}")
    return "\n".join(lines)


def _problem(adapter, backend_id: str, case_name: str, dtype: str, result) -> str | None:
    """Why a result breaks the backend's contract, or None."""
    case = CASES[case_name]
    if result.status not in (STATUS_PASS, STATUS_FAIL, STATUS_UNSUPPORTED):
        return f"crashed instead of passing, failing or refusing:\n{_describe(result)}"
    if case_name not in _supported(backend_id, dtype):
        if result.status != STATUS_UNSUPPORTED:
            return f"expected unsupported (the API cannot express it):\n{_describe(result)}"
        if not result.message.startswith(f"{backend_id}: ") or len(result.message) < len(backend_id) + 12:
            return f"an unsupported case needs a reason naming the backend:\n{_describe(result)}"
        return None
    if result.status == STATUS_UNSUPPORTED:
        return f"expected to run (the API can express it):\n{_describe(result)}"
    expected = adapter.known_difference(case, dtype)
    if expected is None:
        return None if result.status == STATUS_PASS else f"expected to pass:\n{_describe(result)}"
    if result.status != STATUS_FAIL:
        return f"expected to fail ({expected}):\n{_describe(result)}"
    if expected.startswith("float64"):  # a precision finding: float32-size errors, no more
        too_far = [c for c in result.comparisons if not c.margin * (1 / FLOAT32_OVER_FLOAT64) <= 1.0]
        if too_far:
            return (f"fails by more than float32 arithmetic explains ({expected}):\n"
                    + "\n".join(f"    {c.describe()}" for c in too_far))
    else:  # a gradient finding: the forward pass conforms
        bad_forward = [c for c in result.comparisons if not c.ok and not c.name.startswith("grad ")]
        if bad_forward:
            return f"the forward pass fails too ({expected}):\n" + "\n".join(f"    {c.describe()}" for c in bad_forward)
    return None


def grid_problems(backend_id: str, dtype: str, names) -> list[str]:
    """Run `names` (at least one) on the backend; one line per case that breaks the contract."""
    assert names, f"{backend_id} {dtype}: no cases selected"
    adapter = _adapter(backend_id)
    problems = []
    for name in names:
        result = run_case(CASES[name], backend_id, dtype=dtype, adapter=adapter)
        problem = _problem(adapter, backend_id, name, dtype, result)
        if problem:
            problems.append(f"[{name}] {problem}")
    return problems


def _default_names(backend_id: str) -> list[str]:
    if backend_id not in FAST:
        return list(CASES)
    return [n for n in CASES if n not in SUPPORTED[backend_id] or n in FAST[backend_id]]


# -- the grid --------------------------------------------------------------------------

@pytest.mark.parametrize("backend_id,dtype", [_param(b, d) for b in NATIVE for d in ("float32", "float64")])
def test_case_grid(backend_id, dtype):
    """Every case: supported ones pass (or fail exactly as documented), the rest are refused with a reason."""
    problems = grid_problems(backend_id, dtype, _default_names(backend_id))
    assert not problems, f"{len(problems)} case(s) break the contract:\n" + "\n".join(problems)


@pytest.mark.slow
@pytest.mark.parametrize("backend_id,dtype", [_param(b, d) for b in FAST for d in ("float32", "float64")])
def test_case_grid_slow_rest(backend_id, dtype):
    """The slow backends' supported cases left out of the default run."""
    problems = grid_problems(backend_id, dtype, [n for n in CASES if n not in _default_names(backend_id)])
    assert not problems, f"{len(problems)} case(s) break the contract:\n" + "\n".join(problems)


@pytest.mark.parametrize("backend_id,dtype", [_param(b, d) for b in NATIVE
                                              if b not in JAX_BACKENDS for d in ("float16", "bfloat16")]
                         + [_param(b, "bfloat16") for b in JAX_BACKENDS])
def test_low_precision(backend_id, dtype):
    """A few cases in 16-bit, judged by the suite's 16-bit rule (3x the same-dtype reference's error).
    onnxruntime has no bfloat16 CPU kernels: refused with onnxruntime's words."""
    adapter = _adapter(backend_id)
    problems = []
    for name in LOW_PRECISION_CASES[:1] if backend_id in JAX_BACKENDS else LOW_PRECISION_CASES:
        result = run_case(CASES[name], backend_id, dtype=dtype, adapter=adapter)
        if backend_id == "onnxruntime" and dtype == "bfloat16":
            if result.status != STATUS_UNSUPPORTED or "NOT_IMPLEMENTED" not in result.message:
                problems.append(f"[{name}] expected unsupported (no bfloat16 CPU kernels):\n{_describe(result)}")
            continue
        problem = _problem(adapter, backend_id, name, dtype, result)
        if problem:
            problems.append(f"[{name}] {problem}")
    assert not problems, f"{backend_id} {dtype}:\n" + "\n".join(problems)


@pytest.mark.slow
@pytest.mark.parametrize("backend_id", [_param(b) for b in ("flax-nnx-mha", "jax-dpa")])
def test_float16_jax_dot_product_attention(backend_id):
    """jax.nn.dot_product_attention in float16 does not compile under jit on CPU (precision preset
    F16_F16_F32); the adapter then runs eagerly, where jax's own fallback works."""
    problems = grid_problems(backend_id, "float16", ["self_basic", "padding_mask"])
    assert not problems, f"{len(problems)} case(s) break the contract:\n" + "\n".join(problems)


# -- mask polarity ---------------------------------------------------------------------

POLARITY_SHAPES = {"per_query": (2, 4, 6), "padding": (2, 1, 1, 6)}


def _polarity_inputs(kind: str):
    config = weights.AttentionConfig(num_heads=2, query_dim=8, head_dim=4)
    tensors = weights.init(config, seed=11, dtype="float32")
    rng = np.random.default_rng(12)
    B, T, S = 2, 4, 6
    q, k, v = (rng.standard_normal(shape).astype(np.float32) for shape in ((B, T, 8), (B, S, 8), (B, S, 8)))
    if kind == "per_query":
        b, t, s = np.ogrid[:B, :T, :S]
        mask = (b + 2 * t + s) % 3 != 0  # (B, T, S): every row holds both values
    else:
        b, s = np.ogrid[:B, :S]
        mask = ((b + s) % 3 != 0)[:, None, None, :]  # (B, 1, 1, S): a padding-style mask, both values per batch
    assert mask.any(-1).all() and (~mask).any(-1).all(), "neither the mask nor its complement may empty a row"
    return config, tensors, {"query": q, "key": k, "value": v, "mask": mask}


@pytest.mark.parametrize("backend_id,kind", [_param(b, k) for b in NATIVE for k in POLARITY_SHAPES])
def test_mask_polarity(backend_id, kind):
    """Our bool mask means True = attend; each backend translates it to its API's polarity (torch
    nn.MultiheadAttention: True = masked, via attn_mask or key_padding_mask). The output must match the
    reference with the mask and be far from the reference with the mask inverted."""
    adapter = _adapter(backend_id)
    config, tensors, inputs = _polarity_inputs(kind)
    out = adapter.forward(config, tensors, inputs, {"dtype": "float32"})["output"]
    t64 = {n: t.astype(np.float64) for n, t in tensors.items()}
    qkv64 = [inputs[n].astype(np.float64) for n in ("query", "key", "value")]
    mask4 = inputs["mask"] if inputs["mask"].ndim == 4 else inputs["mask"][:, None]
    err = float(np.abs(out - multi_head_attention(config, t64, *qkv64, mask=mask4)).max())
    err_inverted = float(np.abs(out - multi_head_attention(config, t64, *qkv64, mask=~mask4)).max())
    assert err < 1e-4 < 1e-2 < err_inverted, (
        f"{backend_id} mask {POLARITY_SHAPES[kind]}: max error {err:.3g} against the reference with the mask "
        f"(True = attend), {err_inverted:.3g} with it inverted; expected < 1e-4 and > 1e-2")


# -- pieces ---------------------------------------------------------------------------

@pytest.mark.parametrize("backend_id", [_param(b) for b in NATIVE])
def test_devices(backend_id):
    adapter = _adapter(backend_id)
    found = adapter.devices()
    assert found[0] == "cpu" and set(found) <= {"cpu", "gpu"} and len(set(found)) == len(found), (
        f"{backend_id}.devices() must list cpu first, then gpu only where the framework sees one: got {found}")
    with pytest.raises(ValueError, match="device"):
        case = CASES["self_basic"]
        from conformance.suite.cases import make_inputs, make_tensors

        adapter.forward(case.config, make_tensors(case), make_inputs(case), case.options("float64"), device="tpu")


def test_onnxruntime_graph_form_and_no_gradients():
    """Which graph a case gets: the Attention node, or plain ops where the node cannot express it."""
    adapter = _adapter("onnxruntime")
    from conformance.native import call_shapes
    from conformance.suite.cases import cast_inputs, make_inputs

    def form(name, dtype):
        case = CASES[name]
        inputs = cast_inputs(make_inputs(case), dtype)
        return adapter.graph_form(case.config, call_shapes(case.config, inputs, case.options(dtype)), inputs,
                                  case.options(dtype), "cpu", dtype)

    got = {(name, dtype): form(name, dtype) for name in ("self_basic", "bias", "dropout_train", "masked_rows_zero",
                                                        "masked_rows_nan") for dtype in ("float32", "float64")}
    expected = {
        ("self_basic", "float32"): "attention", ("self_basic", "float64"): "attention",
        ("bias", "float32"): "attention", ("bias", "float64"): "attention",
        ("dropout_train", "float32"): "plain", ("dropout_train", "float64"): "plain",
        # the node gives 0 for a fully masked row in float32 (its kernel), NaN in float64 (the function body)
        ("masked_rows_zero", "float32"): "attention", ("masked_rows_zero", "float64"): "plain",
        ("masked_rows_nan", "float32"): "plain", ("masked_rows_nan", "float64"): "attention",
    }
    assert got == expected, f"graph forms: got {got}, expected {expected}"
    with pytest.raises(NotImplementedError, match="forward only"):
        adapter.vjp(None, {}, {}, {}, None)


def test_gradients_cross_layouts_with_nan():
    """Native gradients come back in the layout's names and shapes; a NaN (a fully masked row's, torch)
    must land where the layout table puts it, since the converter itself refuses NaN."""
    from conformance.native import grads_to_canonical
    from weights import layouts

    config = weights.AttentionConfig(num_heads=2, query_dim=4, head_dim=2)
    tensors = weights.init(config, seed=1, dtype="float32")
    state = layouts.from_canonical("torch-mha", config, tensors)
    state["in_proj_weight"] = state["in_proj_weight"].copy()
    state["in_proj_weight"][5, 1] = np.nan  # [Wq; Wk; Wv] (3E, E): row 5 = key head 0, h 1; column 1 = input 1
    state["out_proj.bias"] = state["out_proj.bias"].copy()
    state["out_proj.bias"][2] = -np.inf
    got = grads_to_canonical("torch-mha", state, num_heads=2)
    clean = {k: np.where(np.isfinite(v), v, 0).astype(v.dtype) for k, v in state.items()}
    _, expected = layouts.to_canonical("torch-mha", clean, num_heads=2)
    where_nan = {n: np.argwhere(np.isnan(t)).tolist() for n, t in got.items() if np.isnan(t).any()}
    assert where_nan == {"key.kernel": [[1, 0, 1]]}, f"NaN positions: {where_nan}"
    assert np.isneginf(got["output.bias"][2]) and math.isfinite(float(got["output.bias"][1]))
    for name, t in expected.items():
        finite = np.isfinite(got[name])
        assert np.array_equal(got[name][finite], t[finite]), f"{name}: finite entries differ from the converter's"


def test_torch_flex_forward_only_on_cpu():
    """torch 2.13 has no flex_attention backward on CPU: the gradients are refused with torch's own words,
    the forward pass still runs and is judged."""
    adapter = _adapter("torch-flex")
    from conformance.suite.cases import make_inputs, make_tensors

    case = CASES["softcap"]
    tensors, inputs = make_tensors(case), make_inputs(case)
    d_out = np.ones((case.B, case.T, case.config.out_dim))
    with pytest.raises(NotImplementedError, match="torch-flex: FlexAttention does not support backward on CPU"):
        adapter.vjp(case.config, tensors, inputs, case.options("float64"), d_out, device="cpu")
    result = run_case(case, "torch-flex", dtype="float64", adapter=adapter)
    assert result.status == STATUS_PASS and "backward on CPU" in result.message, _describe(result)


def test_onnxruntime_modern_refusals_in_its_words():
    """onnxruntime 1.30 refuses the opset-25 window attributes and RotaryEmbedding in float64; ONNX has no sinks:
    each refusal carries the reason, onnxruntime's own words where it gave them."""
    _adapter("onnxruntime")
    expected = {("window_right", "float32"): "left_window_size", ("rope_half", "float64"): "RotaryEmbedding",
                ("sinks", "float32"): "no sinks input"}
    got = {key: run_case(CASES[key[0]], "onnxruntime", dtype=key[1]) for key in expected}
    bad = [f"{key}: {_describe(r)}" for key, r in got.items()
           if r.status != STATUS_UNSUPPORTED or expected[key] not in r.message]
    assert not bad, "refusals without their reason:\n" + "\n".join(bad)


def test_flax_nnx_normalize_qk_expresses_layer_norm_per_head_only():
    """normalize_qk=True is a LayerNorm per head without bias at eps 1e-6 (mha check --conventions measures it):
    a qk_norm config of that form with zero biases runs and matches the reference (and the norm matters);
    any other norm, a nonzero bias, and the gradients (no bias parameter) are refused with the reason."""
    adapter = _adapter("flax-nnx-mha")
    config = weights.AttentionConfig(num_heads=2, query_dim=8, head_dim=4, qk_norm={"type": "layer", "eps": 1e-6})
    tensors = weights.init(config, seed=3, dtype="float32")
    tensors.update({n: np.zeros_like(tensors[n]) for n in ("query.norm.bias", "key.norm.bias")})
    x = np.random.default_rng(0).standard_normal((2, 5, 8)).astype(np.float32)
    inputs = {"query": x, "key": x, "value": x}
    got = adapter.forward(config, tensors, inputs, {"dtype": "float32", "return_weights": True})
    t64 = {n: t.astype(np.float64) for n, t in tensors.items()}
    expected, weights_expected = multi_head_attention(config, t64, x.astype(np.float64), return_weights=True)
    plain = weights.AttentionConfig(num_heads=2, query_dim=8, head_dim=4)
    without = multi_head_attention(plain, {n: t for n, t in t64.items() if ".norm." not in n}, x.astype(np.float64))
    err, w_err = float(np.abs(got["output"] - expected).max()), float(np.abs(got["weights"] - weights_expected).max())
    assert err < 1e-5 and w_err < 1e-5 < 1e-2 < float(np.abs(got["output"] - without).max()), (err, w_err)
    biased = dict(tensors, **{"key.norm.bias": np.full_like(tensors["key.norm.bias"], 0.1)})
    with pytest.raises(NotImplementedError, match="flax-nnx-mha: normalize_qk's LayerNorm has no bias; the case's "
                                                  "key.norm.bias is not zero"):
        adapter.forward(config, biased, inputs, {"dtype": "float32"})
    rms = weights.AttentionConfig(num_heads=2, query_dim=8, head_dim=4, qk_norm={"type": "rms"})
    with pytest.raises(NotImplementedError, match="normalize_qk is LayerNorm per head"):
        adapter.forward(rms, weights.init(rms, seed=3, dtype="float32"), inputs, {"dtype": "float32"})
    with pytest.raises(NotImplementedError, match="no gradient"):
        adapter.vjp(config, tensors, inputs, {"dtype": "float32"}, np.ones((2, 5, 8)))


# -- the frontier fields (docs/spec-frontier.md) -----------------------------------------

FRONTIER_REFUSALS = {
    ("jax-dpa", "local_chunk_per_batch"): "local_window_size is a sliding window",
    ("jax-dpa", "output_gate_head"): "no gate argument",
    ("onnxruntime", "qkv_clip"): "ONNX Attention (opset 23-25) has no argument for it",
    ("onnxruntime", "norm_after_rope_chunked"): "normalises q and k before RotaryEmbedding",
    ("onnxruntime", "latent_mla"): "latent attention's up-projections come before the node",
}


@pytest.mark.parametrize("backend_id", [_param(b) for b in ("jax-dpa", "onnxruntime")])
def test_frontier_refusals_say_why(backend_id):
    """A frontier field the API has no argument for is refused with that field's own reason."""
    adapter = _adapter(backend_id)
    bad = []
    for (b, name), words in FRONTIER_REFUSALS.items():
        if b == backend_id:
            result = run_case(CASES[name], backend_id, dtype="float32", adapter=adapter)
            if result.status != STATUS_UNSUPPORTED or words not in result.message:
                bad.append(f"{name}: expected unsupported with {words!r}:\n{_describe(result)}")
    assert not bad, "\n".join(bad)


@pytest.mark.jax
def test_jax_dpa_alibi_reads_the_call_positions():
    """jax-dpa's ALiBi reads the call's positions: a row whose positions restart (distance != index distance),
    output and every gradient (alibi.slopes' included) against the float64 reference under the suite's policy;
    the grid's ALiBi case has the default positions, where reading them or not gives the same numbers."""
    adapter = _adapter("jax-dpa")
    from conformance.suite.tolerance import assert_close
    from impl_numpy import multi_head_attention_vjp

    config = weights.AttentionConfig(num_heads=2, query_dim=8, head_dim=4, alibi=True)
    tensors = weights.init(config, seed=5, dtype="float32")
    rng = np.random.default_rng(6)
    x = rng.standard_normal((2, 5, 8)).astype(np.float32)
    d_out = rng.standard_normal((2, 5, 8)).astype(np.float32)
    positions = np.array([[0, 1, 2, 0, 1], [3, 4, 5, 6, 7]])  # row 0 restarts, row 1 starts at 3
    got = adapter.vjp(config, tensors, {"query": x, "key": x, "value": x, "positions": positions,
                                        "key_positions": positions}, {"dtype": "float32", "is_causal": True}, d_out)
    x64 = x.astype(np.float64)
    expected_out, expected, magnitudes = multi_head_attention_vjp(
        config, {n: t.astype(np.float64) for n, t in tensors.items()}, x64, x64, x64,
        d_output=d_out.astype(np.float64), is_causal=True, positions=positions, key_positions=positions,
        gradient_magnitudes=True)
    common = dict(config=config, dtype="float32", B=2, T=5, S=5)
    assert_close("output", got["output"], expected_out, quantity="output", **common)
    for name in ("alibi.slopes", "query", "query.kernel"):
        assert_close(f"grad {name}", got["grads"][name], expected[name], quantity="grad",
                     scale_floor=float(np.abs(magnitudes[name]).max()), **common)


@pytest.mark.parametrize("backend_id", [_param(b) for b in ("torch-flex", "onnxruntime")])
def test_alibi_after_the_softcap_over_a_cache(backend_id):
    """ALiBi comes after the softcap and counts the cache's keys at 0..P-1 while the new tokens sit far on: a
    softcap of 2 saturated by large logits (ALiBi before it would vanish) and distances that are not the index
    distances (the grid's frontier_everything hides the cache behind its chunks). Judged by the suite."""
    adapter = _adapter(backend_id)
    from conformance.suite.cases import Case

    case = Case("alibi_softcap_cache", weights.AttentionConfig(num_heads=2, query_dim=8, head_dim=4, alibi=True,
                                                               logit_softcap=2.0),
                T=2, S=2, P=4, positions="far", input_scale=4.0, is_causal=True, causal_alignment="bottom_right",
                self_attention=False)
    result = run_case(case, backend_id, dtype="float32", adapter=adapter)
    assert result.status == STATUS_PASS, _describe(result)


@pytest.mark.parametrize("backend_id", [_param(b) for b in ("torch-flex", "onnxruntime")])
def test_cache_positions_reach_alibi_and_the_chunks(backend_id):
    """past_key_positions (a left-padded row) reach the ALiBi bias and the chunk mask of the two natives that
    build them from the call's positions: forward judged by the suite (both are forward-only on CPU)."""
    from modern_checks import CACHE_POSITION_CASES

    adapter = _adapter(backend_id)
    result = run_case(CACHE_POSITION_CASES["cache_positions_alibi_chunk"], backend_id, dtype="float32",
                      adapter=adapter, gradients=False)
    assert result.status == STATUS_PASS, _describe(result)


@pytest.mark.parametrize("backend_id", [_param(b) for b in NATIVE if b not in ("torch-flex", "onnxruntime")])
def test_cache_positions_are_refused_by_name(backend_id):
    """Every other native refuses past_key_positions, naming it, with its reason."""
    from modern_checks import CACHE_POSITION_CASES

    adapter = _adapter(backend_id)
    result = run_case(CACHE_POSITION_CASES["cache_positions_alibi_chunk"], backend_id, dtype="float32",
                      adapter=adapter, gradients=False)
    assert result.status == STATUS_UNSUPPORTED and "past_key_positions" in result.message, _describe(result)
