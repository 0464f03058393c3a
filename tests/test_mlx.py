"""impl_mlx, the MLX mirror: what MLX does differently (measured), the grid on every path and dtype, the
in-place cache, the layer and its weight file, the backend's refusals, and the porting bugs of
tests/mutants.py planted in the MLX paths (each must fail `mha check`'s comparison).

The cross-backend agreement itself is `mha check --backends numpy mlx` (every case, every path and dtype,
against the float64 reference); here a subset that reaches every feature and path, to keep `tox -e mlx`
under a minute.
"""

from __future__ import annotations

import dataclasses
import math
import sys

import numpy as np
import pytest
from modern_checks import indexer_call, indexer_refusals
from mutants import INDEXER_MUTANTS, TOPK_MUTANTS

from conformance.suite import backends, check
from conformance.suite.cases import CASES, cast_inputs, cast_tensors, make_inputs, make_tensors
from conformance.suite.compare import STATUS_FAIL, STATUS_PASS, STATUS_UNSUPPORTED, run_case

pytestmark = pytest.mark.mlx
mx = pytest.importorskip("mlx.core", reason="MLX not installed: pip install -c constraints/cpu.txt '.[mlx]' "
                                            "(wheels: Linux x86-64, macOS arm64)")

from impl_mlx import functional as F  # noqa: E402

# Cases that reach every feature the contract has (masks, bias, causal of both alignments, GQA, masked rows
# of each policy, dropout, RoPE and its scalings, the cache, windows, softcap, norms, sinks, packed rows,
# ALiBi, local chunks, the temperature, the clip, gates, LongRoPE, MLA with its decode, past_key_positions,
# every topk_indices case: shared over a cache, per kv head, the latent decode, a row left empty; and every
# lightning indexer case: DSA's prefill and decode over a latent layer, MiniMax M3's blocks per kv head).
TOPK_CASES = tuple(name for name, case in CASES.items() if case.selection is not None)
INDEXER_CASES = tuple(name for name, case in CASES.items() if case.config.indexer is not None)
GRID = ("mask_and_bias_causal", "causal_bottom_right_long_query", "gqa", "masked_rows_nan", "sinks_masked_rows",
        "dropout_train", "decode_cache", "cache_window_gqa", "segments_packed_cache", "modern_everything",
        "frontier_everything", "alibi_chunk_decode", "rope_longrope_long", "latent_mla", "latent_decode",
        "norm_after_rope_chunked", "edge_alibi_decode_positions", "output_gate_head", "qk_norm_per_head_layer",
        "differential_gqa", "differential_decode", *TOPK_CASES, *INDEXER_CASES)


def _rng_array(shape, seed=0, scale=1.0):
    return np.random.default_rng(seed).standard_normal(shape) * scale


# -- what MLX does differently (the figures docs/conventions.md cites) ----------------------------------------

def test_mlx_float64_exp_sin_cos_are_float32_accurate_and_the_stages_are_not():
    """MLX 0.32.4 on the CPU: exp, sin and cos of float64 carry float32's error (tanh, log1p, power: float64's);
    the stages' exp and RoPE's cos/sin are float64-accurate (functional.exp, cos_sin)."""
    x = _rng_array(4096, scale=3.0)
    a = mx.array(x, dtype=mx.float64)
    native = {"exp": np.abs(np.array(mx.exp(a)) / np.exp(x) - 1).max(),
              "cos": np.abs(np.array(mx.cos(a * 30)) - np.cos(x * 30)).max(),
              "sin": np.abs(np.array(mx.sin(a * 30)) - np.sin(x * 30)).max()}
    cos, sin = F.cos_sin(a * 30)
    ours = {"exp": np.abs(np.array(F.exp(a)) / np.exp(x) - 1).max(),
            "cos": np.abs(np.array(cos) - np.cos(x * 30)).max(), "sin": np.abs(np.array(sin) - np.sin(x * 30)).max()}
    print(f"float64 error, MLX's own: {native}; the stages': {ours}")
    # far beyond float64's rounding (1e-16 relative; angles to 90: 1e-14 absolute), and far below a wrong result
    assert all(1e-10 < e < 1e-3 for e in native.values()), native
    assert all(e < 1e-13 for e in ours.values()), ours
    for name in ("tanh", "log1p"):  # the ones MLX computes in float64: the stages use them as they are
        err = np.abs(np.array(getattr(mx, name)(mx.array(np.abs(x), dtype=mx.float64))) / getattr(np, name)(np.abs(x)) - 1)
        assert err.max() < 1e-14, (name, err.max())


def test_sdpa_computes_float64_in_float32_so_float64_never_takes_it():
    from impl_mlx.attention import FLOAT64_REFUSAL, plan

    B, N, K, T, S, H = 1, 4, 2, 5, 7, 8
    q, k, v = _rng_array((B, N, T, H), 1), _rng_array((B, K, S, H), 2), _rng_array((B, K, S, H), 3)
    kk, vv = np.repeat(k, N // K, 1), np.repeat(v, N // K, 1)
    x = q @ kk.swapaxes(-1, -2) * 0.3
    w = np.exp(x - x.max(-1, keepdims=True))
    expected = (w / w.sum(-1, keepdims=True)) @ vv
    got = mx.fast.scaled_dot_product_attention(*(mx.array(a, dtype=mx.float64) for a in (q, k, v)), scale=0.3)
    error = np.abs(np.array(got) - expected).max()
    print(f"mx.fast.scaled_dot_product_attention, float64 inputs: dtype {got.dtype}, max error {error:.3g}")
    assert got.dtype == mx.float64 and 1e-11 < error < 1e-5, error  # float32's error under a float64 dtype
    config = CASES["self_basic"].config
    chosen = plan(config, return_weights=False, traced=False, chunk_size=None, dropout=False, dtype=np.float64)
    assert chosen.path == "stages" and chosen.why == FLOAT64_REFUSAL
    assert plan(config, return_weights=False, traced=False, chunk_size=None, dropout=False,
                dtype=np.float32).path == "fused"


def test_sdpa_causal_aligns_bottom_right_and_gives_an_empty_row_the_mean_of_v():
    T, S, H = 5, 3, 4
    q, k, v = (mx.array(_rng_array(s, i).astype(np.float32)) for i, s in enumerate(((1, 1, T, H), (1, 1, S, H),
                                                                                    (1, 1, S, H))))
    causal = np.array(mx.fast.scaled_dot_product_attention(q, k, v, scale=0.5, mask="causal"))
    for name, offset, same in (("top_left", 0, False), ("bottom_right", S - T, True)):
        allowed = mx.arange(S)[None] <= mx.arange(T)[:, None] + offset
        by_mask = np.array(mx.fast.scaled_dot_product_attention(q, k, v, scale=0.5, mask=allowed))
        assert np.allclose(causal, by_mask, rtol=1e-6, atol=1e-6) is same, name
    # rows 0 and 1 see no key under bottom-right (j <= i - 2): MLX gives them the mean of V, not 0 or NaN
    assert np.allclose(causal[0, 0, :2], np.array(v).mean(axis=2)[0, 0], rtol=1e-5, atol=1e-6), causal[0, 0, :2]


def test_mlx_where_lets_a_nan_cotangent_into_the_branch_not_taken_and_the_stages_where_does_not():
    """MLX 0.32.4's VJP of mx.where multiplies the cotangent by the condition (NaN x 0 = NaN in the branch not
    taken); np.where in the spec's backward, torch.where and jnp.where select it away: functional.where's VJP
    selects too. If MLX's own stops leaking, functional.where can go."""
    condition = mx.array([True, False, True])
    cotangent = mx.array([np.nan, np.nan, 2.0])
    x, y = mx.array([1.0, 2.0, 3.0]), mx.array([4.0, 5.0, 6.0])
    native = [np.array(g) for g in mx.vjp(lambda a, b: mx.where(condition, a, b), [x, y], [cotangent])[1]]
    ours = [np.array(g) for g in mx.vjp(lambda a, b: F.where(condition, a, b), [x, y], [cotangent])[1]]
    print(f"cotangent {np.array(cotangent)}, condition {np.array(condition)}: mx.where's VJP {native}, "
          f"functional.where's {ours}")
    assert np.isnan(native[0][1]) and np.isnan(native[1][0]), native  # the branch not taken gets NaN
    np.testing.assert_array_equal(ours[0], [np.nan, 0.0, 2.0])
    np.testing.assert_array_equal(ours[1], [0.0, np.nan, 0.0])
    # broadcast operands get the sum over the broadcast axes, as mx.where's own VJP gives them
    b = mx.array([[0.5], [1.5]])
    g = mx.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    native = [np.array(t) for t in mx.vjp(lambda a, c: mx.where(condition, a, c), [mx.array(0.0), b], [g])[1]]
    ours = [np.array(t) for t in mx.vjp(lambda a, c: F.where(condition, a, c), [mx.array(0.0), b], [g])[1]]
    assert all(n.shape == o.shape and np.array_equal(n, o) for n, o in zip(native, ours, strict=True)), (native, ours)


def test_a_clip_gate_that_16_bits_open_counts_its_terms():
    """The MLX sweep's find (docs/conformance.md, tolerance policy): random_996499, bfloat16, a key projection
    of 0.20025 in float64 rounds onto the clip's bound (0.2002) in 16 bits, where the gradient passes; the
    chunked core's float32 noise of an exact cancellation (S = 1), 1e-8, reached grad key.bias there, and the
    float64 reference's magnitude, with its gate closed, was 0 (margin 6e299). The magnitudes count the
    16-bit gates' terms too: every path passes."""
    from conformance.suite.cases import random_case
    from conformance.suite.compare import expected_for
    from conformance.suite.sweep import sweep

    exp = expected_for(random_case(996499), "bfloat16")
    assert exp["magnitudes"]["key.bias"].ravel()[6] > 1, exp["magnitudes"]["key.bias"]  # the gate 16 bits open
    found = sweep("mlx", [996499], ("bfloat16",), check.PATH_KINDS)
    assert "chunked bfloat16" in found["worst"], found["worst"]
    assert found["runs"] > 0 and not found["failures"], "\n".join(found["failures"])


def test_the_fused_kernel_in_16_bits_is_judged_against_a_chunked_reference_too():
    """The MLX sweep's find (seeds 993000-1002999; docs/conformance.md, tolerance policy): random_997082,
    bfloat16, mx.fast.scaled_dot_product_attention keeps the softmax numerators in float32 as a chunked core
    does: its output error 6.1e-4 against the stages' 1.4e-4 (margin 1.26 against 3x that), the NumPy chunked
    core's 3.7e-4. Judged against the larger of the two, every path passes."""
    from conformance.suite.sweep import sweep

    found = sweep("mlx", [997082], ("bfloat16",), check.PATH_KINDS)
    assert "fused bfloat16" in found["worst"], found["worst"]
    assert found["runs"] > 0 and not found["failures"], "\n".join(found["failures"])


def test_a_chunked_cores_16_bit_gradient_is_judged_against_the_chunked_cores_backward_too():
    """Issue 42's sweep find: random_differential_1012028, float16, grad key on the chunked path failed at margin
    1.05 on tf, jax and mlx alike. The chunked core's backward (autodiff through the online softmax) keeps the
    weights and their cotangent in float32 where the stages' backward stores them in 16 bits: NumPy's backward
    with the chunked core's precision (compare.kernel_same_precision) has an error of about 3.5x the stages'
    (1.02 against 0.293; MLX's chunked path 1.01). Judged against the larger of the two, the path passes, and a
    dK that forgets the scale (a hand-written flash backward's bug) still fails there."""
    from conformance.suite.cases import random_differential_case
    from conformance.suite.compare import expected_for, judge_gradients, kernel_same_precision

    case = random_differential_case(1_012_028)
    exp = expected_for(case, "float16")
    stages, kernel = exp["same_precision"]["grad key"], kernel_same_precision(case, "float16", exp, fused=False)
    assert kernel["grad key"] > 3 * stages, (kernel["grad key"], stages)  # else the seed shows nothing
    result = run_case(case, "mlx", dtype="float16", path="chunked")
    assert result.status == STATUS_PASS, result.worst.describe() if result.worst else result.message
    adapter = backends.load("mlx")
    options = adapter.path_options("chunked", case.config, exp["inputs"], case.options("float16"))
    grads = dict(adapter.vjp(case.config, exp["tensors"], exp["inputs"], options,
                             exp["d_output"].astype(np.float16))["grads"])
    for name in ("key", "key.kernel", "key.bias"):  # dK without the scale: the key side's gradients off by 1/scale
        grads[name] = np.asarray(grads[name], np.float64) / case.config.effective_scale
    failed = [c for c in judge_gradients(case, "float16", grads, kernel=True) if not c.ok]
    assert {c.name for c in failed} >= {"grad key", "grad key.kernel"}, [c.describe() for c in failed]


@pytest.mark.parametrize("seed", [1_001_932, 1_001_221])
def test_the_fused_kernel_in_16_bits_is_judged_against_a_folded_scale_too(seed):
    """Issue 40: MLX's fused path in float16 with a bias and one query failed at margins 1.43 (random_1001932) and
    1.08 (random_1001221, and its in-place path). mx.fast.scaled_dot_product_attention on CPU multiplies q by the scale in float16
    before the product (mlx/fast.cpp's fallback): the NumPy stages with that order (impl_numpy.backward,
    fold_scale) give MLX's output (docs/conformance.md), with 4.5x and 5.3x the stages' error. The policy's
    fused formulation (compare.kernel_same_precision, fused=True) counts it: the path passes, and a port
    that adds the bias before scaling the logits still fails there."""
    from mutants import MutantAdapter

    from conformance.suite.cases import random_case
    from conformance.suite.compare import expected_for, judge, kernel_same_precision

    case = random_case(seed)
    exp = expected_for(case, "float16")
    assert kernel_same_precision(case, "float16", exp, fused=True)["output"] > 3 * exp["same_precision"]["output"]
    for path in ("fused", "in_place"):  # 1001221 has a cache: its in-place call runs the kernel too
        result = run_case(case, "mlx", dtype="float16", path=path, gradients=False)
        assert result is None or result.status == STATUS_PASS, result.worst.describe() if result.worst else result.message
    mutant = MutantAdapter("bias_before_scale").forward(case.config, exp["tensors"], exp["inputs"],
                                                        case.options("float16"))
    comparisons = judge(case, "float16", mutant, None, precision="highest", kernel=True)
    assert not all(c.ok for c in comparisons), [c.describe() for c in comparisons]


@pytest.mark.parametrize("seed", [982308, 981036])
def test_a_nan_row_policy_reaches_the_value_gradient_only_where_the_spec_has_it(seed):
    """Found by sweeps (2026-11-29; the seeds are this test's now), both from MLX's where VJP (above):
    random_982308 (masked_row "nan", a fully masked row, the value clip): the NaN value gradient of the empty
    row came through the clip's branch not taken into value and value.kernel where the float64 reference has 0,
    on every path; random_981036 (masked_row "nan", no row empty): the chunked path's fill, NaN x V on every
    row, gave every row's value gradient NaN (0 x NaN) through its select. Every path and dtype must agree."""
    from conformance.suite.cases import random_case
    from conformance.suite.compare import expected_for
    from conformance.suite.sweep import sweep

    case = random_case(seed)
    assert case.config.masked_row == "nan", case.config.masked_row
    empty_rows = np.isnan(expected_for(case, "float64")["output"]).any()
    assert (empty_rows, case.config.qkv_clip is not None) == ((True, True) if seed == 982308 else (False, False))
    found = sweep("mlx", [seed], ("float64", "float32", "bfloat16"), check.PATH_KINDS)
    assert {key.split()[0] for key in found["worst"]} >= {"stages", "chunked"}, found["worst"]
    assert found["runs"] > 0 and not found["failures"], "\n".join(found["failures"])


# -- the grid on every path and dtype ---------------------------------------------------------------------

def test_the_grid_passes_on_every_path_or_says_why_not():
    results, skipped = check.run_check(["mlx"], case_names=list(GRID), jobs=1, progress=False,
                                       path_kinds=check.PATH_KINDS)
    assert not skipped, skipped
    bad = [f"{r.case}/{r.path}/{r.dtype}: {r.status} {r.message or (r.worst.describe() if r.worst else '')}"
           for r in results if r.status not in (STATUS_PASS, STATUS_UNSUPPORTED)]
    assert not bad, "\n".join(bad)
    unsupported = {(r.path, r.message.split(": ", 1)[1].split(" (the stages run)")[0]) for r in results
                   if r.status == STATUS_UNSUPPORTED}
    # only the fused kernel refuses, and only for what it cannot compute
    assert {path for path, _ in unsupported} == {"fused"}, unsupported
    reasons = {why for _, why in unsupported}
    assert any(why.startswith("float64 storage") for why in reasons) and any("softcap" in why for why in reasons)
    assert any("dropout" in why for why in reasons), reasons
    paths = {r.path for r in results if r.status == STATUS_PASS}
    assert paths == {"stages", "fused", "chunked", "in_place"}, paths
    print(f"{len(results)} results: {sum(r.status == STATUS_PASS for r in results)} pass, worst margin "
          f"{max(r.margin for r in results if r.status == STATUS_PASS):.3g}")


# -- the in-place cache, the layer, the refusals ---------------------------------------------------------

def test_the_in_place_cache_writes_the_callers_buffers():
    from impl_mlx import multi_head_attention
    from impl_numpy import multi_head_attention as reference

    case = CASES["decode_cache"]
    tensors, inputs = cast_tensors(make_tensors(case), "float64"), cast_inputs(make_inputs(case), "float64")
    P, S = inputs["past_key"].shape[2], inputs["query"].shape[1]
    buffers = []
    for name in ("past_key", "past_value"):
        buffer = np.zeros((*inputs[name].shape[:2], P + S + 2, inputs[name].shape[3]))
        buffer[:, :, :P] = inputs[name]
        buffers.append(mx.array(buffer, dtype=mx.float64))
    options = dict(is_causal=case.is_causal, causal_alignment=case.causal_alignment, positions=inputs.get("positions"))
    out, k, v = multi_head_attention(case.config, tensors, inputs["query"], past_key=buffers[0],
                                     past_value=buffers[1], cache_length=P, return_cache=True, **options)
    ref_out, ref_k, ref_v = reference(case.config, tensors, inputs["query"], past_key=inputs["past_key"],
                                      past_value=inputs["past_value"], return_cache=True, **options)
    assert k is buffers[0] and v is buffers[1]  # the caller's own arrays, written
    # 1e-12: both float64, the same stages in another order of rounding, on values of size ~1 summed over
    # a few dozen terms (float64's unit 1.1e-16: 10^4 of them), where a wrong or missing write is off by ~1
    for got, want in ((np.array(buffers[0])[:, :, :P + S], ref_k), (np.array(buffers[1])[:, :, :P + S], ref_v)):
        assert np.abs(got - want).max() < 1e-12, np.abs(got - want).max()
    assert not np.array(buffers[0])[:, :, P + S:].any()  # nothing written past P + S
    assert np.abs(np.array(out) - ref_out).max() < 1e-12
    with pytest.raises(ValueError, match="past_key with cache_length is written in place: it must be an mx.array of the storage dtype float64: got a ndarray"):
        multi_head_attention(case.config, tensors, inputs["query"], past_key=np.array(buffers[0]),
                             past_value=buffers[1], cache_length=P, return_cache=True, **options)


def test_the_layer_reads_the_weight_file_and_names_its_parameters_canonically(tmp_path):
    import mlx.nn as nn

    import weights
    from impl_mlx import MultiHeadAttention

    case = CASES["frontier_everything"]
    tensors = cast_tensors(make_tensors(case), "bfloat16")
    weights.save(tmp_path / "w.safetensors", case.config, tensors)
    layer = MultiHeadAttention.from_file(tmp_path / "w.safetensors")
    assert isinstance(layer, nn.Module) and set(layer.params) == set(case.config.tensor_shapes())
    back = layer.to_tensors()
    assert all(back[n].dtype == tensors[n].dtype and np.array_equal(back[n].view(np.uint16), tensors[n].view(np.uint16))
               for n in tensors)  # bit-exact, bfloat16 included
    # an ordinary MLX model: nn.value_and_grad over its parameters
    x = mx.array(_rng_array((1, 3, case.config.query_dim)).astype(np.float32))
    layer32 = MultiHeadAttention(case.config, cast_tensors(make_tensors(case), "float32"))
    loss, grads = nn.value_and_grad(layer32, lambda m, x: m(x, is_causal=True).sum())(layer32, x)
    assert math.isfinite(loss.item()) and "kernel" in grads["query"] and "slopes" in grads["alibi"]


def test_bad_inputs_are_one_line_errors_naming_the_argument():
    from impl_mlx import multi_head_attention

    case = CASES["self_basic"]
    tensors, inputs = make_tensors(case), make_inputs(case)
    with pytest.raises(ValueError, match="query must be a float array: got dtype int64"):
        multi_head_attention(case.config, tensors, mx.array(np.ones((1, 2, case.config.query_dim), np.int64)))
    bad = inputs["query"].copy()
    bad[0, 0, 0] = np.inf
    with pytest.raises(ValueError, match="query contains \\+-inf"):
        multi_head_attention(case.config, tensors, bad)


def test_the_backend_says_not_installed_where_mlx_is_missing(monkeypatch):
    for name in [n for n in sys.modules if n == "mlx" or n.startswith(("mlx.", "impl_mlx"))]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "mlx", None)  # `import mlx.core` now fails as on a platform without a wheel
    ok, why = backends.availability("mlx")
    assert not ok and why.startswith("backend mlx: not installed (mlx"), why
    assert "install mlx: the mlx extra" in why and "Linux x86-64" in why and "macOS arm64" in why, why


def test_mlx_nn_multi_head_attention_through_the_live_module_adapter():
    """mlx.nn.MultiHeadAttention (query_proj ... out_proj, torch's Linear layout) under `mha verify`: it conforms
    in float32 and bfloat16, and not in float64, where its softmax's exp is MLX's float32-accurate one."""
    import mlx.nn as nn

    from conformance.suite import adapters
    from conformance.suite.verify import verify

    names = {"query": "query_proj", "key": "key_proj", "value": "value_proj", "output": "out_proj"}
    fn = adapters.mlx_module(lambda c: nn.MultiHeadAttention(c.query_dim, c.num_heads, bias=c.use_query_bias),
                             "torch-linears", names=names)
    results = {r.name: r for r in verify(fn, only=["self_basic", "cross_basic"], require_gradients=True,
                                         dtypes=["float64", "float32", "bfloat16"])}
    status = {name: r.status for name, r in results.items()}
    assert status == {f"{c}.{d}": STATUS_FAIL if d == "float64" else STATUS_PASS
                      for c in ("self_basic", "cross_basic") for d in ("float64", "float32", "bfloat16")}, status


# -- the porting bugs of tests/mutants.py, planted in the MLX paths -------------------------------------------

def _wrap(monkeypatch, module, name, make):
    original = getattr(module, name)
    monkeypatch.setattr(module, name, make(original))


def _plant(bug: str, monkeypatch) -> None:
    from impl_mlx import attention, chunked

    if bug == "wrong_scale":  # 1/H instead of 1/sqrt(H), in the stages' logits and the fused kernel's call
        _wrap(monkeypatch, F, "logits", lambda f: lambda q, k, scale: f(q, k, scale / math.sqrt(q.shape[-1])))
        _wrap(monkeypatch, attention, "sdpa_attend", lambda f: lambda config, q, k, v, **kw: f(
            dataclasses.replace(config, scale=config.effective_scale / math.sqrt(q.shape[-1])), q, k, v, **kw))
    elif bug == "softmax_wrong_axis":
        _wrap(monkeypatch, F, "softmax", lambda f: lambda x, row, sinks=None: mx.swapaxes(
            f(mx.swapaxes(x, -1, -2), row, None), -1, -2) if x.shape[-1] == x.shape[-2] else f(x, row, sinks))
    elif bug == "inverted_mask":  # True read as masked
        _wrap(monkeypatch, F, "mask_stage", lambda f: lambda x, allowed, bias: f(
            x, None if allowed is None else ~allowed, bias))
        _wrap(monkeypatch, attention, "sdpa_attend", lambda f: lambda config, q, k, v, *, allowed, **kw: f(
            config, q, k, v, allowed=None if allowed is None else ~allowed, **kw))
    elif bug == "causal_off_by_one":  # j < i: a token cannot see itself
        _wrap(monkeypatch, F, "causal_mask", lambda f: lambda T, S, alignment="top_left": f(T, S, alignment) & ~(
            mx.arange(S)[None, :] == mx.arange(T)[:, None] + (0 if alignment == "top_left" else S - T)))
    elif bug == "causal_always_bottom_right":
        _wrap(monkeypatch, F, "causal_mask", lambda f: lambda T, S, alignment="top_left": f(T, S, "bottom_right"))
    elif bug == "missing_output_bias":
        _wrap(monkeypatch, F, "output", lambda f: lambda x, kernel, bias: f(x, kernel, None))
    elif bug == "gqa_head_mapping_modulo":  # query head n reads key head n % K instead of n // G
        def regroup(q, K):
            B, N, T, H = q.shape
            return q.reshape(B, N // K, K, T, H).transpose(0, 2, 1, 3, 4).reshape(B, N, T, H)

        _wrap(monkeypatch, F, "logits", lambda f: lambda q, k, scale: regroup(f(regroup(q, k.shape[1]), k, scale),
                                                                               q.shape[1] // k.shape[1]))
    elif bug == "mask_fill_minus_1e9":  # masked logits -1e9: a fully masked row becomes uniform
        _wrap(monkeypatch, F, "mask_stage", lambda f: lambda x, allowed, bias: mx.maximum(
            f(x, allowed, bias), mx.array(-1e9, dtype=x.dtype)))
    elif bug == "rope_convention_swapped":
        _wrap(monkeypatch, F, "rope", lambda f: lambda x, angles, R, interleaved, factor: f(
            x, angles, R, not interleaved, factor))
    elif bug == "sinks_ignored":
        _wrap(monkeypatch, F, "softmax", lambda f: lambda x, row, sinks=None: f(x, row, None))
        _wrap(monkeypatch, attention, "sdpa_attend", lambda f: lambda config, q, k, v, *, sinks=None, **kw: f(
            config, q, k, v, sinks=None, **kw))
    elif bug == "norm_eps_outside_sqrt":  # x / (sqrt(mean(x^2)) + eps): the norm's own stage rewritten so
        def norm(x, scale, bias, kind, eps, heads, scope):
            B, L, Fl = x.shape
            width = Fl // heads if scope == "head" else Fl
            y = x.astype(mx.float32).reshape(B, L, Fl // width, width)
            if kind == "layer":
                y = y - y.mean(axis=-1, keepdims=True)
            y = y / (mx.sqrt((y * y).mean(axis=-1, keepdims=True)) + eps)
            for t in (scale, bias):
                if t is not None:
                    t = (t.reshape(-1) if scope == "all" else t).astype(mx.float32)
                    y = y * t if t is scale else y + t
            return y.reshape(B, L, Fl).astype(x.dtype)

        monkeypatch.setattr(F, "norm", norm)
    elif bug == "dropout_no_rescale":
        _wrap(monkeypatch, F, "dropout", lambda f: lambda w, keep, rate: f(w, keep, 0.0))
    elif bug == "segments_ignored_by_the_chunked_core":  # the chunked core's own masks: packed rows leak
        monkeypatch.setattr(chunked, "segment_mask", lambda q, k: mx.ones((1, 1, q.shape[-1], k.shape[-1]), mx.bool_))
    elif bug == "alibi_sign_flipped":
        _wrap(monkeypatch, F, "alibi_bias", lambda f: lambda *a, **kw: -f(*a, **kw))
    elif bug == "mla_absorbed_value_transposed":  # the absorbed form's value up-projection read the wrong way
        _wrap(monkeypatch, F, "expand_values", lambda f: lambda ctx, kernel: f(
            ctx, kernel.reshape(kernel.shape[2], kernel.shape[1], kernel.shape[0]).transpose(2, 1, 0)))
    else:
        raise AssertionError(bug)


# bug -> (cases that reach it, the paths it lives on)
PLANTED = {
    "wrong_scale": (("self_basic", "gqa"), ("stages", "fused", "chunked")),
    "softmax_wrong_axis": (("self_basic",), ("stages",)),
    "inverted_mask": (("mask_and_bias_causal", "padding_mask"), ("stages", "fused", "chunked")),
    "causal_off_by_one": (("causal_square", "causal_top_left"), ("stages", "fused")),
    "causal_always_bottom_right": (("causal_top_left",), ("stages", "fused")),
    "missing_output_bias": (("self_basic",), ("stages", "fused", "chunked")),
    "gqa_head_mapping_modulo": (("gqa",), ("stages", "chunked")),
    "mask_fill_minus_1e9": (("masked_rows_zero", "masked_rows_nan"), ("stages",)),
    "rope_convention_swapped": (("rope_half", "rope_interleaved"), ("stages", "fused", "chunked")),
    "sinks_ignored": (("sinks",), ("stages", "fused")),
    "norm_eps_outside_sqrt": (("qk_norm_rms_head", "qk_norm_layer_all", "value_norm", "edge_value_norm_cache_long_query"),
                              ("stages", "fused", "chunked")),
    "dropout_no_rescale": (("dropout_train",), ("stages",)),
    "segments_ignored_by_the_chunked_core": (("segments_packed", "segments_packed_cache"), ("chunked",)),
    "alibi_sign_flipped": (("alibi_causal",), ("stages", "fused", "chunked")),
    "mla_absorbed_value_transposed": (("latent_decode",), ("fused", "chunked")),
}


@pytest.mark.parametrize("bug", list(PLANTED))
def test_a_porting_bug_planted_in_the_mlx_paths_fails(bug, monkeypatch):
    cases, paths = PLANTED[bug]
    adapter = backends.load("mlx")
    _plant(bug, monkeypatch)
    results = [run_case(CASES[name], "mlx", dtype="float32", adapter=adapter, gradients=False, path=path)
               for name in cases for path in paths]
    results = [r for r in results if r is not None]
    caught = {r.path for r in results if r.status == STATUS_FAIL}
    assert caught == set(paths), (f"{bug}: caught on {sorted(caught)} of {paths}: "
                                  + "; ".join(f"{r.case}/{r.path} {r.status} {r.message}" for r in results))


# topk_indices' porting bugs (tests/mutants.py TOPK_MUTANTS), planted in the one function every MLX path takes the
# selection from (functional.selection_mask, ANDed into the mask by call.prepare): each fails its grid case on
# every path that runs it (the in-place cache where the case has one)
def _plant_topk(bug: str, P: int, monkeypatch) -> None:
    def planted(f):
        def selection_mask(topk_indices, num_heads, S):
            idx = topk_indices.astype(mx.int64)
            if bug == "topk_ignored":
                return mx.ones((idx.shape[0], 1, idx.shape[-2], S), mx.bool_)
            if bug == "topk_new_keys_only":  # index i read as the new key i: P + i, those past the keys dropped
                return f(mx.where(idx >= 0, idx + P, idx), num_heads, S + P)[..., :S]
            if bug == "topk_minus_one_as_last":  # Python's index -1: the last key
                return f(mx.where(idx == -1, S - 1, idx), num_heads, S)
            assert bug == "topk_kv_heads_tiled" and idx.ndim == 4, bug
            K = idx.shape[1]  # query head n reads kv head n % K
            return mx.tile(f(idx, K, S), (1, num_heads // K, 1, 1))
        return selection_mask

    _wrap(monkeypatch, F, "selection_mask", planted)


@pytest.mark.parametrize("bug", list(TOPK_MUTANTS))
def test_a_topk_porting_bug_planted_in_the_mlx_paths_fails(bug, monkeypatch):
    name = TOPK_MUTANTS[bug][1]
    case = CASES[name]
    paths = ("stages", "fused", "chunked") + (("in_place",) if case.P else ())
    adapter = backends.load("mlx")
    _plant_topk(bug, case.P, monkeypatch)
    results = [run_case(case, "mlx", dtype="float32", adapter=adapter, gradients=False, path=path) for path in paths]
    caught = {r.path for r in results if r is not None and r.status == STATUS_FAIL}
    assert caught == set(paths), (f"{bug}: caught on {sorted(caught)} of {paths}: "
                                  + "; ".join(f"{r.path} {r.status} {r.message}" for r in results if r is not None))
    print(f"{bug} on {name}: " + ", ".join(f"{r.path} margin {r.margin:.3g}" for r in results))


# The lightning indexer's porting bugs (tests/mutants.py INDEXER_MUTANTS), planted where impl_mlx's call runs the
# indexer (call.run_indexer, call.lightning_indexer): each fails its grid case on every path
def _plant_indexer(bug: str, monkeypatch) -> None:
    from impl_mlx import call as mlx_call

    if bug == "indexer_ignored":  # the selection made and returned, but never joined to the mask: dense attention
        def run_indexer(config, call, *args, _original=mlx_call.run_indexer, **kwargs):
            mask4 = call.mask4
            _original(config, call, *args, **kwargs)
            call.mask4 = mask4

        monkeypatch.setattr(mlx_call, "run_indexer", run_indexer)
        return
    assert bug == "indexer_causal_after_topk", bug

    def lightning_indexer(config, tensors, query, key=None, *, mask=None, _original=mlx_call.lightning_indexer, **kw):
        result = _original(config, tensors, query, key, **kw)  # top-k over every key, the future's included
        sel, T = result["topk_indices"], query.shape[1]
        S_total = result["present_index_keys"].shape[1]
        future = sel > (mx.arange(T)[:, None] + S_total - T)  # then the causal mask: future slots dropped
        result["topk_indices"] = mx.where(future, -1, sel)
        return result

    monkeypatch.setattr(mlx_call, "lightning_indexer", lightning_indexer)


@pytest.mark.parametrize("bug", list(INDEXER_MUTANTS))
def test_an_indexer_porting_bug_planted_in_the_mlx_paths_fails(bug, monkeypatch):
    runs = [(INDEXER_MUTANTS[bug][1], path) for path in ("stages", "fused", "chunked")]
    if bug == "indexer_ignored":  # and the in-place cache, on the decode case (a decode step has no future key)
        runs.append(("indexer_dsa_decode", "in_place"))
    adapter = backends.load("mlx")
    _plant_indexer(bug, monkeypatch)
    results = [run_case(CASES[name], "mlx", dtype="float32", adapter=adapter, gradients=False, path=path)
               for name, path in runs]
    caught = [(r.case, r.path) for r in results if r is not None and r.status == STATUS_FAIL]
    assert caught == runs, (f"{bug}: caught on {caught} of {runs}: "
                            + "; ".join(f"{r.case}/{r.path} {r.status} {r.message}" for r in results if r is not None))
    print(f"{bug}: " + ", ".join(f"{r.case}/{r.path} margin {r.margin:.3g} ({r.worst.name})" for r in results))


def test_the_indexer_through_the_layer_and_an_in_place_cache():
    """The layer takes return_selection= and past_index_keys=; an in-place cache writes the caller's index-key
    buffer (mx.array) at P..P+S-1 and returns it whole; the fp8 scoring is refused by name (MLX has no float8)."""
    import impl_numpy
    from impl_mlx import MultiHeadAttention, multi_head_attention
    from impl_mlx.indexer import lightning_indexer

    case = CASES["indexer_dsa_decode"]
    tensors, inputs = make_tensors(case), make_inputs(case)  # float64
    P, S = inputs["past_key"].shape[2], inputs["query"].shape[1]
    kw = dict(is_causal=True, causal_alignment="bottom_right")
    want, want_sel, *_, want_pik = impl_numpy.multi_head_attention(
        case.config, tensors, inputs["query"], inputs["key"], inputs["value"], past_key=inputs["past_key"],
        past_value=inputs["past_value"], past_index_keys=inputs["past_index_keys"], return_selection=True,
        return_cache=True, **kw)
    layer = MultiHeadAttention(case.config, tensors)
    out, sel = layer(inputs["query"], inputs["key"], inputs["value"], past_key=inputs["past_key"],
                     past_value=inputs["past_value"], past_index_keys=inputs["past_index_keys"], return_selection=True,
                     **kw)
    np.testing.assert_array_equal(np.array(sel), want_sel)  # the reference's keys (no near tie: test_indexer_call)
    # 1e-12: float64 both, the same stages in another order of rounding (float64's unit 1.1e-16: 10^4 of them),
    # where attending to another selection is off by ~1e-2 (the case's dense output differs by more than 1e-3)
    assert np.abs(np.array(out) - want).max() < 1e-12
    buffers = []
    for name, axis in (("past_key", 2), ("past_value", 2), ("past_index_keys", 1)):
        shape = list(inputs[name].shape)
        shape[axis] = P + S + 2
        buffer = np.zeros(shape)
        buffer[(slice(None),) * axis + (slice(0, P),)] = inputs[name]
        buffers.append(mx.array(buffer, dtype=mx.float64))
    out, _, _, pik = multi_head_attention(case.config, tensors, inputs["query"], inputs["key"], inputs["value"],
                                          past_key=buffers[0], past_value=buffers[1], past_index_keys=buffers[2],
                                          cache_length=P, return_cache=True, **kw)
    assert pik is buffers[2]  # the caller's own array, written
    assert np.abs(np.array(pik)[:, :P + S] - want_pik).max() < 1e-12 and not np.array(pik)[:, P + S:].any()
    assert np.abs(np.array(out) - want).max() < 1e-12
    with pytest.raises(ValueError, match="past_index_keys with cache_length is written in place: it must be an "
                                         "mx.array of the storage dtype float64: got a ndarray"):
        multi_head_attention(case.config, tensors, inputs["query"], inputs["key"], inputs["value"],
                             past_key=buffers[0], past_value=buffers[1], past_index_keys=np.array(buffers[2]),
                             cache_length=P, **kw)
    with pytest.raises(ValueError, match=r"precision fp8_e4m3 needs a float8 e4m3 type \(mx.float8_e4m3fn\), which MLX"):
        lightning_indexer(case.config, tensors, inputs["query"], precision="fp8_e4m3")


def test_the_indexers_top_k_keeps_the_tie_rule():
    """impl_mlx.indexer's select_topk and expand_blocks against the spec's (impl_numpy.indexer) on scores full of
    ties and -inf (integers 0..2, a third masked; blocks of 3 with local blocks): equal scores in ascending key
    index (the contract's tie rule: mx.argsort's stable order, as its docstring states from MLX 0.32)."""
    from impl_mlx import indexer as mlx_indexer
    from impl_numpy import indexer as spec

    rng = np.random.default_rng(0)
    x = rng.integers(0, 3, (2, 2, 6, 13)).astype(np.float32)
    x[rng.random(x.shape) < 0.3] = -np.inf
    for k in (1, 4, 13, 20):
        np.testing.assert_array_equal(np.array(mlx_indexer.select_topk(mx.array(x), k)), spec.select_topk(x, k))
    allowed = np.isfinite(x[:, :1])  # (B, 1, T, S)
    bx = spec.keep_local_blocks(spec.block_scores(x, 3), np.arange(6) + 7, 3, 2)
    mx_bx = mlx_indexer.keep_local_blocks(mlx_indexer.block_scores(mx.array(x), 3), np.arange(6) + 7, 3, 2)
    np.testing.assert_array_equal(np.array(mx_bx), bx)  # exact: maxima of the same values, no arithmetic
    blocks = spec.select_topk(bx, 2)
    np.testing.assert_array_equal(np.array(mlx_indexer.expand_blocks(mx.array(blocks), 3, mx.array(allowed), 13)),
                                  spec.expand_blocks(blocks, 3, allowed, 13))


@pytest.mark.parametrize("name", list(indexer_refusals()))
def test_indexer_refusals_in_the_contracts_words(name):
    """A layer with an indexer: its cache's index keys required and sized, topk_indices refused beside it."""
    changes, message = indexer_refusals()[name]
    with pytest.raises(ValueError, match=message):
        backends.load("mlx").forward(*indexer_call(changes))


# -- mha bench ---------------------------------------------------------------------------------------------

def test_mha_bench_times_the_mlx_paths(tmp_path, capsys):
    """`mha bench --quick --backends mlx`: every path timed, and what was timed computed the attention (its
    output against impl_numpy's; mlx has no target set, so none is judged for it)."""
    import json

    from conformance.cli import main

    out = tmp_path / "bench.json"
    assert main(["bench", "--quick", "--backends", "mlx", "--shapes", "bert-base", "decode", "--json", str(out)]) == 0
    capsys.readouterr()
    data = json.loads(out.read_text())
    rows = data["results"]
    assert data["backends"]["mlx"]["status"] == "ok" and rows
    assert {r["path"] for r in rows} >= {"ours", "native.sdpa", "ours.vjp", "ours.in_place", "cache.read"}, rows
    for r in rows:
        assert r["status"] == "ok", r
        if r["max_abs_diff_vs_numpy"] is not None:  # a sanity check of what was timed: float32 vs float32
            assert r["max_abs_diff_vs_numpy"] <= 1e-3 * max(1.0, r["reference_max_abs"]), r
    assert not [t for t in data["targets"] if t["backend"] == "mlx"]


# -- mha check --conventions ---------------------------------------------------------------------------------

def test_the_conventions_table_measures_mlx_sdpa_as_recorded():
    """mx.fast.scaled_dot_product_attention's row of the conventions table: mask polarity, the fully masked
    row, causal alignment for T != S, and the float32 matmul, measured and matching conventions/expected.json."""
    from conformance.native import conventions as conv

    api = next(a for a in conv.APIS if a.framework == "mlx")
    data = conv.measure(apis=(api,), modern_apis=(), packed_apis=(), alibi_apis=())
    (row,) = [r for r in data["rows"] if r["api"] == api.name]
    assert row["status"] == "measured", row
    assert (row["mask_true_means"], row["fully_masked_row"], row["causal_T2_S4"], row["causal_T4_S2"]) == (
        "attend", "mean of V (uniform)", "bottom_right", "bottom_right"), row
    assert row["float32_matmul"]["cpu"]["label"] == "float32", row["float32_matmul"]
    assert not conv.disagreements(data), conv.disagreements(data)
    assert f"| {api.name} |" in conv.to_markdown(data)


# -- each path runs its own core, and a bug in one fast path fails that column alone (tests/test_check_paths.py) --

def test_each_path_runs_its_own_core_and_the_stages_do_not(monkeypatch):
    from impl_mlx import attention

    adapter = backends.load("mlx")
    assert tuple(adapter.PATHS) == ("stages", "fused", "chunked", "in_place") and adapter.FAST_PATH == "fused"
    assert check.paths_of(adapter, check.DEFAULT_PATH_KINDS) == ["stages", "fused", "in_place"]
    calls: dict[str, int] = {}
    for path, function in (("fused", "sdpa_attend"), ("chunked", "chunked_attention")):
        original = getattr(attention, function)

        def spy(*args, _original=original, _path=path, **kwargs):
            calls[_path] = calls.get(_path, 0) + 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(attention, function, spy)
    for path in adapter.PATHS:  # decode_cache has a cache: every path exists for it
        calls.clear()
        result = run_case(CASES["decode_cache"], "mlx", dtype="float32", adapter=adapter, path=path)
        assert result.status == STATUS_PASS and result.path == path, (path, result.message)
        if path == "stages":
            assert not calls, f"the stages path called the cores of {sorted(calls)}"
        elif path in ("fused", "chunked"):
            assert calls.get(path), f"the {path} path never called its core; calls {calls}"
        else:  # the in-place cache runs on the fused kernel (the plain call's path)
            assert calls.get("fused"), calls


def test_a_bug_in_the_fused_path_fails_its_column_and_only_it(monkeypatch):
    """The fused kernel's scale 10% off, the stages untouched: only the fused column sees it (the in-place
    cache runs on the fused kernel too)."""
    from impl_mlx import attention

    original = attention.sdpa_attend
    monkeypatch.setattr(attention, "sdpa_attend", lambda config, q, k, v, **kw: original(
        dataclasses.replace(config, scale=config.effective_scale * 1.1), q, k, v, **kw))
    cases = ("self_basic", "mask_and_bias_causal", "gqa", "decode_cache", "qk_norm_rms_head")
    results, skipped = check.run_check(["mlx"], dtypes=["float32"], case_names=list(cases), jobs=1, progress=False)
    assert not skipped, skipped
    by_path: dict[str, set] = {}
    for r in results:
        by_path.setdefault(r.path, set()).add((r.case, r.status))
    assert by_path["fused"] == {(c, STATUS_FAIL) for c in cases}, by_path["fused"]
    assert by_path["stages"] == {(c, STATUS_PASS) for c in cases}, by_path["stages"]
    assert by_path["in_place"] == {("decode_cache", STATUS_FAIL)}, by_path["in_place"]
