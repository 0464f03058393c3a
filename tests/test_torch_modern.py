"""impl_torch's modern attention (RoPE, QK-norm, softcap, windows, sinks, the
KV cache, segment ids) against the float64 NumPy reference.

The named modern cases of conformance/cases.py already run through
tests/test_torch.py's grid (every dtype, the stages and SDPA); this file adds
the combinations the grid leaves out, the stage-by-stage trace of the new
stages, token-by-token decoding with the cache, the layer's new parameters,
the routing between SDPA and the stages, and error wording. Expected values
come from impl_numpy in float64; tolerances from conformance.tolerance only.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch not installed: pip install -c constraints/cpu.txt '.[torch]'")

from modern_checks import (  # noqa: E402
    CROSS,
    DECODE,
    DECODE_CONFIGS,
    PROMPT,
    TOTAL,
    cfg,
    check_in_place_decode,
    decode_in_place,
    decode_reference,
    modern_bad_calls,
)
from reference_checks import WithOptions, assert_case_conforms, assert_gradients_conform, error_of  # noqa: E402

import impl_numpy  # noqa: E402
import impl_numpy.adapter as numpy_adapter  # noqa: E402
import impl_torch  # noqa: E402
import impl_torch.adapter as torch_adapter  # noqa: E402
import impl_torch.sdpa as torch_sdpa  # noqa: E402
import weights  # noqa: E402
from conformance.cases import (  # noqa: E402
    CASES,
    DTYPE_NAMES,
    Case,
    cast_inputs,
    cast_tensors,
    make_inputs,
    make_tensors,
    output_cotangent,
)
from conformance.compare import expected_for  # noqa: E402
from conformance.tolerance import assert_close  # noqa: E402
from impl_torch.convert import TORCH_DTYPES, to_numpy, to_torch  # noqa: E402

pytestmark = pytest.mark.torch

NO_CUDA = "no CUDA GPU: torch.cuda.is_available() is False"





# Combinations the named grid does not hold (names start with "torch_" so that no
# case of the grid shares their seeds).
EXTRA_CASES = {case.name: case for case in (
    Case("torch_qk_norm_rms_all", cfg(qk_norm={"type": "rms", "scope": "all"}), **CROSS),
    Case("torch_qk_norm_layer_head_gqa", cfg(num_heads=4, num_kv_heads=2, qk_norm={"type": "layer", "eps": 1e-5}),
         is_causal=True),
    Case("torch_rope_interleaved_partial_linear",
         cfg(head_dim=8, rope={"rotary_dim": 4, "interleaved": True, "scaling": {"type": "linear", "factor": 4.0}}),
         positions="far", is_causal=True),
    Case("torch_window_both_cache", cfg(window_left=2, window_right=0, rope={}), T=2, S=2, P=5, **DECODE),
    Case("torch_window_left_cross_top_left", cfg(window_left=1), **CROSS),
    Case("torch_sinks_cache_mqa_empty_rows",
         cfg(num_heads=4, num_kv_heads=1, use_sinks=True, masked_row="uniform", rope={"interleaved": True}),
         T=2, S=2, P=3, mask="empty_rows", **DECODE),
    Case("torch_softcap_window_segments", cfg(logit_softcap=3.0, window_left=1, rope={}), T=7, S=7,
         positions="packed", is_causal=True),
    Case("torch_window_segments_norm", cfg(window_left=2, window_right=1, qk_norm={"type": "rms"}, rope={}),
         T=7, S=7, positions="packed"),
    Case("torch_softcap_bias_sinks_gqa", cfg(num_heads=4, num_kv_heads=2, logit_softcap=4.0, use_sinks=True),
         bias="random", mask="random", **CROSS),
)}


def _uses_sdpa(config) -> bool:
    return config.logit_softcap is None and not config.use_sinks


# -- the extra combinations, every dtype, both paths ------------------------------------

@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("name", list(EXTRA_CASES))
@pytest.mark.parametrize("use_sdpa", [False, True], ids=["stages", "sdpa"])
def test_extra_modern_case_matches_reference(name, dtype, use_sdpa):
    """Output, weights (stages), present_key/value and every gradient (past_key and
    past_value included) judged as `mha check` judges them."""
    case = EXTRA_CASES[name]
    if use_sdpa:
        case = dataclasses.replace(case, return_weights=False)
    assert_case_conforms(case, dtype, "torch", WithOptions(torch_adapter, use_sdpa=use_sdpa))


def test_optional_inputs_are_the_signatures():
    """Every optional input of the contract (weights.call.OPTIONAL_INPUTS, which the adapters pass through
    by name) is a keyword of the mirror's call."""
    import inspect

    import impl_torch
    from weights.call import OPTIONAL_INPUTS

    missing = [name for name in OPTIONAL_INPUTS if name not in inspect.signature(impl_torch.multi_head_attention).parameters]
    assert not missing, f"impl_torch.multi_head_attention lacks {missing}"


@pytest.mark.parametrize("name", ["modern_everything", "decode_cache", "torch_window_both_cache"])
def test_answer_and_gradient_names_are_the_references(name):
    """forward's dict (output, weights, present_key, present_value) and vjp's grads
    (query, key, value, past_key, past_value, then every tensor) name and order
    their entries as impl_numpy.adapter does."""
    case = CASES.get(name) or EXTRA_CASES[name]
    tensors, inputs, options = make_tensors(case), make_inputs(case), case.options("float64")
    d_out = output_cotangent(case)
    want_fwd = numpy_adapter.forward(case.config, tensors, inputs, options)
    got_fwd = torch_adapter.forward(case.config, tensors, inputs, options)
    assert list(got_fwd) == list(want_fwd), f"forward names {list(got_fwd)} != reference {list(want_fwd)}"
    want = list(numpy_adapter.vjp(case.config, tensors, inputs, options, d_out)["grads"])
    got = list(torch_adapter.vjp(case.config, tensors, inputs, options, d_out)["grads"])
    assert got == want, f"gradient names {got} != reference {want}"
    assert "past_key" in got and "present_key" in got_fwd, f"{name} has a cache: grads {got}, answer {list(got_fwd)}"


# -- the trace, stage by stage ---------------------------------------------------------

@pytest.mark.parametrize("name", ["modern_everything", "qk_norm_layer_all", "qk_norm_rms_head", "softcap",
                                  "rope_partial", "rope_yarn", "torch_qk_norm_rms_all"])
def test_modern_trace_matches_reference_stage_by_stage(name):
    """The new stages appear under their exact names, in STAGES order, each equal
    to the reference's in float64 (norm on the flat projection in both scopes)."""
    case = CASES.get(name) or EXTRA_CASES[name]
    exp = expected_for(case, "float64")
    got = torch_adapter.forward(case.config, make_tensors(case), make_inputs(case), case.options("float64"),
                                trace=True)["trace"]
    got_names, want_names = [s for s, _ in got], [s for s, _ in exp["trace"]]
    assert got_names == want_names, f"stages {got_names} != reference {want_names}"
    assert got_names == [s for s in impl_torch.STAGES if s in got_names], f"{got_names} out of STAGES order"
    c = case.config
    wanted = {"query.norm", "key.norm"} if c.qk_norm else set()
    wanted |= {"query.rope", "key.rope"} if c.rope else set()
    wanted |= {"softcap"} if c.logit_softcap else set()
    assert wanted <= set(got_names), f"missing stages {sorted(wanted - set(got_names))}"
    failures = []
    for (stage, value), (_, expected) in zip(got, exp["trace"]):
        try:
            with np.errstate(invalid="ignore"):  # -inf on both sides of the mask stage
                assert_close(stage, value, expected, config=c, dtype="float64", quantity="stage", B=case.B, T=case.T,
                             S=case.S_total, logits=exp["logits"])
        except AssertionError as err:
            failures.append(str(err))
    assert not failures, "\n".join(failures)


# -- decoding token by token with the cache ------------------------------------------------





def _decode(config, tensors, x, *, use_sdpa: bool, layer: bool = False):
    """PROMPT tokens in one causal call, then one token at a time with the
    cache (bottom-right causal, default positions: P + arange(T)). -> output
    (B, TOTAL, O), present_key, present_value."""
    if layer:
        module = impl_torch.MultiHeadAttention.from_tensors(config, tensors)
        call = lambda q, **kw: module(q, use_sdpa=use_sdpa, **kw)  # noqa: E731
    else:
        params = {n: to_torch(t) for n, t in tensors.items()}
        call = lambda q, **kw: impl_torch.multi_head_attention(config, params, q, use_sdpa=use_sdpa, **kw)  # noqa: E731
    xt = to_torch(x)
    with torch.no_grad():
        out, pk, pv = call(xt[:, :PROMPT], is_causal=True, return_cache=True)
        rows = [out]
        for t in range(PROMPT, TOTAL):
            out, pk, pv = call(xt[:, t:t + 1], past_key=pk, past_value=pv, is_causal=True,
                               causal_alignment="bottom_right", return_cache=True)
            rows.append(out)
    return to_numpy(torch.cat(rows, dim=1)), to_numpy(pk), to_numpy(pv)


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("config_name", list(DECODE_CONFIGS))
@pytest.mark.parametrize("use_sdpa", [False, True], ids=["stages", "sdpa"])
def test_decoding_with_the_cache_equals_the_full_causal_call(config_name, dtype, use_sdpa):
    """Row for row: the prompt's rows and each decoded token's row equal the full
    causal call's, and the final cache its present_key / present_value."""
    config = DECODE_CONFIGS[config_name]
    tensors, x, want, logits, errors = decode_reference(config_name, dtype)
    got = dict(zip(("output", "present_key", "present_value"), _decode(config, tensors, x, use_sdpa=use_sdpa)))
    failures = []
    for name, value in got.items():
        try:
            assert_close(f"decoded {name}", value, want[name], config=config, dtype=dtype, quantity="output", B=2,
                         T=TOTAL, S=TOTAL, logits=logits, same_precision_error=errors.get(name))
        except AssertionError as err:
            failures.append(str(err))
    assert not failures, "\n".join(failures)


def test_layer_decodes_with_the_cache():
    config = DECODE_CONFIGS["everything"]
    tensors, x, want, logits, _ = decode_reference("everything", "float32")
    out, pk, _ = _decode(config, tensors, x, use_sdpa=False, layer=True)
    for name, value in (("output", out), ("present_key", pk)):
        assert_close(f"layer decoded {name}", value, want[name], config=config, dtype="float32", quantity="output",
                     B=2, T=TOTAL, S=TOTAL, logits=logits)


def test_decoding_with_explicit_positions_equals_the_defaults():
    """positions = P + arange(T) given explicitly is the default (the cache's offset)."""
    config = DECODE_CONFIGS["rope_norm_gqa"]
    tensors, x, *_ = decode_reference("rope_norm_gqa", "float64")
    params = {n: to_torch(t) for n, t in tensors.items()}
    xt = to_torch(x)
    _, pk, pv = impl_torch.multi_head_attention(config, params, xt[:, :PROMPT], is_causal=True, return_cache=True)
    step = dict(past_key=pk, past_value=pv, is_causal=True, causal_alignment="bottom_right")
    default = impl_torch.multi_head_attention(config, params, xt[:, PROMPT:PROMPT + 1], **step)
    given = impl_torch.multi_head_attention(config, params, xt[:, PROMPT:PROMPT + 1], **step,
                                            positions=torch.tensor([PROMPT]), key_positions=torch.tensor([PROMPT]))
    forgot = impl_torch.multi_head_attention(config, params, xt[:, PROMPT:PROMPT + 1], **step,
                                             positions=torch.tensor([0]), key_positions=torch.tensor([0]))
    assert torch.equal(default, given), f"explicit positions differ by {float((default - given).abs().max()):.3g}"
    assert not torch.allclose(default, forgot), "positions 0 (the offset forgotten) gave the same output"


# -- an in-place cache (cache_length=): the caller's buffers, written where the new keys go ---------------------

class _Buffer:
    """A torch buffer as modern_checks.decode_in_place holds it: that helper reads its results with
    np.asarray, and a torch tensor's own __array__ has no bfloat16 (to_numpy does)."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def __array__(self, dtype=None, copy=None):
        array = to_numpy(self.tensor)
        return array if dtype is None else array.astype(dtype)


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("config_name", list(DECODE_CONFIGS))
@pytest.mark.parametrize("use_sdpa", [False, True], ids=["stages", "sdpa"])
def test_decoding_in_place_equals_the_full_causal_call(config_name, dtype, use_sdpa):
    """A prompt and then one token at a time into one zeroed buffer pair, under torch.no_grad(): the rows
    equal the full causal call's (float64 reference), the buffers' first TOTAL positions its present cache,
    nothing written past them, and every step hands back the very tensors it was given."""
    config = DECODE_CONFIGS[config_name]
    tensors, x, want, logits, errors = decode_reference(config_name, dtype)
    params = {n: to_torch(t) for n, t in tensors.items()}

    def step(_, part, pk, pv, P):
        with torch.no_grad():
            out, k, v = impl_torch.multi_head_attention(
                config, params, to_torch(part), past_key=pk.tensor, past_value=pv.tensor, cache_length=P,
                is_causal=True, causal_alignment="bottom_right", return_cache=True, use_sdpa=use_sdpa)
        # the wrappers stand for the tensors: handed back only where the call returned those very tensors
        return to_numpy(out), pk if k is pk.tensor else _Buffer(k), pv if v is pv.tensor else _Buffer(v)

    outputs, pk, pv, same = decode_in_place(
        step, tensors, x, lambda shape: _Buffer(torch.zeros(shape, dtype=TORCH_DTYPES[dtype])))
    assert same, "a step returned a new tensor instead of the buffers it was given"

    def compare(name, got, expected):
        assert_close(f"in-place decoded {name}", got, expected, config=config, dtype=dtype, quantity="output", B=2,
                     T=TOTAL, S=TOTAL, logits=logits, same_precision_error=errors.get(name))

    check_in_place_decode(outputs, pk, pv, want, compare)


@pytest.mark.parametrize("T", [1, 2])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("use_sdpa", [False, True], ids=["stages", "sdpa"])
def test_an_in_place_cache_computes_what_the_cache_passed_whole_does(use_sdpa, dtype, T, sdpa_spy):
    """GQA, RoPE and a window, P = 6 cached positions and T new ones in buffers with 3 spare positions
    past them, filled with NaN to show that neither path reads them: the output equals the call with the
    cache passed whole (and the float64 reference within the policy), the buffers then hold its present
    cache, the spare positions are still NaN, and SDPA is handed views of the buffers (no copy)."""
    config = cfg(num_heads=4, num_kv_heads=2, rope={}, window_left=3, qk_norm={"type": "rms"})
    tensors = weights.init(config, seed=5, dtype="float64")
    rng = np.random.default_rng(5)
    B, P, spare, K, H = 2, 6, 3, 2, 4
    x = rng.standard_normal((B, T, 8))
    past = [rng.standard_normal((B, K, P, H)) for _ in range(2)]
    options = dict(is_causal=True, causal_alignment="bottom_right", return_cache=True)
    want = impl_numpy.multi_head_attention(config, tensors, x, past_key=past[0], past_value=past[1], **options)
    cast = lambda a: torch.from_numpy(a.astype(dtype))  # noqa: E731
    params = {n: cast(t) for n, t in tensors.items()}
    buffers = [torch.full((B, K, P + T + spare, H), float("nan"), dtype=TORCH_DTYPES[dtype]) for _ in range(2)]
    for buffer, cached in zip(buffers, past):
        buffer[:, :, :P] = cast(cached)
    with torch.no_grad():
        whole = impl_torch.multi_head_attention(config, params, cast(x), past_key=cast(past[0]),
                                                past_value=cast(past[1]), use_sdpa=use_sdpa, **options)
        del sdpa_spy[:]
        got = impl_torch.multi_head_attention(config, params, cast(x), past_key=buffers[0], past_value=buffers[1],
                                              cache_length=P, use_sdpa=use_sdpa, **options)
    assert got[1] is buffers[0] and got[2] is buffers[1], "the present cache is not the buffers given"
    assert torch.equal(got[0], whole[0]), (
        f"in place and whole differ by {float((got[0] - whole[0]).abs().max()):.3g}")
    for name, buffer, present in zip(("present_key", "present_value"), buffers, whole[1:]):
        assert torch.equal(buffer[:, :, :P + T], present), f"{name}: the buffer's first P+T positions"
        assert bool(torch.isnan(buffer[:, :, P + T:]).all()), f"{name}: a spare position was written"
    assert_close("in-place output", to_numpy(got[0]), want[0], config=config, dtype=dtype, quantity="output", B=B,
                 T=T, S=P + T)
    assert len(sdpa_spy) == (1 if use_sdpa else 0), f"SDPA calls: {sdpa_spy}"


def test_an_in_place_cache_hands_sdpa_views_of_the_buffers(monkeypatch):
    """A GQA decode step on the SDPA path attends over the buffers' first P+1 positions as they lie (same
    memory), and its query heads come as rows of their key head (no enable_gqa, so no kernel repeats the
    cache per query head)."""
    seen = []
    real = torch_sdpa.nnF.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        seen.append((tuple(q.shape), k.data_ptr(), v.data_ptr(), tuple(k.shape), kw.get("enable_gqa", False)))
        return real(q, k, v, **kw)

    monkeypatch.setattr(torch_sdpa.nnF, "scaled_dot_product_attention", spy)
    config = cfg(num_heads=4, num_kv_heads=2, rope={})
    params = {n: torch.from_numpy(t) for n, t in weights.init(config, seed=1, dtype="float32").items()}
    pk, pv = torch.zeros((1, 2, 10, 4)), torch.zeros((1, 2, 10, 4))
    with torch.no_grad():
        impl_torch.multi_head_attention(config, params, torch.ones((1, 1, 8)), past_key=pk, past_value=pv,
                                        cache_length=5, is_causal=True, causal_alignment="bottom_right",
                                        use_sdpa=True)
    assert seen == [((1, 2, 2, 4), pk.data_ptr(), pv.data_ptr(), (1, 2, 6, 4), False)], seen


@pytest.mark.parametrize("use_sdpa", [False, True], ids=["stages", "sdpa"])
def test_a_grouped_decode_step_with_a_per_head_bias_and_mask_equals_the_reference(use_sdpa):
    """One query per head over an in-place cache, GQA 4 on 2, with a bias and a mask that differ per query
    head: SDPA gets the query heads as rows of their key head, so the per-head bias and mask must follow
    them there (query head n on key head n // 2)."""
    config = cfg(num_heads=4, num_kv_heads=2, rope={})
    tensors = weights.init(config, seed=9, dtype="float64")
    rng = np.random.default_rng(9)
    B, P, K, H = 2, 7, 2, 4
    x = rng.standard_normal((B, 1, 8))
    past = [rng.standard_normal((B, K, P, H)) for _ in range(2)]
    bias = 2.0 * rng.standard_normal((B, 4, 1, P + 1))
    mask = rng.random((B, 4, 1, P + 1)) < 0.7
    mask[..., -1] = True  # no empty row: those take another path
    options = dict(is_causal=True, causal_alignment="bottom_right", bias=bias, mask=mask)
    want = impl_numpy.multi_head_attention(config, tensors, x, past_key=past[0], past_value=past[1], **options)
    buffers = [torch.zeros((B, K, P + 2, H), dtype=torch.float64) for _ in range(2)]
    for buffer, cached in zip(buffers, past):
        buffer[:, :, :P] = torch.from_numpy(cached)
    with torch.no_grad():
        got = impl_torch.multi_head_attention(
            config, {n: torch.from_numpy(t) for n, t in tensors.items()}, torch.from_numpy(x),
            past_key=buffers[0], past_value=buffers[1], cache_length=P, use_sdpa=use_sdpa,
            **{k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in options.items()})
    err = float(np.abs(got.numpy() - want).max())
    assert err <= 1e-12, f"max abs difference {err:.3g} from the float64 reference"


def test_an_in_place_cache_refuses_what_it_cannot_write():
    """Buffers of another dtype or not torch tensors, and a call autograd would record, are refused in one
    line that names the argument and what was received."""
    config = cfg(num_heads=2, num_kv_heads=1)
    params = {n: torch.from_numpy(t) for n, t in weights.init(config, seed=0, dtype="float32").items()}
    x = torch.zeros((1, 1, 8))
    buffer = lambda dtype=torch.float32: torch.zeros((1, 1, 4, 4), dtype=dtype)  # noqa: E731

    def error(past_key, query=x, tensors=params):
        with pytest.raises(ValueError) as info:
            impl_torch.multi_head_attention(config, tensors, query, past_key=past_key, past_value=buffer(),
                                            cache_length=1)
        return str(info.value)

    with torch.no_grad():
        assert error(buffer(torch.float64)) == (
            "past_key with cache_length is written in place: it must be a torch tensor of the storage dtype "
            "float32 on cpu: got dtype float64")
        assert error(np.zeros((1, 1, 4, 4), np.float32)).endswith("got a ndarray")
    with torch.enable_grad():
        got = error(buffer(), query=x.clone().requires_grad_(True))
        assert got == ("cache_length writes past_key/past_value in place, for inference only: call it under "
                       "torch.no_grad(), or pass the cache whole (past_key without cache_length) to differentiate "
                       "through it: got query requiring grad with gradients enabled")
        trainable = dict(params, **{"query.kernel": params["query.kernel"].clone().requires_grad_(True)})
        assert error(buffer(), tensors=trainable).endswith("got query.kernel requiring grad with gradients enabled")
        # nothing asks for a gradient: autograd records nothing, so the call goes through
        out = impl_torch.multi_head_attention(config, params, x, past_key=buffer(), past_value=buffer(),
                                              cache_length=1)
    assert out.shape == (1, 1, 8) and not out.requires_grad


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_an_in_place_cache_refuses_a_buffer_on_another_device():
    config = cfg()
    params = {n: torch.from_numpy(t).cuda() for n, t in weights.init(config, seed=0, dtype="float32").items()}
    with torch.no_grad(), pytest.raises(ValueError) as info:
        impl_torch.multi_head_attention(config, params, torch.zeros((1, 1, 8)), past_key=torch.zeros((1, 2, 4, 4)),
                                        past_value=torch.zeros((1, 2, 4, 4)).cuda(), cache_length=1)
    assert str(info.value).endswith("got a tensor on cpu")


# -- SDPA or the stages -----------------------------------------------------------------

@pytest.fixture
def sdpa_spy(monkeypatch):
    """Each SDPA call's arguments: is_causal and the attn_mask's dtype (None without one)."""
    calls = []
    real = torch_sdpa.nnF.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        calls.append({"is_causal": kw.get("is_causal", False), "mask": None if attn_mask is None else attn_mask.dtype})
        return real(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(torch_sdpa.nnF, "scaled_dot_product_attention", spy)
    return calls


@pytest.mark.parametrize("name, expected", [
    ("window_left_causal", {"is_causal": False, "mask": torch.bool}),  # causal AND window: one bool mask
    ("segments_packed", {"is_causal": False, "mask": torch.bool}),
    ("decode_cache", {"is_causal": False, "mask": None}),  # one bottom-right query: it sees every key, no mask
    ("cache_window_gqa", {"is_causal": False, "mask": torch.bool}),  # three bottom-right queries, a window
    ("return_cache_no_past", {"is_causal": True, "mask": None}),  # rope alone: SDPA's own causal
    ("qk_norm_rms_head", {"is_causal": True, "mask": None}),
    ("softcap", None), ("softcap_masked_rows", None), ("sinks", None), ("modern_everything", None),
])
def test_sdpa_takes_what_it_can_express(name, expected, sdpa_spy):
    """Windows, segment ids and the cache reach SDPA (as its bool mask, or its
    own is_causal where that is the whole mask); softcap and sinks do not."""
    case = CASES[name]
    options = dict(case.options("float32"), use_sdpa=True, return_weights=False)
    torch_adapter.forward(case.config, make_tensors(case), make_inputs(case), options)
    want = [] if expected is None else [expected]
    assert sdpa_spy == want, f"{name}: SDPA calls {sdpa_spy}, expected {want}"


# -- the layer ---------------------------------------------------------------------------

MODERN_LAYER_CASES = ["qk_norm_layer_all", "qk_norm_rms_head", "sinks", "modern_everything", "torch_qk_norm_rms_all",
                      "torch_qk_norm_layer_head_gqa"]


def _case(name):
    return CASES.get(name) or EXTRA_CASES[name]


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("name", MODERN_LAYER_CASES)
def test_layer_round_trip_with_norm_and_sinks_is_bit_exact(name, dtype):
    config = _case(name).config
    tensors = weights.init(config, seed=3, dtype=dtype)
    layer = impl_torch.MultiHeadAttention.from_tensors(config, tensors)
    back = layer.to_tensors()
    assert list(back) == list(tensors), f"names {list(back)} != {list(tensors)}"
    for key, original in tensors.items():
        assert back[key].shape == original.shape and back[key].dtype == original.dtype, (
            f"{key}: {back[key].dtype}{back[key].shape} != {original.dtype}{original.shape}")
        same = back[key].view(np.uint8) == original.view(np.uint8)
        assert same.all(), f"{key}: {int((~same).sum())} bytes differ after the round trip"
    n_params = sum(p.numel() for p in layer.parameters())
    n_tensors = sum(t.size for t in tensors.values())
    assert n_params == n_tensors, f"the layer holds {n_params} parameters, the canonical tensors {n_tensors}"


def _layer_grads(layer) -> dict[str, np.ndarray]:
    from impl_torch.layer import _layout

    out = {}
    for name, (module, param, shape) in _layout(layer.config).items():
        grad = getattr(getattr(layer, module) if module else layer, param).grad
        out[name] = to_numpy((grad.T if name.endswith(".kernel") else grad).reshape(shape))
    return out


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("name", MODERN_LAYER_CASES)
def test_layer_forward_and_parameter_gradients_match_reference(name, dtype):
    """The layer passes positions, the cache and segment ids through, and its
    norm and sink parameters get the reference's gradients."""
    case = _case(name)
    exp = expected_for(case, dtype)
    inputs = cast_inputs(make_inputs(case), dtype)
    layer = impl_torch.MultiHeadAttention.from_tensors(case.config, cast_tensors(make_tensors(case), dtype))
    leaves = {k: to_torch(inputs[k]).requires_grad_(True) for k in ("query", "key", "value", "past_key", "past_value")
              if k in inputs}
    extra = {k: to_torch(inputs[k]) for k in ("mask", "bias", "positions", "key_positions", "segment_ids",
                                              "key_segment_ids") if k in inputs}
    out = layer(leaves["query"], leaves["key"], leaves["value"], past_key=leaves.get("past_key"),
                past_value=leaves.get("past_value"), is_causal=case.is_causal,
                causal_alignment=case.causal_alignment, **extra)
    assert_close(f"{name} layer output", to_numpy(out), exp["output"], config=case.config, dtype=dtype,
                 quantity="output", B=case.B, T=case.T, S=case.S_total, logits=exp["logits"])
    out.backward(to_torch(output_cotangent(case)).to(out.dtype))
    grads = {k: to_numpy(x.grad) for k, x in leaves.items()} | _layer_grads(layer)
    assert_gradients_conform(case, dtype, grads)


# -- torch.compile ------------------------------------------------------------------------

def test_torch_compile_full_graph_modern_decode_step():
    """A decode step with every feature (rope, norm, window, softcap, sinks, the
    cache) compiles as one graph, forward and backward, and matches the reference."""
    torch._dynamo.reset()
    case = CASES["modern_everything"]
    exp = expected_for(case, "float64")
    inputs = make_inputs(case)
    layer = impl_torch.MultiHeadAttention.from_tensors(case.config, make_tensors(case))
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    leaves = {k: to_torch(inputs[k]).requires_grad_(True) for k in ("query", "key", "value", "past_key", "past_value")}
    extra = {k: to_torch(inputs[k]) for k in ("mask", "bias", "positions", "key_positions")}
    out, pk, pv = compiled(leaves["query"], leaves["key"], leaves["value"], past_key=leaves["past_key"],
                           past_value=leaves["past_value"], is_causal=True, causal_alignment="bottom_right",
                           return_cache=True, **extra)
    out.backward(to_torch(output_cotangent(case)))
    want_fwd = numpy_adapter.forward(case.config, make_tensors(case), inputs, case.options("float64"))
    checks = [("output", to_numpy(out), exp["output"], "output"),
              ("present_key", to_numpy(pk), want_fwd["present_key"], "output"),
              ("present_value", to_numpy(pv), want_fwd["present_value"], "output")]
    checks += [(f"d_{k}", to_numpy(x.grad), exp["grads"][k], "grad") for k, x in leaves.items()]
    for label, got, want, quantity in checks:
        assert_close(f"compiled {label}", got, want, config=case.config, dtype="float64", quantity=quantity, B=case.B,
                     T=case.T, S=case.S_total, logits=exp["logits"])


# -- masks and error wording ------------------------------------------------------------------

def test_window_and_segment_masks_equal_reference():
    from impl_numpy import masks as numpy_masks

    for T in range(1, 6):
        for S in range(1, 7):
            for left, right in ((-1, -1), (0, -1), (2, -1), (-1, 0), (-1, 1), (1, 1), (0, 0)):
                for alignment in ("top_left", "bottom_right"):
                    got = impl_torch.window_mask(T, S, left, right, alignment).numpy()
                    want = numpy_masks.window_mask(T, S, left, right, alignment)
                    assert np.array_equal(got, want), (
                        f"window_mask({T}, {S}, {left}, {right}, {alignment!r}): differs at "
                        f"{np.argwhere(got != want).tolist()}")
    rng = np.random.default_rng(0)
    for q_shape, k_shape in (((5,), (5,)), ((2, 5), (2, 7)), ((5,), (2, 7)), ((2, 5), (7,))):
        q_ids, k_ids = rng.integers(0, 3, q_shape), rng.integers(0, 3, k_shape)
        got = impl_torch.segment_mask(torch.from_numpy(q_ids), torch.from_numpy(k_ids)).numpy()
        want = numpy_masks.segment_mask(q_ids, k_ids)
        assert got.shape == want.shape and np.array_equal(got, want), f"segment_mask {q_shape} x {k_shape} differs"




# torch's own table had no dropout_mask_over_new_keys_only row
MODERN_BAD_CALLS = {k: v for k, v in modern_bad_calls().items() if k != "dropout_mask_over_new_keys_only"}


@pytest.mark.parametrize("bad", list(MODERN_BAD_CALLS))
def test_modern_error_wording_matches_reference(bad):
    config = cfg(num_kv_heads=1, rope={}, window_left=2)
    tensors = weights.init(config, seed=0, dtype="float64")
    call = dict(MODERN_BAD_CALLS[bad])
    query = np.random.default_rng(1).standard_normal((2, 5, 8))
    want = error_of(impl_numpy.multi_head_attention, config, tensors, query, **call)
    torch_call = {k: (to_torch(v) if isinstance(v, np.ndarray) else v) for k, v in call.items()}
    got = error_of(impl_torch.multi_head_attention, config, {n: to_torch(t) for n, t in tensors.items()},
                   to_torch(query), **torch_call)
    assert got == want, f"functional:\ntorch: {got!r}\nnumpy: {want!r}"
    layer = impl_torch.MultiHeadAttention.from_tensors(config, tensors)
    got_layer = error_of(layer, to_torch(query), **torch_call)
    assert got_layer == want, f"layer:\ntorch: {got_layer!r}\nnumpy: {want!r}"


@pytest.mark.parametrize("change", ["norm_missing", "norm_shape", "norm_bias_missing", "sinks_missing",
                                    "sinks_shape"])
def test_modern_tensor_errors_match_reference(change):
    config = cfg(qk_norm={"type": "layer", "scope": "all"}, use_sinks=True)
    tensors = weights.init(config, seed=0, dtype="float32")
    broken = dict(tensors)
    if change == "norm_missing":
        del broken["key.norm.scale"]
    elif change == "norm_shape":
        broken["query.norm.scale"] = np.ones(4, np.float32)  # (H,): the head scope's shape, not (N, H)
    elif change == "norm_bias_missing":
        del broken["query.norm.bias"]
    elif change == "sinks_missing":
        del broken["sinks"]
    else:
        broken["sinks"] = np.zeros((2, 1), np.float32)
    query = np.zeros((1, 3, 8), np.float32)
    want = error_of(impl_numpy.multi_head_attention, config, broken, query)
    got = error_of(impl_torch.multi_head_attention, config, {k: to_torch(v) for k, v in broken.items()},
                   to_torch(query))
    assert got == want, f"torch: {got!r}\nnumpy: {want!r}"


# -- GPU ------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
@pytest.mark.parametrize("use_sdpa", [False, True], ids=["stages", "sdpa"])
@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("name", ["modern_everything", "decode_cache", "cache_window_gqa", "segments_packed",
                                  "sinks_masked_rows", "softcap", "rope_yarn", "qk_norm_layer_all",
                                  "torch_window_segments_norm"])
def test_gpu_modern_matches_reference(name, dtype, use_sdpa):
    case = _case(name)
    case = dataclasses.replace(case, return_weights=case.return_weights and not use_sdpa)
    assert_case_conforms(case, dtype, "torch", WithOptions(torch_adapter, use_sdpa=use_sdpa), device="gpu")


# -- a decode step's present cache and mask ------------------------------------------------

@pytest.mark.parametrize("use_sdpa", [False, True])
def test_decode_step_present_cache_in_numpy_memory(use_sdpa, monkeypatch):
    """A present cache past HUGE_PAGE_MIN_BYTES on the CPU, without autograd,
    is written into NumPy-allocated memory (huge pages): the step's output and
    present cache equal the float64 reference; with a gradient asked the cache
    still goes through torch.cat and the gradient reaches past_key. The one
    bottom-right query builds no causal mask (it hides nothing)."""
    import impl_torch.attention as torch_attention
    import impl_torch.functional as torch_functional

    monkeypatch.setattr(torch_attention, "HUGE_PAGE_MIN_BYTES", 0)
    backed, pointers, real_backed = [], [], torch_attention._numpy_backed

    def spy_backed(shape, dtype):
        tensor = real_backed(shape, dtype)
        backed.append((shape, dtype))
        pointers.append(tensor.data_ptr())
        return tensor

    monkeypatch.setattr(torch_attention, "_numpy_backed", spy_backed)
    causal_built = []
    real_causal = torch_functional.causal_mask
    monkeypatch.setattr(torch_functional, "causal_mask", lambda *a, **k: causal_built.append(a) or real_causal(*a, **k))
    config = weights.AttentionConfig(num_heads=4, num_kv_heads=2, query_dim=16, head_dim=8)
    tensors = weights.init(config, seed=1, dtype="float64")
    rng = np.random.default_rng(2)
    pk, pv, x = rng.standard_normal((2, 2, 9, 8)), rng.standard_normal((2, 2, 9, 8)), rng.standard_normal((2, 1, 16))
    options = dict(is_causal=True, causal_alignment="bottom_right", return_cache=True)
    want = impl_numpy.multi_head_attention(config, tensors, x, past_key=pk, past_value=pv, trace=[], **options)
    t = {name: torch.from_numpy(a) for name, a in tensors.items()}
    with torch.no_grad():
        got = impl_torch.multi_head_attention(config, t, torch.from_numpy(x), past_key=torch.from_numpy(pk),
                                              past_value=torch.from_numpy(pv), use_sdpa=use_sdpa, **options)
    assert causal_built == [], f"a decode step built causal masks {causal_built}"
    for name, g, w in zip(("output", "present_key", "present_value"), got, want):
        err = float(np.abs(g.numpy() - w).max())
        assert err <= 1e-12, f"sdpa={use_sdpa} {name}: max abs difference {err:.3g}"
    assert [tuple(shape) for shape, _ in backed] == [(2, 2, 10, 8)] * 2, f"NumPy-backed presents: {backed}"
    assert got[1].data_ptr() in pointers, "the present key is not the NumPy-backed tensor"
    past_key = torch.from_numpy(pk).requires_grad_(True)
    out, present_key, _ = impl_torch.multi_head_attention(config, t, torch.from_numpy(x), past_key=past_key,
                                                          past_value=torch.from_numpy(pv), use_sdpa=use_sdpa, **options)
    # past_key asks for a gradient: its present goes through torch.cat; past_value's (none asked) need not
    assert len(backed) == 3, f"NumPy-backed presents with past_key's gradient asked: {backed}"
    (out.sum() + present_key.sum()).backward()
    assert past_key.grad is not None and bool(torch.isfinite(past_key.grad).all()), "no gradient reached past_key"
    assert float((past_key.grad - 1).abs().sum()) > 0, "the gradient through the output is missing"
