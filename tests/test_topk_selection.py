"""Attention over selected keys (topk_indices, issue 39 item 1; docs/conformance.md): the NumPy reference against
an independent formulation (each query's selected, visible keys gathered and a dense float64 softmax over them),
on each path of the reference; the chunked core's skipped blocks; the defaults; the values refused in the
contract's words by every mirror; the inputs file; and the porting bugs the suite catches (tests/mutants.py's
TOPK_MUTANTS, each on the grid case it targets). The mirrors run the grid's topk cases, gradients included, in
their own grid tests (tests/test_torch.py, test_tf.py, test_jax.py, test_mlx.py, whose test also plants the four
bugs in impl_mlx); the shape and dtype errors are in
modern_checks.modern_bad_calls, said alike by every mirror's ways in."""

from __future__ import annotations

import numpy as np
import pytest
from assertions import assert_bit_equal
from mutants import TOPK_MUTANTS, MutantAdapter
from reference_checks import error_of

import impl_numpy
import impl_numpy.adapter as numpy_adapter
import weights
from conformance.cli.commands import main as mha
from conformance.io import write_arrays
from conformance.suite.cases import CASES, make_inputs, make_tensors
from conformance.suite.compare import STATUS_FAIL, STATUS_PASS, run_case
from conformance.suite.tolerance import assert_close
from conformance.suite.verify import verify
from weights import AttentionConfig, save

TOPK_CASES = [name for name, case in CASES.items() if case.selection is not None]


def _call(name):
    case = CASES[name]
    options = case.options("float64")
    options.pop("dtype")
    return case, make_tensors(case), make_inputs(case), options


def _gathered(case, inputs, logits, values, policy):
    """The independent formulation: for each (b, n, t), the keys its selection names (duplicates once, -1
    none), kept where causal and the window show them, a float64 softmax over their logits alone, and the
    weighted sum of their values. -> weights (B, N, T, S_total), context (B, N, T, V) or None."""
    c = case.config
    B, N, T, S = logits.shape
    G = N // c.num_kv_heads
    idx = inputs["topk_indices"]
    offset = S - T if case.causal_alignment == "bottom_right" else 0
    w = np.zeros((B, N, T, S))
    for b in range(B):
        for n in range(N):
            for t in range(T):
                row = idx[b, t] if idx.ndim == 3 else idx[b, n // G, t]
                p = t + offset
                keys = sorted({int(j) for j in row if j >= 0 and (not case.is_causal or j <= p)
                               and (c.window_left < 0 or j >= p - c.window_left)})
                if not keys:
                    w[b, n, t] = 1.0 / S if policy == "uniform" else np.nan if policy == "nan" else 0.0
                    continue
                z = logits[b, n, t, keys]
                e = np.exp(z - z.max())
                w[b, n, t, keys] = e / e.sum()
    if values is None:
        return w, None
    v = np.repeat(values, G, axis=1)  # (B, N, S, V): each query head its kv head's values
    return w, np.einsum("bnts,bnsv->bntv", w, v)


@pytest.mark.reference
@pytest.mark.parametrize("name", TOPK_CASES)
def test_selection_is_a_softmax_over_the_gathered_keys(name):
    """The reference's weights and context equal a dense softmax over each query's gathered keys (the
    logits before the mask stage from the reference's own trace: the selection is what is tested here)."""
    case, tensors, inputs, options = _call(name)
    trace = []
    result = impl_numpy.multi_head_attention(case.config, tensors, **inputs, **{**options, "return_weights": True,
                                                                                "return_cache": True}, trace=trace)
    stages = {e.stage: e.value for e in trace}
    latent = case.config.latent is not None  # its present value is the rotary key: the context is not rebuilt
    values = None if latent else result[3]  # (B, K, S_total, V): the cache's values, then the new ones
    want_w, want_ctx = _gathered(case, inputs, stages["logits"], values, case.config.masked_row)
    assert_close(f"{name} weights", result[1], want_w, config=case.config, dtype="float64", quantity="weights",
                 B=case.B, T=case.T, S=case.S_total)
    if want_ctx is not None:
        assert_close(f"{name} attend", stages["attend"], want_ctx, config=case.config, dtype="float64",
                     quantity="output", B=case.B, T=case.T, S=case.S_total)
    # the selection hides keys the other masks show: without it the result differs
    plain = {k: v for k, v in inputs.items() if k != "topk_indices"}
    out = impl_numpy.multi_head_attention(case.config, tensors, **plain, **options)
    out = out[0] if isinstance(out, tuple) else out
    assert float(np.abs(out - (result[0])).max()) > 1e-3, f"{name}: the selection changed nothing"


@pytest.mark.reference
@pytest.mark.parametrize("name", TOPK_CASES)
def test_every_path_equals_the_stages(name):
    """The fused core, the chunked core in blocks of 2 (which skips the blocks nothing selects) and the in-place
    cache give the stages' output."""
    case, tensors, inputs, options = _call(name)
    want = impl_numpy.multi_head_attention(case.config, tensors, **inputs, **{**options, "return_weights": True})
    want = want[0]
    calls = {"fused": {}, "chunked": {"chunk_size": 2}}
    if case.P:
        buffers = {}
        for name_, past in (("past_key", inputs["past_key"]), ("past_value", inputs["past_value"])):
            buffer = np.zeros((*past.shape[:2], case.S_total + 2, past.shape[3]))
            buffer[:, :, :case.P] = past
            buffers[name_] = buffer
        calls["in_place"] = {**buffers, "cache_length": case.P}
    for path, extra in calls.items():
        got = impl_numpy.multi_head_attention(case.config, tensors, **{**inputs, **extra},
                                              **{**options, "return_weights": False})
        got = got[0] if isinstance(got, tuple) else got
        assert_close(f"{name} {path}", got, want, config=case.config, dtype="float64", quantity="output",
                     B=case.B, T=case.T, S=case.S_total)


def _decode_over_nan():
    """A decode step (T 1) over a cache of 8 whose keys 4..7 hold NaN values and are never selected."""
    config = AttentionConfig(num_heads=4, num_kv_heads=2, query_dim=8, head_dim=4)
    tensors = weights.init(config, seed=2, dtype="float64")
    rng = np.random.default_rng(3)
    past_value = rng.standard_normal((2, 2, 8, 4))
    past_value[:, :, 4:] = np.nan
    call = dict(query=rng.standard_normal((2, 1, 8)), key=rng.standard_normal((2, 1, 8)),
                value=rng.standard_normal((2, 1, 8)), past_key=rng.standard_normal((2, 2, 8, 4)),
                past_value=past_value, topk_indices=np.array([[[0, 2, 8, -1]], [[1, 8, 3, 3]]]), is_causal=True,
                causal_alignment="bottom_right")
    return config, tensors, call


@pytest.mark.reference
def test_the_chunked_core_skips_the_blocks_nothing_selects():
    """Blocks of 2 keys the selection leaves out are never read: a NaN value there reaches no row (the stages'
    attend matmul spreads it through 0 * NaN, as chunked.py's docstring says of causally hidden blocks)."""
    config, tensors, call = _decode_over_nan()
    got = impl_numpy.multi_head_attention(config, tensors, **call, chunk_size=2)
    clean = dict(call, past_value=np.nan_to_num(call["past_value"], nan=0.0))
    want = impl_numpy.multi_head_attention(config, tensors, **clean, chunk_size=2)
    assert np.isfinite(got).all(), "a skipped block was read"
    assert_bit_equal("NaN in the unselected blocks vs zeros there", got, want)
    assert np.isnan(impl_numpy.multi_head_attention(config, tensors, **call, return_weights=True)[0]).any()


@pytest.mark.reference
def test_defaults_and_equivalent_selections():
    """No selection and a selection of every key give the same output (every path); duplicates and -1 slots
    give the same mask, so bit for bit the same result as the deduplicated selection."""
    case, tensors, inputs, options = _call("topk_shared_cache")
    plain = {k: v for k, v in inputs.items() if k != "topk_indices"}
    every = np.broadcast_to(np.arange(case.S_total), (case.B, case.T, case.S_total))
    for extra in ({"return_weights": True}, {"return_weights": False}, {"return_weights": False, "chunk_size": 2}):
        a = impl_numpy.multi_head_attention(case.config, tensors, **plain, **{**options, **extra})[0]
        b = impl_numpy.multi_head_attention(case.config, tensors, **plain, topk_indices=every,
                                            **{**options, **extra})[0]
        assert_close(f"every key {extra}", b, a, config=case.config, dtype="float64", quantity="output",
                     B=case.B, T=case.T, S=case.S_total)
    doubled = np.concatenate([inputs["topk_indices"], inputs["topk_indices"], -np.ones_like(inputs["topk_indices"])],
                             axis=-1)
    a = impl_numpy.multi_head_attention(case.config, tensors, **inputs, **options)[0]
    b = impl_numpy.multi_head_attention(case.config, tensors, **dict(inputs, topk_indices=doubled), **options)[0]
    assert_bit_equal("duplicated and padded selection", b, a)


def _bad_values():
    x = np.random.default_rng(1).standard_normal((2, 1, 8))
    cache = dict(past_key=np.zeros((2, 2, 4, 4)), past_value=np.zeros((2, 2, 4, 4)), is_causal=True,
                 causal_alignment="bottom_right")
    words = ("topk_indices must hold key indices in -1..4 (the cache's 4 keys, then the 1 new ones; -1 an unused "
             "slot): got {}")
    return x, {"past_the_keys": (dict(cache, topk_indices=np.array([[[0, 5]], [[1, 2]]])), words.format(5)),
               "below_minus_one": (dict(cache, topk_indices=np.array([[[0, -2]], [[1, 2]]])), words.format(-2))}


CONFIG = AttentionConfig(num_heads=4, num_kv_heads=2, query_dim=8, head_dim=4)


@pytest.mark.reference
@pytest.mark.parametrize("bad", ["past_the_keys", "below_minus_one"])
def test_bad_values_are_named(bad):
    x, calls = _bad_values()
    call, words = calls[bad]
    tensors = weights.init(CONFIG, seed=0, dtype="float64")
    assert error_of(impl_numpy.multi_head_attention, CONFIG, tensors, x, x, x, **call) == words


def _mirror_values(framework, convert, fn, layer) -> int:
    """Each bad selection through the mirror's functional call and its layer: each must raise the spec's
    words. -> the number of refusals checked (two per bad selection)."""
    checked = 0
    x, calls = _bad_values()
    tensors = weights.init(CONFIG, seed=0, dtype="float64")
    for bad, (call, words) in calls.items():
        converted = {k: convert(v) if isinstance(v, np.ndarray) else v for k, v in call.items()}
        for label, f in (("functional", lambda: fn(CONFIG, {n: convert(t) for n, t in tensors.items()},
                                                   convert(x), convert(x), convert(x), **converted)),
                         ("layer", lambda: layer(CONFIG, tensors)(convert(x), convert(x), convert(x), **converted))):
            with pytest.raises(ValueError) as info:
                f()
            assert str(info.value) == words, f"{framework} {label} {bad}: {info.value}"
            checked += 1
    return checked


@pytest.mark.torch
def test_torch_names_bad_values():
    pytest.importorskip("torch")
    import impl_torch
    from impl_torch.convert import to_torch

    assert _mirror_values("torch", to_torch, impl_torch.multi_head_attention, impl_torch.MultiHeadAttention.from_tensors) == 2 * len(_bad_values()[1])


@pytest.mark.tf
def test_tf_names_bad_values():
    pytest.importorskip("tensorflow")
    import impl_tf

    assert _mirror_values("tf", lambda a: a, impl_tf.multi_head_attention, impl_tf.MultiHeadAttention.from_tensors) == 2 * len(_bad_values()[1])


@pytest.mark.jax
def test_jax_names_bad_values_and_traces_the_selection():
    """apply names the values (concrete); under jit the selection is a traced input: two selections, one
    program, each its own result (the reference's)."""
    pytest.importorskip("jax")
    import jax

    import impl_jax
    import impl_jax.adapter  # noqa: F401  (switches JAX's x64 mode on, as tests/test_jax.py does)

    assert _mirror_values("jax", lambda a: a, impl_jax.apply, impl_jax.MultiHeadAttention.from_tensors) == 2 * len(_bad_values()[1])
    case, tensors, inputs, options = _call("topk_per_kv_head_window")
    traces = []

    def run(params, topk):
        traces.append(1)
        return impl_jax.apply(case.config, params, **{**inputs, "topk_indices": topk},
                              **{**options, "return_weights": False})

    jitted = jax.jit(run)
    for topk in (inputs["topk_indices"], inputs["topk_indices"][:, ::-1]):
        got = np.asarray(jitted(tensors, topk))
        want = impl_numpy.multi_head_attention(case.config, tensors, **{**inputs, "topk_indices": topk},
                                               **{**options, "return_weights": False})
        assert_close("jitted selection", got, want, config=case.config, dtype="float64", quantity="output",
                     B=case.B, T=case.T, S=case.S_total)
    assert len(traces) == 1, f"the selection was static: {len(traces)} traces"


@pytest.mark.mlx
def test_mlx_names_bad_values_and_its_chunked_core_skips_the_blocks_nothing_selects():
    """impl_mlx's function and layer name the values in the contract's words; its chunked core, as the
    reference's, never reads a key block the selection leaves out (a NaN value there reaches no row; the stages'
    attend spreads it)."""
    pytest.importorskip("mlx.core")
    import impl_mlx
    from impl_mlx.convert import to_mx, to_numpy

    assert _mirror_values("mlx", to_mx, impl_mlx.multi_head_attention, impl_mlx.MultiHeadAttention.from_tensors) == 2 * len(_bad_values()[1])
    config, tensors, call = _decode_over_nan()
    got = to_numpy(impl_mlx.multi_head_attention(config, tensors, **call, chunk_size=2))
    clean = dict(call, past_value=np.nan_to_num(call["past_value"], nan=0.0))
    want = to_numpy(impl_mlx.multi_head_attention(config, tensors, **clean, chunk_size=2))
    assert np.isfinite(got).all(), "a skipped block was read"
    assert_bit_equal("NaN in the unselected blocks vs zeros there", got, want)
    assert np.isnan(to_numpy(impl_mlx.multi_head_attention(config, tensors, **call, return_weights=True)[0])).any()
    reference = impl_numpy.multi_head_attention(config, tensors, **clean, chunk_size=2)
    assert_close("mlx chunked vs the reference", got, reference, config=config, dtype="float64", quantity="output",
                 B=2, T=1, S=9)


@pytest.mark.reference
def test_the_inputs_file_takes_topk_indices(tmp_path, capsys):
    """`mha run` reads topk_indices (an integer tensor): its output is the adapter's; a value past the keys is
    a one-line error naming it."""
    case, tensors, inputs, _ = _call("topk_shared_cache")
    f32 = {k: v.astype(np.float32) for k, v in tensors.items()}
    save(tmp_path / "w.safetensors", case.config, f32)
    ins = {k: (v.astype(np.float32) if v.dtype == np.float64 else v.astype(np.int32)) for k, v in inputs.items()}
    write_arrays(tmp_path / "in.safetensors", ins)
    args = ["run", "--backend", "numpy", "--weights", str(tmp_path / "w.safetensors"), "--causal",
            "--causal-alignment", "bottom_right"]
    rc = mha([*args, "--inputs", str(tmp_path / "in.safetensors"), "--out", str(tmp_path / "out.safetensors")])
    assert rc == 0, capsys.readouterr().err
    got = weights.read_safetensors(tmp_path / "out.safetensors")[1]["output"]
    want = numpy_adapter.forward(case.config, f32, ins, {"is_causal": True, "causal_alignment": "bottom_right"})
    assert_bit_equal("mha run vs the adapter", got, want["output"])
    bad = ins["topk_indices"].copy()
    bad[0, 0, 0] = case.S_total
    write_arrays(tmp_path / "bad.safetensors", dict(ins, topk_indices=bad))
    rc = mha([*args, "--inputs", str(tmp_path / "bad.safetensors"), "--out", str(tmp_path / "bad_out.safetensors")])
    err = capsys.readouterr().err.strip()
    assert rc != 0 and f"topk_indices must hold key indices in -1..{case.S_total - 1}" in err, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err


@pytest.mark.reference
@pytest.mark.parametrize("bug", list(TOPK_MUTANTS))
def test_porting_bugs_fail_their_case(bug):
    """Each bug fails `mha check`'s comparison and `mha verify` on the case it targets (float64 and float32),
    where the port without it passes; the margins are printed (docs/conformance.md)."""
    what, name = TOPK_MUTANTS[bug]
    margins = []
    for dtype in ("float64", "float32"):
        fine = run_case(CASES[name], "mutant", dtype=dtype, adapter=MutantAdapter(None), gradients=False)
        assert fine.status == STATUS_PASS, fine.worst.describe() if fine.worst else fine.message
        result = run_case(CASES[name], "mutant", dtype=dtype, adapter=MutantAdapter(bug), gradients=False)
        assert result.status == STATUS_FAIL, f"mha check missed {bug} ({what}) on {name} {dtype}"
        margins.append(f"{dtype} {result.margin:.3g}")
    verified = verify(MutantAdapter(bug), only=[name], dtypes=["float32"])
    assert verified and all(r.status == "fail" for r in verified), [(r.name, r.status) for r in verified]
    print(f"{bug} on {name}: check margin {', '.join(margins)}; verify margin {verified[0].margin:.3g}")
