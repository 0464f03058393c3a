"""impl_torch against the float64 NumPy reference, on the named case grid.

Tolerances come only from conformance.suite.tolerance (the one policy); nothing
here picks a number. Bit-exact properties (round trips, mask builders,
error wording) are compared exactly, with the differing values in the message.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch not installed: pip install -c constraints/cpu.txt '.[torch]'")

from reference_checks import (  # noqa: E402
    MASK_BUILDER_BAD_CALLS,
    WithOptions,
    assert_case_conforms,
    assert_gradients_conform,
    assert_nan_rows,
    assert_spec_gradients,
    bad_calls,
    bias_masked_rows_call,
    error_of,
    nan_key_call,
)

import impl_numpy  # noqa: E402
import impl_numpy.adapter as numpy_adapter  # noqa: E402
import impl_torch  # noqa: E402
import impl_torch.adapter as torch_adapter  # noqa: E402
import impl_torch.functional as torch_functional  # noqa: E402
import impl_torch.sdpa as torch_sdpa  # noqa: E402
import weights  # noqa: E402
from conformance.suite.cases import (  # noqa: E402
    CASES,
    DTYPE_NAMES,
    MHA_CASES,
    cast_inputs,
    cast_tensors,
    make_inputs,
    make_tensors,
    output_cotangent,
)
from conformance.suite.tolerance import assert_close, max_finite_abs  # noqa: E402
from impl_torch.convert import to_numpy, to_torch  # noqa: E402
from weights.call import OPTIONAL_STAGES  # noqa: E402

pytestmark = pytest.mark.torch

LOW_PRECISION = ("float16", "bfloat16")
NO_CUDA = "no CUDA GPU: torch.cuda.is_available() is False"

# Cases that can run through SDPA: every one without an explicit dropout mask.
SDPA_CASES = [name for name, case in MHA_CASES.items() if not case.training]

# -- references and results, computed once per (case, dtype) -----------------------------

@functools.cache
def reference(name: str):
    """float64 NumPy reference: forward with trace, vjp."""
    case = CASES[name]
    tensors, inputs = make_tensors(case), make_inputs(case)
    fwd = numpy_adapter.forward(case.config, tensors, inputs, case.options("float64"), trace=True)
    vjp = numpy_adapter.vjp(case.config, tensors, inputs, case.options("float64"), output_cotangent(case))
    return fwd, vjp


def logits_of(name: str) -> np.ndarray:
    return dict(reference(name)[0]["trace"])["logits"]


def max_error(actual, expected) -> float:
    diff = np.abs(np.asarray(actual, np.float64) - np.asarray(expected, np.float64))
    finite = diff[np.isfinite(diff)]
    return float(finite.max()) if finite.size else 0.0


@functools.cache
def same_precision_errors(name: str, dtype: str) -> dict[str, float] | None:
    """Per compared tensor: max abs error of the NumPy reference run in `dtype`
    against float64 (the policy's floor for float16 / bfloat16)."""
    if dtype not in LOW_PRECISION:
        return None
    case = CASES[name]
    tensors, inputs = cast_tensors(make_tensors(case), dtype), cast_inputs(make_inputs(case), dtype)
    fwd = numpy_adapter.forward(case.config, tensors, inputs, case.options(dtype))
    vjp = numpy_adapter.vjp(case.config, tensors, inputs, case.options(dtype), output_cotangent(case))
    ref_fwd, ref_vjp = reference(name)
    errors = {q: max_error(fwd[q], ref_fwd[q]) for q in ("output", "weights") if q in fwd}
    errors.update({f"grad.{g}": max_error(vjp["grads"][g], ref_vjp["grads"][g]) for g in vjp["grads"]})
    return errors


@functools.cache
def torch_run(name: str, dtype: str, use_sdpa: bool = False):
    case = CASES[name]
    tensors, inputs = cast_tensors(make_tensors(case), dtype), cast_inputs(make_inputs(case), dtype)
    options = dict(case.options(dtype), use_sdpa=use_sdpa)
    if use_sdpa:
        options["return_weights"] = False
    fwd = torch_adapter.forward(case.config, tensors, inputs, options)
    vjp = torch_adapter.vjp(case.config, tensors, inputs, options, output_cotangent(case))
    return fwd, vjp


def check(label, actual, expected, *, name, dtype, quantity, spe_key, precision="highest"):
    """assert_close under the policy; returns the failure text or None."""
    case = CASES[name]
    spe = same_precision_errors(name, dtype)
    try:
        assert_close(f"{name}/{dtype}/{label}", actual, expected, config=case.config, dtype=dtype, quantity=quantity,
                     B=case.B, T=case.T, S=case.S_total, logits=logits_of(name), precision=precision,
                     same_precision_error=None if spe is None else spe[spe_key])
    except AssertionError as err:
        return str(err)
    return None


def check_grads(name, dtype, grads, *, skip=()):
    expected = reference(name)[1]["grads"]
    assert list(grads) == list(expected), f"gradient names {list(grads)} != reference {list(expected)}"
    failures = [check(f"grad.{g}", grads[g], expected[g], name=name, dtype=dtype, quantity="grad", spe_key=f"grad.{g}")
                for g in expected if g not in skip]
    return [f for f in failures if f]


# -- forward, weights, gradients over every case and dtype --------------------------------

@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("name", list(MHA_CASES))
def test_case_matches_reference(name, dtype):
    """Output, weights and every gradient, judged exactly as `mha check` does."""
    assert_case_conforms(CASES[name], dtype, "torch", torch_adapter)
    fwd, vjp = torch_run(name, dtype)
    assert np.array_equal(vjp["output"], fwd["output"], equal_nan=True), (
        f"vjp's output differs from forward's by {max_error(vjp['output'], fwd['output']):.3g}")


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_self_attention_without_key_and_dtype_option(dtype):
    """key and value default to the query (their gradients fold into it), and
    options["dtype"] recasts float64 tensors and inputs, as in the reference."""
    case = CASES["self_basic"]
    tensors, inputs = make_tensors(case), {"query": make_inputs(case)["query"]}
    options, d_out = case.options(dtype), output_cotangent(case)
    same_dtype = numpy_adapter.vjp(case.config, tensors, inputs, options, d_out)
    want = numpy_adapter.vjp(case.config, tensors, inputs, case.options("float64"), d_out)
    magnitudes = impl_numpy.multi_head_attention_vjp(case.config, tensors, inputs["query"], d_output=d_out,
                                                     gradient_magnitudes=True)[2]
    got = torch_adapter.vjp(case.config, tensors, inputs, options, d_out)
    assert list(got["grads"]) == list(want["grads"]), f"{list(got['grads'])} != {list(want['grads'])}"
    failures = []
    for g, expected in want["grads"].items():
        want_dtype = same_dtype["grads"][g].dtype
        assert got["grads"][g].dtype == want_dtype, f"grad {g}: dtype {got['grads'][g].dtype} != {want_dtype}"
        try:
            assert_close(f"self_basic key=None/{dtype}/grad.{g}", got["grads"][g], expected, config=case.config,
                         dtype=dtype, quantity="grad", B=case.B, T=case.T, S=case.S_total, logits=logits_of(case.name),
                         scale_floor=max_finite_abs(magnitudes[g]))
        except AssertionError as err:
            failures.append(str(err))
    assert not failures, "\n".join(failures)


def test_trace_stages_match_reference_stage_by_stage():
    name = "mask_and_bias_causal"
    case = CASES[name]
    got = torch_adapter.forward(case.config, make_tensors(case), make_inputs(case), case.options("float64"), trace=True)
    ref = reference(name)[0]["trace"]
    plain = [s for s in impl_numpy.STAGES if s not in OPTIONAL_STAGES]
    assert [s for s, _ in got["trace"]] == plain == [s for s, _ in ref], (
        f"stages {[s for s, _ in got['trace']]} != {plain}")
    assert impl_torch.STAGES == impl_numpy.STAGES, f"{impl_torch.STAGES} != {impl_numpy.STAGES}"
    failures = []
    for (stage, value), (_, expected) in zip(got["trace"], ref):
        try:
            with np.errstate(invalid="ignore"):  # the mask stage holds -inf on both sides: inf - inf in compare
                assert_close(stage, value, expected, config=case.config, dtype="float64", quantity="stage", B=case.B,
                             T=case.T, S=case.S_total, logits=logits_of(name))
        except AssertionError as err:
            failures.append(str(err))
    assert not failures, "\n".join(failures)


# -- SDPA ------------------------------------------------------------------------------

@pytest.fixture
def sdpa_calls(monkeypatch):
    """Count SDPA calls and refuse any attn_mask row with no allowed key."""
    calls = []
    real = torch_sdpa.nnF.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        if attn_mask is not None:
            allowed = attn_mask if attn_mask.dtype == torch.bool else attn_mask > float("-inf")
            empty = int((~allowed.any(dim=-1)).sum())
            assert empty == 0, f"SDPA received {empty} rows with no allowed key"
        calls.append(kw)
        return real(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(torch_sdpa.nnF, "scaled_dot_product_attention", spy)
    return calls


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("name", SDPA_CASES)
def test_sdpa_path_matches_reference(name, dtype, sdpa_calls):
    case = dataclasses.replace(CASES[name], return_weights=False)
    assert_case_conforms(case, dtype, "torch", WithOptions(torch_adapter, use_sdpa=True))
    # Softcap and sinks have no SDPA form: such a call takes the stages (attention.py).
    expected = 0 if case.config.logit_softcap is not None or case.config.use_sinks else 2
    assert len(sdpa_calls) == expected, (
        f"SDPA called {len(sdpa_calls)} times for {name} (forward + vjp), expected {expected}")


@pytest.mark.parametrize("name", SDPA_CASES)
def test_sdpa_path_matches_explicit_path_in_float64(name):
    case = CASES[name]
    explicit = torch_run(name, "float64")[0]["output"]
    sdpa = torch_run(name, "float64", use_sdpa=True)[0]["output"]
    assert_close(f"{name}: sdpa vs explicit", sdpa, explicit, config=case.config, dtype="float64", quantity="output",
                 B=case.B, T=case.T, S=case.S_total, logits=logits_of(name))


def test_sdpa_not_used_when_weights_trace_or_dropout_mask_are_needed(sdpa_calls):
    for name, overrides in (("self_basic", {"return_weights": True}), ("dropout_train", {})):
        case = CASES[name]
        options = dict(case.options("float32"), use_sdpa=True, **overrides)
        torch_adapter.forward(case.config, make_tensors(case), make_inputs(case), options)
    case = CASES["no_weights"]
    torch_adapter.forward(case.config, make_tensors(case), make_inputs(case),
                          dict(case.options("float32"), use_sdpa=True), trace=True)
    assert sdpa_calls == [], f"SDPA was called {len(sdpa_calls)} times where the explicit path was required"


def test_sdpa_plain_causal_uses_sdpa_is_causal(sdpa_calls):
    case = CASES["causal_top_left"]  # T=4 < S=6: SDPA's is_causal is top-left, as the case
    torch_adapter.forward(case.config, make_tensors(case), make_inputs(case),
                          dict(case.options("float64"), use_sdpa=True, return_weights=False))
    assert [c.get("is_causal") for c in sdpa_calls] == [True], f"SDPA calls: {sdpa_calls}"


def test_sdpa_plain_causal_builds_no_causal_mask(monkeypatch):
    """SDPA's is_causal does the masking, so the (T, S) boolean mask (64 MiB at
    the bench's long shape) is never built; a bottom-right case with T != S
    still builds it, as SDPA cannot express that alignment."""
    built = []
    real = torch_functional.causal_mask
    monkeypatch.setattr(torch_functional, "causal_mask", lambda *a, **k: built.append(a) or real(*a, **k))
    for name, expect_built in (("causal_top_left", False), ("causal_bottom_right", True)):
        built.clear()
        case = CASES[name]
        torch_adapter.forward(case.config, make_tensors(case), make_inputs(case),
                              dict(case.options("float64"), use_sdpa=True, return_weights=False))
        assert bool(built) == expect_built, f"{name}: causal_mask built {len(built)} times"


def test_measured_sdpa_on_cpu_returns_zero_for_fully_masked_rows():
    """What docs/conventions.md records for torch 2.13 on CPU. impl_torch
    does not rely on it (those rows never reach SDPA); if this starts failing,
    docs/conventions.md is stale."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 3, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    allowed = torch.ones(1, 1, 3, 3, dtype=torch.bool)
    allowed[0, 0, 1] = False
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    row = out[0, :, 1]
    assert bool((row == 0).all()), f"SDPA on CPU gave {row.tolist()} for a fully masked row, CONVENTIONS.md says 0"


# -- masks -----------------------------------------------------------------------------

@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_causal_mask_equals_reference(alignment):
    for T in range(1, 7):
        for S in range(1, 7):
            got = impl_torch.causal_mask(T, S, alignment).numpy()
            want = impl_numpy.causal_mask(T, S, alignment)
            assert got.dtype == want.dtype and np.array_equal(got, want), (
                f"causal_mask({T}, {S}, {alignment!r}): differs at {np.argwhere(got != want).tolist()}")


def test_padding_mask_equals_reference():
    for lengths, S in (([3, 0, 5], 5), ([1], 1), ([2, 2], 4), (np.array([4, 1], np.int32), 4)):
        got = impl_torch.padding_mask(lengths, S).numpy()
        want = impl_numpy.padding_mask(np.asarray(lengths), S)
        assert got.shape == want.shape and np.array_equal(got, want), (
            f"padding_mask({lengths}, {S}): torch {got.astype(int).tolist()}, numpy {want.astype(int).tolist()}")


@pytest.mark.parametrize("call", list(MASK_BUILDER_BAD_CALLS.values()), ids=list(MASK_BUILDER_BAD_CALLS))
def test_mask_builder_errors_match_reference(call):
    fn, args, kwargs = call
    got = error_of(getattr(impl_torch, fn), *args, **kwargs)
    want = error_of(getattr(impl_numpy, fn), *args, **kwargs)
    assert got == want, f"torch: {got!r}\nnumpy: {want!r}"


# -- error wording ---------------------------------------------------------------------

BAD_CALLS = bad_calls()


@pytest.mark.parametrize("bad", list(BAD_CALLS))
def test_error_wording_matches_reference(bad):
    config = weights.AttentionConfig(num_heads=2, query_dim=8, head_dim=4, dropout=0.1)
    tensors = weights.init(config, seed=0, dtype="float64")
    call = dict(query=np.random.default_rng(1).standard_normal((2, 5, 8)))
    call.update(BAD_CALLS[bad])
    query = call.pop("query")
    want = error_of(impl_numpy.multi_head_attention, config, tensors, query, **call)
    torch_call = {k: (to_torch(v) if isinstance(v, np.ndarray) else v) for k, v in call.items()}
    torch_tensors = {name: to_torch(t) for name, t in tensors.items()}
    got = error_of(impl_torch.multi_head_attention, config, torch_tensors, to_torch(query), **torch_call)
    assert got == want, f"functional:\ntorch: {got!r}\nnumpy: {want!r}"
    layer = impl_torch.MultiHeadAttention.from_tensors(config, tensors)
    # The layer has no dtype argument, and in training without a mask or seed
    # it draws a seed from torch's generator (nn.Dropout's behaviour).
    if bad not in ("dtype_name", "training_without_mask_or_seed"):
        got_layer = error_of(layer, to_torch(query), **torch_call)
        assert got_layer == want, f"layer:\ntorch: {got_layer!r}\nnumpy: {want!r}"


def test_tensor_errors_match_reference():
    config = weights.AttentionConfig(num_heads=2, query_dim=8, head_dim=4)
    tensors = weights.init(config, seed=0, dtype="float32")
    query = np.zeros((1, 3, 8), np.float32)
    broken = dict(tensors)
    del broken["key.bias"]
    broken["extra"] = np.zeros(3, np.float32)
    broken["query.kernel"] = np.zeros((8, 2, 5), np.float32)
    broken["value.bias"] = broken["value.bias"].astype(np.float64)
    want = error_of(impl_numpy.multi_head_attention, config, broken, query)
    got = error_of(impl_torch.multi_head_attention, config, {k: to_torch(v) for k, v in broken.items()},
                   to_torch(query))
    assert got == want, f"torch: {got!r}\nnumpy: {want!r}"


# -- the layer -------------------------------------------------------------------------

LAYER_CASES = ["cross_dims", "gqa", "value_head_dim", "no_biases", "out_dim"]


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("name", LAYER_CASES)
def test_layer_round_trip_is_bit_exact(name, dtype):
    case = CASES[name]
    tensors = weights.init(case.config, seed=3, dtype=dtype)
    back = impl_torch.MultiHeadAttention.from_tensors(case.config, tensors).to_tensors()
    assert list(back) == list(tensors), f"names {list(back)} != {list(tensors)}"
    for key, original in tensors.items():
        got = back[key]
        assert got.dtype == original.dtype and got.shape == original.shape, (
            f"{key}: {got.dtype}{got.shape} != {original.dtype}{original.shape}")
        same = got.view(np.uint8) == original.view(np.uint8)
        assert same.all(), f"{key}: {int((~same).sum())} bytes differ after the round trip"
        assert weights.tensor_sha256(got) == weights.tensor_sha256(original), f"{key}: sha256 differs"


def test_layer_from_file_matches_reference(tmp_path):
    case = CASES["mask_and_bias_causal"]
    tensors, inputs = make_tensors(case), make_inputs(case)
    path = tmp_path / "w.safetensors"
    weights.save(path, case.config, tensors)
    layer = impl_torch.MultiHeadAttention.from_file(path)
    assert not layer.training, "from_file should return the layer in eval mode"
    out = layer(to_torch(inputs["query"]), to_torch(inputs["key"]), to_torch(inputs["value"]),
                mask=to_torch(inputs["mask"]), bias=to_torch(inputs["bias"]), is_causal=True)
    assert_close("layer vs reference", to_numpy(out), reference(case.name)[0]["output"], config=case.config,
                 dtype="float64", quantity="output", B=case.B, T=case.T, S=case.S_total, logits=logits_of(case.name))


def canonical_grads(layer) -> dict[str, np.ndarray]:
    """The layer's parameter gradients (nn.Linear, norm modules, sinks) in the canonical layout."""
    from impl_torch.layer import _layout

    out = {}
    for name, (module, param, shape) in _layout(layer.config).items():
        grad = getattr(getattr(layer, module) if module else layer, param).grad
        out[name] = to_numpy((grad.T if name.endswith(".kernel") else grad).reshape(shape))
    return out


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("name", ["gqa", "masked_rows_uniform", "dropout_train"])
def test_layer_parameter_gradients_match_reference(name, dtype):
    case = CASES[name]
    inputs = cast_inputs(make_inputs(case), dtype)
    layer = impl_torch.MultiHeadAttention.from_tensors(case.config, cast_tensors(make_tensors(case), dtype))
    xs = {k: to_torch(inputs[k]).requires_grad_(True) for k in ("query", "key", "value")}
    extra = {k: to_torch(inputs[k]) for k in ("mask", "bias", "dropout_mask") if k in inputs}
    out = layer(xs["query"], xs["key"], xs["value"], is_causal=case.is_causal, causal_alignment=case.causal_alignment,
                training=case.training, **extra)
    out.backward(to_torch(output_cotangent(case)).to(out.dtype))
    grads = {k: to_numpy(x.grad) for k, x in xs.items()} | canonical_grads(layer)
    assert_gradients_conform(case, dtype, grads)


def test_layer_training_mode_follows_module_and_torch_seed():
    case = CASES["dropout_train"]
    inputs = make_inputs(case)
    layer = impl_torch.MultiHeadAttention.from_tensors(case.config, make_tensors(case))
    q, k, v = (to_torch(inputs[n]) for n in ("query", "key", "value"))
    evaluated = layer(q, k, v)
    layer.train()
    torch.manual_seed(5)
    first = layer(q, k, v)
    torch.manual_seed(5)
    again = layer(q, k, v)
    assert torch.equal(first, again), f"same torch seed, outputs differ by {float((first - again).abs().max()):.3g}"
    assert not torch.equal(first, evaluated), "training mode with dropout=0.25 gave the eval-mode output"
    explicit = layer(q, k, v, dropout_mask=to_torch(inputs["dropout_mask"]))
    assert_close("layer with the case's keep-mask", to_numpy(explicit), reference(case.name)[0]["output"],
                 config=case.config, dtype="float64", quantity="output", B=case.B, T=case.T, S=case.S_total,
                 logits=logits_of(case.name))


def test_seeded_dropout_equals_its_keep_mask():
    case = CASES["dropout_train"]
    inputs = make_inputs(case)
    options = dict(case.options("float64"), seed=11)
    no_mask = {k: v for k, v in inputs.items() if k != "dropout_mask"}
    seeded = torch_adapter.forward(case.config, make_tensors(case), no_mask, options)["output"]
    keep = torch_functional.dropout_keep_mask((case.B, case.config.num_heads, case.T, case.S), case.config.dropout,
                                              11, torch.device("cpu"))
    explicit = torch_adapter.forward(case.config, make_tensors(case), dict(no_mask, dropout_mask=keep.numpy()),
                                     options)["output"]
    assert np.array_equal(seeded, explicit), f"seed vs its keep-mask: max abs diff {max_error(seeded, explicit):.3g}"


# -- devices, precision ------------------------------------------------------------------

def test_devices_and_gpu_error():
    assert torch_adapter.NAME == "torch", torch_adapter.NAME
    if torch.cuda.is_available():
        assert torch_adapter.devices() == ["cpu", "gpu"], torch_adapter.devices()
        return
    assert torch_adapter.devices() == ["cpu"], torch_adapter.devices()
    case = CASES["self_basic"]
    message = error_of(torch_adapter.forward, case.config, make_tensors(case), make_inputs(case), {}, device="gpu")
    assert message == "device gpu requested but torch sees no CUDA GPU (torch.cuda.is_available() is False)", message
    message = error_of(torch_adapter.forward, case.config, make_tensors(case), make_inputs(case), {}, device="tpu")
    assert message == "device must be one of cpu, gpu: got 'tpu'", message


def test_precision_is_set_for_the_call_and_restored():
    flags = lambda: (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,  # noqa: E731
                     torch.get_float32_matmul_precision())
    before = flags()
    with impl_torch.matmul_precision("highest"):
        assert flags() == (False, False, "highest"), flags()
    assert flags() == before, f"{flags()} != {before}"
    with impl_torch.matmul_precision("tf32"):
        assert flags() == (True, True, "high"), flags()
    assert flags() == before, f"{flags()} != {before}"
    message = error_of(impl_torch.matmul_precision("bf16").__enter__)
    assert message == "precision must be one of highest, tf32: got 'bf16'", message


# -- torch.compile, autocast -----------------------------------------------------------------

def test_torch_compile_full_graph_forward_and_backward():
    torch._dynamo.reset()
    name = "mask_and_bias_causal"
    case = CASES[name]
    inputs = make_inputs(case)
    layer = impl_torch.MultiHeadAttention.from_tensors(case.config, make_tensors(case))
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    query, key, value = (to_torch(inputs[n]).requires_grad_(True) for n in ("query", "key", "value"))
    out = compiled(query, key, value, mask=to_torch(inputs["mask"]), bias=to_torch(inputs["bias"]), is_causal=True)
    out.backward(to_torch(output_cotangent(case)))
    assert_close("compiled output", to_numpy(out), reference(name)[0]["output"], config=case.config, dtype="float64",
                 quantity="output", B=case.B, T=case.T, S=case.S_total, logits=logits_of(name))
    for label, x in (("query", query), ("key", key), ("value", value)):
        assert_close(f"compiled d_{label}", to_numpy(x.grad), reference(name)[1]["grads"][label], config=case.config,
                     dtype="float64", quantity="grad", B=case.B, T=case.T, S=case.S_total, logits=logits_of(name))


@pytest.mark.slow  # inductor's C++ build: ~45 s cold on 2 cores (aot_eager above covers capture and autograd)
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_torch_compile_inductor_forward():
    torch._dynamo.reset()
    name = "gqa"
    case = CASES[name]
    inputs = cast_inputs(make_inputs(case), "float32")
    layer = impl_torch.MultiHeadAttention.from_tensors(case.config, cast_tensors(make_tensors(case), "float32"))
    compiled = torch.compile(layer, fullgraph=True)
    with torch.no_grad():
        out = compiled(*(to_torch(inputs[n]) for n in ("query", "key", "value")))
    assert_close("inductor output", to_numpy(out), reference(name)[0]["output"], config=case.config, dtype="float32",
                 quantity="output", B=case.B, T=case.T, S=case.S_total, logits=logits_of(name))


@pytest.mark.parametrize("use_sdpa", [False, True], ids=["explicit", "sdpa"])
@pytest.mark.parametrize("name", ["mask_and_bias_causal", "gqa"])
def test_autocast_cpu_bfloat16(name, use_sdpa):
    case = CASES[name]
    inputs = cast_inputs(make_inputs(case), "float32")
    layer = impl_torch.MultiHeadAttention.from_tensors(case.config, cast_tensors(make_tensors(case), "float32"))
    extra = {k: to_torch(inputs[k]) for k in ("mask", "bias") if k in inputs}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(*(to_torch(inputs[n]) for n in ("query", "key", "value")), is_causal=case.is_causal,
                    causal_alignment=case.causal_alignment, use_sdpa=use_sdpa, **extra)
    assert out.dtype == torch.float32, f"output dtype {out.dtype}: stages store in the module's dtype"
    assert_close("autocast output", to_numpy(out), reference(name)[0]["output"], config=case.config, dtype="bfloat16",
                 quantity="output", B=case.B, T=case.T, S=case.S_total, logits=logits_of(name),
                 same_precision_error=same_precision_errors(name, "bfloat16")["output"])


# -- GPU ------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
@pytest.mark.parametrize("use_sdpa", [False, True], ids=["explicit", "sdpa"])
@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("name", ["mask_and_bias_causal", "masked_rows_nan", "causal_bottom_right_long_query",
                                  "masked_rows_uniform", "gqa", "large_logits"])
def test_gpu_matches_reference(name, dtype, use_sdpa):
    case = dataclasses.replace(CASES[name], return_weights=CASES[name].return_weights and not use_sdpa)
    assert_case_conforms(case, dtype, "torch", WithOptions(torch_adapter, use_sdpa=use_sdpa), device="gpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_gpu_layer_round_trip_and_tf32_policy():
    case = CASES["cross_dims"]
    tensors = cast_tensors(make_tensors(case), "float32")
    layer = impl_torch.MultiHeadAttention.from_tensors(case.config, tensors, device="gpu")
    assert layer.query.weight.device.type == "cuda", layer.query.weight.device
    back = layer.to_tensors()
    for key, original in tensors.items():
        assert np.array_equal(back[key].view(np.uint8), original.view(np.uint8)), f"{key}: round trip via cuda differs"
    inputs = cast_inputs(make_inputs(case), "float32")
    out = torch_adapter.forward(case.config, tensors, inputs, case.options("float32"), device="gpu",
                                precision="tf32")["output"]
    assert_close("tf32 output", out, reference(case.name)[0]["output"], config=case.config, dtype="float32",
                 quantity="output", B=case.B, T=case.T, S=case.S_total, logits=logits_of(case.name), precision="tf32")


def test_memory_guard_spares_the_sdpa_path(monkeypatch):
    """SDPA never forms the (B, N, T, S) scores, so the guard that refuses the
    explicit path must not refuse it (it did: T = S = 16384 was refused)."""
    from weights import contract

    monkeypatch.setattr(contract, "available_memory_bytes", lambda: 64 * 2**20)  # 64 MiB
    config = weights.AttentionConfig(num_heads=2, query_dim=4, head_dim=2)
    tensors = {n: torch.from_numpy(t) for n, t in weights.init(config, seed=0).items()}
    x = torch.zeros(1, 2048, 4)  # explicit path: (1, 2, 2048, 2048) float32 scores x 4 copies = 128 MiB
    with pytest.raises(ValueError, match="attention scores need about"):
        impl_torch.multi_head_attention(config, tensors, x)
    out = impl_torch.multi_head_attention(config, tensors, x, use_sdpa=True)
    assert tuple(out.shape) == (1, 2048, 4), f"SDPA output shape {tuple(out.shape)}"


@pytest.mark.parametrize("masked_row", ["zero", "uniform", "nan"])
@pytest.mark.parametrize("path", ["stages", "plain", "sdpa"])
def test_row_masked_by_bias_passes_the_spec_gradients(path, masked_row):
    """A row whose every key has bias -inf (no bool mask): autograd's gradients
    on each path (the stages with return_weights, the plain call, use_sdpa)
    equal impl_numpy's hand-written vjp in float64, NaN where it is NaN ("nan":
    the value gradient only, and only in batch 0, the one with an empty row) and
    nowhere else. Before the mask stage let a -inf bias join its select, "nan"
    put NaN in the query and key gradients; before its fill factor was 0 on
    the other rows, use_sdpa put NaN in batch 1's value gradient too."""
    config, tensors, (q, k, v), bias, d_out, want = bias_masked_rows_call(masked_row)
    xs = [torch.tensor(x, requires_grad=True) for x in (q, k, v)]
    out = impl_torch.multi_head_attention(config, {n: torch.tensor(t) for n, t in tensors.items()}, *xs,
                                          bias=torch.tensor(bias), return_weights=path == "stages",
                                          use_sdpa=path == "sdpa")
    (out[0] if path == "stages" else out).backward(torch.tensor(d_out))
    assert_spec_gradients({name: x.grad.numpy() for name, x in zip(("query", "key", "value"), xs)}, want)


@pytest.mark.parametrize("masked_row", ["zero", "uniform", "nan"])
@pytest.mark.parametrize("use_sdpa", [False, True])
def test_nan_value_reaches_fully_masked_rows_as_in_the_spec(use_sdpa, masked_row):
    """NaN in a value propagates (README): a fully masked row's weights (0 under
    "zero") meet it in the spec's attend, 0 * NaN, so that row's output is NaN
    too. The SDPA path, which fills such rows after the kernel, must give the
    same rows NaN as the float64 stages."""
    config = weights.AttentionConfig(num_heads=2, query_dim=8, head_dim=4, masked_row=masked_row)
    tensors = weights.init(config, seed=5, dtype="float64")
    rng = np.random.default_rng(5)
    q, k, v = rng.standard_normal((2, 5, 8)), rng.standard_normal((2, 6, 8)), rng.standard_normal((2, 6, 8))
    v[0, 4, 0] = np.nan  # batch 0, key 4's value; batch 1 has no NaN
    mask = np.ones((5, 6), bool)
    mask[1] = False  # row 1: no allowed key
    mask[3, 4] = False  # row 3 hides key 4 (its weight there is 0 too)
    want = impl_numpy.multi_head_attention(config, tensors, q, k, v, mask=mask, trace=[])  # the stages
    got = impl_torch.multi_head_attention(config, {n: torch.tensor(t) for n, t in tensors.items()},
                                          *(torch.tensor(x) for x in (q, k, v)), mask=torch.tensor(mask),
                                          use_sdpa=use_sdpa).numpy()
    want_rows, got_rows = np.isnan(want).any(axis=-1), np.isnan(got).any(axis=-1)  # (B, T)
    assert want_rows[0].all() and (want_rows[1] == (masked_row == "nan") * np.eye(5, dtype=bool)[1]).all(), (
        f"the reference itself: NaN rows {want_rows.tolist()}")
    assert np.array_equal(got_rows, want_rows), f"NaN rows {got_rows.tolist()}, the spec's {want_rows.tolist()}"


@pytest.mark.parametrize("kind", ["mask", "bias", "causal"])
@pytest.mark.parametrize("path", ["stages", "plain"])
def test_a_nan_key_reaches_exactly_the_rows_that_see_it(path, kind):
    """As the spec (tests/test_numpy_reference.py): a NaN in key 4 reaches only
    the rows that see key 4; a bool mask, a -inf bias and the causal mask each
    hide it. Not use_sdpa: SDPA's kernels add a mask as -inf, and NaN - inf is
    NaN, so there every row of a masked call is NaN (README)."""
    config, tensors, (q, k, v), options, sees_key = nan_key_call(kind)
    out = impl_torch.multi_head_attention(config, {n: torch.tensor(t) for n, t in tensors.items()},
                                          *(torch.tensor(x) for x in (q, k, v)),
                                          **{name: torch.tensor(a) if isinstance(a, np.ndarray) else a
                                             for name, a in options.items()},
                                          return_weights=path == "stages")
    assert_nan_rows((out[0] if path == "stages" else out).numpy(), sees_key)
