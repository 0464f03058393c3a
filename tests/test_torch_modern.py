"""What only impl_torch has of the modern attention (RoPE, QK-norm, softcap, windows, sinks, the KV
cache, segment ids): the in-place cache's torch specifics (buffers handed back, views given to SDPA,
refusals under autograd and across devices), the routing between SDPA and the stages, torch.compile, and
the NumPy-backed present cache of a decode step.

What every mirror shares (the extra case combinations, the trace, decoding with the cache whole and in
place, the layer, masks, error wording, GPU) runs in tests/test_mirrors_modern.py on each mirror. Expected
values come from impl_numpy in float64; tolerances from conformance.suite.tolerance only.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch not installed: pip install -c constraints/cpu.txt '.[torch]'")

from modern_checks import (  # noqa: E402
    cfg,
    indexer_call,
    indexer_refusals,
)

import impl_numpy  # noqa: E402
import impl_numpy.adapter as numpy_adapter  # noqa: E402
import impl_torch  # noqa: E402
import impl_torch.adapter as torch_adapter  # noqa: E402
import impl_torch.sdpa as torch_sdpa  # noqa: E402
import weights  # noqa: E402
from conformance.suite.cases import (  # noqa: E402
    CASES,
    make_inputs,
    make_tensors,
    output_cotangent,
)
from conformance.suite.compare import expected_for  # noqa: E402
from conformance.suite.tolerance import assert_close  # noqa: E402
from impl_torch.convert import TORCH_DTYPES, to_numpy, to_torch  # noqa: E402

pytestmark = pytest.mark.torch

NO_CUDA = "no CUDA GPU: torch.cuda.is_available() is False"


# -- the extra combinations, every dtype, both paths ------------------------------------


# -- the trace, stage by stage ---------------------------------------------------------


# -- decoding token by token with the cache ------------------------------------------------


# -- an in-place cache (cache_length=): the caller's buffers, written where the new keys go ---------------------


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


# -- GPU ------------------------------------------------------------------------------------


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


@pytest.mark.parametrize("name", list(indexer_refusals()))
def test_indexer_refusals_in_the_contracts_words(name):
    """A layer with an indexer: its cache's index keys required and sized, topk_indices refused beside it."""
    changes, message = indexer_refusals()[name]
    with pytest.raises(ValueError, match=message):
        torch_adapter.forward(*indexer_call(changes))
