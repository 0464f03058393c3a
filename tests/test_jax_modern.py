"""What only impl_jax has of the modern attention (RoPE, QK-norm, softcap, windows, sinks, the KV
cache, segment ids): chunk sizes of the chunked path and its window block skipping, jit (positions and
ids traced, not static; static argnames), the in-place cache under jit (donation, a traced cache_length
and its refusals), the routing between the paths, the module layout, the 16-bit rounding rule of the new
stages, and the NNX parameter paths.

What every mirror shares (the extra case combinations, the trace, decoding with the cache whole and in
place, the layer, masks, error wording, GPU) runs in tests/test_mirrors_modern.py on each mirror. Expected
values come from impl_numpy in float64; tolerances from conformance.suite.tolerance only.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect

import numpy as np
import pytest

INSTALL = "JAX/Flax not installed: pip install -c constraints/cpu.txt '.[jax]'"
jax = pytest.importorskip("jax", reason=INSTALL)
pytest.importorskip("flax", reason=INSTALL)

import jax.numpy as jnp  # noqa: E402
from assertions import ulps_between  # noqa: E402
from flax import nnx  # noqa: E402
from mirrors import case_named, layer_cases  # noqa: E402
from modern_checks import (  # noqa: E402
    cfg,
    decode_causal_masks_built,
    indexer_call,
    indexer_refusals,
)
from reference_checks import assert_case_conforms, error_of  # noqa: E402
from test_jax import ChunkedAdapter  # noqa: E402

import impl_jax  # noqa: E402
import impl_jax.adapter as jax_adapter  # noqa: E402, F401  (switches x64 on)
import impl_jax.attention as jax_attention  # noqa: E402
import impl_jax.chunked as jax_chunked  # noqa: E402
import impl_jax.functional as jax_functional  # noqa: E402
import impl_numpy  # noqa: E402
import impl_numpy.adapter as numpy_adapter  # noqa: E402
import weights  # noqa: E402
from conformance.suite.cases import (  # noqa: E402
    CASES,
    Case,
    cast_tensors,
    make_inputs,
    make_tensors,
)
from conformance.suite.tolerance import assert_close  # noqa: E402
from weights.config import Rope  # noqa: E402
from weights.rope import inverse_frequencies  # noqa: E402

pytestmark = pytest.mark.jax


def _case(name: str) -> Case:
    return case_named("jax", name)

JIT_APPLY = jax.jit(impl_jax.apply, static_argnames=impl_jax.STATIC_ARGNAMES)


def _no_weights(case: Case) -> Case:
    return dataclasses.replace(case, return_weights=False)


# -- the extra combinations on every path ----------------------------------------------------


@pytest.mark.parametrize("chunk_size", [1, 3, 4])
@pytest.mark.parametrize("name", ["modern_everything", "jax_window_long_query_bottom_right", "window_left_causal",
                                  "differential_gqa"])
def test_chunked_modern_block_sizes(name, chunk_size):
    """Blocks of one key, blocks that overlap the end, blocks that hold the whole cache. differential_gqa: the
    differential stage on each query block's context, the overlapping block's rows computed twice included."""
    assert_case_conforms(_no_weights(_case(name)), "float32", "jax", ChunkedAdapter(chunk_size))


# -- the trace, stage by stage ---------------------------------------------------------


# -- decoding token by token with the cache ------------------------------------------------


# -- an in-place cache (cache_length=): buffers written at P .. P+S-1, given back as present_key/value ----------


WINDOW_GQA = cfg(num_heads=4, num_kv_heads=2, rope={}, window_left=3)


# (a traced cache_length refuses a mask and a bias: test_in_place_refusals; so no traced mask_bias pair)
@pytest.mark.parametrize("path, extra", [(path, extra) for extra in ("none", "mask_bias") for path in (
    "fused", "jit", "traced", "stages", "weights", "chunked", "float32") if not (path == "traced" and extra != "none")])
def test_an_in_place_call_equals_the_whole_cache_call(path, extra):
    """GQA, RoPE and a window, 3 new tokens after P = 9 cached ones, buffers of 16 positions (4 spare):
    the in-place call and the call with the cache passed whole (past_key[:, :, :P]) both give the float64
    reference's output; the in-place buffers hold its present cache in their first P + S positions, the
    spare ones are still zero (never written; read with weight 0 where the fused path reads them whole),
    and a mask and a bias over the P + S keys are honoured (padded to the buffers' length)."""
    rng = np.random.default_rng(11)
    B, P, S, C = 2, 9, 3, 16
    dtype = "float32" if path == "float32" else "float64"
    tensors = cast_tensors(weights.init(WINDOW_GQA, seed=5, dtype="float64"), dtype)
    x = rng.standard_normal((B, S, 8)).astype(dtype)
    cache = [rng.standard_normal((B, 2, P, 4)).astype(dtype) for _ in range(2)]
    options = dict(is_causal=True, causal_alignment="bottom_right", return_cache=True)
    if extra == "mask_bias":
        options.update(mask=rng.random((B, 1, S, P + S)) < 0.8, bias=rng.standard_normal((1, 4, S, P + S)))
    want = impl_numpy.multi_head_attention(WINDOW_GQA, cast_tensors(tensors, "float64"), x.astype(np.float64),
                                           past_key=cache[0].astype(np.float64),
                                           past_value=cache[1].astype(np.float64), **options,
                                           return_weights=path == "weights")
    buffers = [np.zeros((B, 2, C, 4), dtype) for _ in range(2)]
    for buffer, part in zip(buffers, cache):
        buffer[:, :, :P] = part
    extra_options = {"stages": dict(trace=[]), "weights": dict(return_weights=True), "chunked": dict(chunk_size=2)}
    extra_options = extra_options.get(path, {})

    def run(fn, **kw):
        return fn(WINDOW_GQA, tensors, x, **options, **extra_options, **kw)

    if path == "jit":
        got = JIT_APPLY(WINDOW_GQA, tensors, x, **options, past_key=buffers[0], past_value=buffers[1],
                        cache_length=P)
    elif path == "traced":
        got = jax.jit(lambda a, b, n: run(impl_jax.apply, past_key=a, past_value=b, cache_length=n))(
            *buffers, jnp.int32(P))
    else:
        got = run(impl_jax.apply, past_key=buffers[0], past_value=buffers[1], cache_length=P)
    whole = run(impl_jax.apply, past_key=cache[0], past_value=cache[1])
    names = ["output"] + (["weights"] if path == "weights" else []) + ["present_key", "present_value"]
    got, whole = dict(zip(names, got)), dict(zip(names, whole))
    for name, value in (("in place", got["output"]), ("whole cache", whole["output"])):
        assert_close(f"{path} {extra}: {name} output", np.asarray(value), want[0], config=WINDOW_GQA, dtype=dtype,
                     quantity="output", B=B, T=S, S=P + S)
    if path == "weights":
        assert_close(f"{extra}: in-place weights", np.asarray(got["weights"]), want[1], config=WINDOW_GQA,
                     dtype=dtype, quantity="weights", B=B, T=S, S=P + S)
    for name, expected in zip(("present_key", "present_value"), want[-2:]):
        buffer = np.asarray(got[name])
        assert buffer.shape == (B, 2, C, 4), f"{name}: the buffer whole, got {buffer.shape}"
        assert_close(f"{path} {extra}: {name}", buffer[:, :, :P + S], expected, config=WINDOW_GQA, dtype=dtype,
                     quantity="output", B=B, T=S, S=P + S)
        assert not buffer[:, :, P + S:].any(), f"{name}: a spare position past P + S was written"
    assert np.array_equal(buffers[0][:, :, P:], np.zeros((B, 2, C - P, 4))), "the caller's NumPy buffer changed"


def test_in_place_refusals():
    """One line each, naming what is refused and what was given."""
    config = cfg(num_heads=4, num_kv_heads=2, rope={})
    tensors = weights.init(config, seed=0, dtype="float32")
    x = np.zeros((1, 1, 8), np.float32)
    buffer = np.zeros((1, 2, 5, 4), np.float32)
    cache = dict(past_key=buffer, past_value=buffer)

    def message(fn=impl_jax.apply, *args, **kwargs):
        text = error_of(fn, *args, **kwargs)
        assert "\n" not in text, text
        return text

    assert message(config=config, params=tensors, query=x, **cache, cache_length=2) == (
        "cache_length needs return_cache=True in JAX: arrays are immutable, the written buffers come back as "
        "present_key/present_value")
    assert message(config=config, params=tensors, query=x, past_key=buffer.astype(np.float64), past_value=buffer,
                   cache_length=2, return_cache=True) == (
        "past_key with cache_length is written in place: it must have the storage dtype float32: got dtype float64")

    def traced(n, **kwargs):
        options = dict(cache, return_cache=True, **kwargs)
        return impl_jax.apply(kwargs.pop("config", config), tensors, x, cache_length=n,
                              **{k: v for k, v in options.items() if k != "config"})

    for kwargs, named in ((dict(mask=np.ones((1, 1, 1, 3), bool)), "mask"),
                          (dict(bias=np.zeros((1, 1, 1, 3), np.float32)), "bias"),
                          (dict(key_segment_ids=np.zeros(3, int), segment_ids=np.zeros(1, int)),
                           "segment_ids, key_segment_ids"),
                          (dict(return_weights=True), "return_weights"),
                          (dict(chunk_size=2), "chunk_size=2"),
                          (dict(past_key_positions=np.arange(2)), "past_key_positions"),
                          (dict(trace=[]), "trace")):
        text = message(jax.jit(lambda n: traced(n, **kwargs)), jnp.int32(1))
        assert text.startswith(f"a traced cache_length attends over the whole buffer and cannot take {named} ("), text
        assert text.endswith("pass cache_length as a Python int (static)"), text
    uniform = cfg(num_heads=4, num_kv_heads=2, rope={}, masked_row="uniform")
    text = message(jax.jit(lambda n: impl_jax.apply(uniform, weights.init(uniform, seed=0, dtype="float32"), x,
                                                    **cache, cache_length=n, return_cache=True)), jnp.int32(1))
    assert "cannot take masked_row='uniform'" in text, text
    # a concrete jax integer is a Python int (checked): the contract's words
    assert message(config=config, params=tensors, query=x, **cache, cache_length=jnp.int32(5), return_cache=True) == (
        "cache_length must be between 0 and C - S = 5 - 1 = 4 (the buffers hold C = 5 positions and the call writes "
        "S = 1 more): got 5")


TOP_LEFT_WITH_CACHE = {  # name -> (config, is_causal, what the refusal names)
    "is_causal": (cfg(num_heads=4, num_kv_heads=2, rope={}), True, "is_causal"),
    "window": (cfg(num_heads=4, num_kv_heads=2, rope={}, window_left=2), False, "a window"),
}


@pytest.mark.parametrize("name", list(TOP_LEFT_WITH_CACHE))
def test_a_traced_cache_length_refuses_top_left_as_a_static_one_does(name):
    """A cache puts the queries after its P keys, so is_causal or a window needs
    causal_alignment='bottom_right' (weights.contract.check_cache_alignment). A
    static P > 0 is refused; a traced P (unknown at trace time, one program for
    every P) must be refused too, in the same sentence less the number
    "(P=...)", whatever P it is then given, instead of being judged as P = 0 and
    silently attending top-left from buffer position 0. bottom_right still runs
    under a traced P and gives the float64 reference's decode step."""
    config, is_causal, what = TOP_LEFT_WITH_CACHE[name]
    tensors = weights.init(config, seed=3, dtype="float64")
    rng = np.random.default_rng(12)
    B, P, S, C = 2, 4, 1, 7
    x = rng.standard_normal((B, S, 8))
    cache = [rng.standard_normal((B, 2, P, 4)) for _ in range(2)]
    buffers = [np.zeros((B, 2, C, 4)) for _ in range(2)]
    for buffer, part in zip(buffers, cache):
        buffer[:, :, :P] = part

    def step(n, alignment=None):
        alignment = {} if alignment is None else dict(causal_alignment=alignment)  # None: the default, top_left
        return impl_jax.apply(config, tensors, x, past_key=buffers[0], past_value=buffers[1], cache_length=n,
                              is_causal=is_causal, return_cache=True, **alignment)

    static = error_of(step, P)
    assert static == (f"a call with a cache (P={P}) aligns its queries after the cached keys: {what} needs "
                      "causal_alignment='bottom_right': got 'top_left'"), static
    jitted = jax.jit(step)
    for n in (P, 0):  # 0 too: a traced P's value is unknown when the program is checked
        traced = error_of(jitted, jnp.int32(n))
        assert traced == static.replace(f" (P={P})", ""), f"traced P={n}: {traced!r} vs static {static!r}"
    got = jax.jit(lambda n: step(n, "bottom_right"))(jnp.int32(P))
    want = impl_numpy.multi_head_attention(config, tensors, x, past_key=cache[0], past_value=cache[1],
                                           is_causal=is_causal, causal_alignment="bottom_right", return_cache=True)
    assert_close(f"{name} traced bottom_right: output", np.asarray(got[0]), want[0], config=config,
                 dtype="float64", quantity="output", B=B, T=S, S=P + S)
    for label, buffer, expected in zip(("present_key", "present_value"), got[1:], want[1:]):
        assert_close(f"{name} traced bottom_right: {label}", np.asarray(buffer)[:, :, :P + S], expected,
                     config=config, dtype="float64", quantity="output", B=B, T=S, S=P + S)


# -- jit: positions, ids and the cache are traced; the config is static ----------------------------

def test_positions_and_segment_ids_are_traced_not_static():
    """New values of positions, segment ids and the cache reuse the compiled
    program (one entry in jit's cache) and give the reference's new results."""
    case = CASES["modern_everything"]
    tensors, inputs = make_tensors(case), make_inputs(case)
    call = {k: inputs[k] for k in ("past_key", "past_value", "mask", "bias")}
    @functools.wraps(impl_jax.apply)  # apply's signature (static_argnames), in a function of its own:
    def fresh(*args, **kwargs):  # jit's cache then counts this test's programs only
        return impl_jax.apply(*args, **kwargs)

    jitted = jax.jit(fresh, static_argnames=impl_jax.STATIC_ARGNAMES)
    rng = np.random.default_rng(3)
    for step in range(3):
        positions = inputs["positions"] + 11 * step
        key_positions = inputs["key_positions"] + 11 * step
        ids = rng.integers(0, 2, (case.B, case.T))
        key_ids = rng.integers(0, 2, (case.B, case.S_total))
        kw = dict(call, positions=positions, key_positions=key_positions, segment_ids=ids, key_segment_ids=key_ids,
                  is_causal=True, causal_alignment="bottom_right")
        got = np.asarray(jitted(case.config, tensors, inputs["query"], inputs["key"], inputs["value"], **kw))
        want = impl_numpy.multi_head_attention(case.config, tensors, inputs["query"], inputs["key"], inputs["value"],
                                               **kw)
        assert_close(f"step {step}", got, want, config=case.config, dtype="float64", quantity="output", B=case.B,
                     T=case.T, S=case.S_total)
    assert jitted._cache_size() == 1, f"{jitted._cache_size()} compiled programs for 3 calls of the same shapes"


def test_static_argnames_name_every_static_option():
    """Every argument of apply that shapes the program is static (hashable), the
    arrays are not: the modern options in particular."""
    parameters = inspect.signature(impl_jax.apply).parameters
    assert set(impl_jax.STATIC_ARGNAMES) <= set(parameters), set(impl_jax.STATIC_ARGNAMES) - set(parameters)
    assert "return_cache" in impl_jax.STATIC_ARGNAMES
    for name in numpy_adapter.OPTIONAL_INPUTS:
        assert name in parameters and name not in impl_jax.STATIC_ARGNAMES, name
    config = CASES["modern_everything"].config
    assert hash(config) == hash(dataclasses.replace(config)), "a modern config must hash by value (static under jit)"


# -- which path runs ---------------------------------------------------------------------

@pytest.fixture
def path_spy(monkeypatch):
    """Which cores a call ran: the stages' softmax, the fused expression, the chunked path (plain or on heads)."""
    seen = []
    real_softmax, real_fused, real_chunked = (jax_functional.softmax, jax_attention.fused_attention,
                                             jax_attention.chunked_attention)
    monkeypatch.setattr(jax_functional, "softmax", lambda *a, **k: seen.append("stages") or real_softmax(*a, **k))
    monkeypatch.setattr(jax_attention, "fused_attention",
                        lambda *a, **k: seen.append(("fused", k["softcap"], k["sinks"] is not None))
                        or real_fused(*a, **k))
    monkeypatch.setattr(jax_attention, "chunked_attention",
                        lambda *a, **k: seen.append("chunked on heads" if k.get("heads") else "chunked")
                        or real_chunked(*a, **k))
    return seen


@pytest.mark.parametrize(("name", "options", "expected"), [
    ("self_basic", {}, [("fused", None, False)]),  # a plain config: the fused expression as before
    ("softcap", {}, [("fused", 2.0, False)]),
    ("sinks", {}, [("fused", None, True)]),
    ("modern_everything", {}, [("fused", 8.0, True)]),
    ("modern_everything", {"return_weights": True}, ["stages"]),
    ("modern_everything", {"dtype": "bfloat16"}, ["stages"]),
    ("jax_dropout_cache_rope_sinks", {}, ["stages"]),
    ("self_basic", {"chunk_size": 2}, ["chunked"]),  # a plain config: the chunked path on the inputs, as before
    ("window_left_causal", {"chunk_size": 2}, ["chunked on heads"]),
    ("decode_cache", {"chunk_size": 2}, ["chunked on heads"]),
    ("segments_packed", {"chunk_size": 2}, ["chunked on heads"]),
])
def test_each_call_takes_its_path(name, options, expected, path_spy):
    """The fused expression takes every modern feature (softcap and sinks as its
    arguments; windows and segments in its mask) where the stages' rounding or
    weights are not needed; the chunked path runs on the heads after norm, rope
    and the cache; a plain config takes exactly the path it took before."""
    case = _case(name)
    inputs = make_inputs(case)
    kw = {k: inputs.get(k) for k in numpy_adapter.OPTIONAL_INPUTS}
    kw.update(is_causal=case.is_causal, causal_alignment=case.causal_alignment, training=case.training,
              return_weights=False, return_cache=case.return_cache)
    kw.update(options)
    impl_jax.apply(case.config, make_tensors(case), inputs["query"], inputs["key"], inputs["value"], **kw)
    assert path_spy == expected, f"{name} {options}: ran {path_spy}, expected {expected}"


# -- the chunked path skips the key blocks a window hides -------------------------------------

@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # 0 * NaN in the reference
@pytest.mark.parametrize("side", ["left", "right"])
def test_chunked_skips_the_key_blocks_a_window_hides(side):
    """A NaN in the values of one key block reaches every row of the stages
    (0 weight times NaN is NaN, as in the reference); the chunked path never
    computes the blocks a window hides from a whole query block, so the rows
    of those query blocks stay finite and equal the reference without the NaN."""
    T, chunk = 32, 8
    if side == "left":  # causal, 4 keys back: query blocks 2 and 3 never see keys 0..7
        config, call, nan_keys, clear_rows = cfg(window_left=4), dict(is_causal=True), slice(0, chunk), slice(16, T)
    else:  # 2 keys ahead: query blocks 0 and 1 never see keys 24..31
        config, call, nan_keys, clear_rows = cfg(window_right=2), {}, slice(T - chunk, T), slice(0, 16)
    tensors = weights.init(config, seed=0, dtype="float64")
    x = np.random.default_rng(3).standard_normal((1, T, 8))
    v = x.copy()
    v[0, nan_keys] = np.nan
    plain = np.asarray(impl_jax.apply(config, tensors, x, x, v, **call))
    assert np.isnan(plain).all(), "the stages should spread the NaN to every row (0 x NaN)"
    chunked = np.asarray(JIT_APPLY(config, tensors, x, x, v, chunk_size=chunk, **call))
    want = impl_numpy.multi_head_attention(config, tensors, x, x, x, **call)
    assert np.isfinite(chunked[:, clear_rows]).all(), (
        f"rows no window lets see the NaN block are not finite: {np.argwhere(~np.isfinite(chunked[0, clear_rows]))[:5]}")
    assert_close(f"window {side}: rows that skip the NaN block", chunked[:, clear_rows], want[:, clear_rows],
                 config=config, dtype="float64", quantity="output", B=1, T=T, S=T)


def _scan_lengths(jaxpr) -> list[int]:
    """The length of every lax.scan in a jaxpr, nested ones included."""
    lengths = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            lengths.append(eqn.params["length"])
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    lengths += _scan_lengths(inner)
    return lengths


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_chunked_key_loop_runs_over_the_window_band_only(alignment):
    """Causal with a left window: each query block's key loop runs a fixed
    (chunk - 1 + window_left) // chunk + 2 key blocks from the band's first,
    not every key block (steps O(T * window), not O(T * S)); the output is
    the reference's all the same (the last key block overlaps its neighbour:
    S = 61 is not a multiple of the chunk)."""
    T, S, chunk, left = 45, 61, 8, 9
    config = cfg(window_left=left, num_heads=4, num_kv_heads=2)
    tensors = weights.init(config, seed=0, dtype="float64")
    rng = np.random.default_rng(5)
    x, y = rng.standard_normal((1, T, 8)), rng.standard_normal((1, S, 8))
    call = dict(is_causal=True, causal_alignment=alignment, chunk_size=chunk)
    jaxpr = jax.make_jaxpr(lambda a, b: impl_jax.apply(config, tensors, a, b, b, **call))(x, y).jaxpr
    band, all_blocks = (chunk - 1 + left) // chunk + 2, -(-S // chunk)
    lengths = _scan_lengths(jaxpr)
    assert band in lengths and all_blocks not in lengths, (
        f"scan lengths {lengths}: expected a key loop of {band} blocks, none of all {all_blocks}")
    got = np.asarray(impl_jax.apply(config, tensors, x, y, y, **call))
    want = impl_numpy.multi_head_attention(config, tensors, x, y, y, is_causal=True, causal_alignment=alignment)
    assert_close(f"banded key loop, {alignment}", got, want, config=config, dtype="float64", quantity="output",
                 B=1, T=T, S=S)


# -- the layer ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", layer_cases("jax"))
def test_layer_params_are_the_canonical_tensors(name):
    """The NNX state path of every Param is its canonical name (query.norm.scale, sinks, ...)."""
    config = _case(name).config
    layer = impl_jax.MultiHeadAttention(config, seed=0, dtype="float32")
    flat = nnx.to_flat_state(nnx.state(layer, nnx.Param))
    found = {".".join(map(str, path)): (type(v).__name__, tuple(v[...].shape)) for path, v in flat}
    want = {name: ("Param", shape) for name, shape in config.tensor_shapes().items()}
    assert found == want, f"nnx.Param state {found} != canonical {want}"


# -- masks, stages and error wording ------------------------------------------------------------


def test_functional_holds_the_stages_and_imports_neither_the_call_nor_the_chunked_path():
    """functional.py mirrors impl_numpy/functional.py (the same public stage
    functions) and imports nothing of its own package but masks at load time;
    the call lives in attention.py alone."""
    from impl_numpy import functional as numpy_functional

    def public_functions(module):
        return {name for name, value in vars(module).items()
                if inspect.isfunction(value) and value.__module__ == module.__name__ and not name.startswith("_")}

    assert public_functions(jax_functional) == public_functions(numpy_functional), (
        f"only jax: {public_functions(jax_functional) - public_functions(numpy_functional)}, "
        f"only numpy: {public_functions(numpy_functional) - public_functions(jax_functional)}")
    tree = ast.parse(inspect.getsource(jax_functional))
    own = [node.module for node in tree.body if isinstance(node, ast.ImportFrom) and node.level]
    assert own == ["masks"], f"functional.py imports {own} of impl_jax at load time"
    for name in ("apply", "multi_head_attention", "STATIC_ARGNAMES"):
        assert not hasattr(jax_functional, name) and hasattr(jax_attention, name), name
    chunked_tree = ast.parse(inspect.getsource(jax_chunked))
    chunked_own = {node.module for node in ast.walk(chunked_tree) if isinstance(node, ast.ImportFrom) and node.level}
    assert chunked_own == {"functional"}, f"chunked.py imports {chunked_own}"


def _new_stage_call(stage, dtype, module, as_array):
    """One new stage on data with long reductions; arrays made by `as_array`."""
    rng = np.random.default_rng(len(stage))
    dt = weights.dtype_from_name(dtype)
    def u(*shape, offset=0.0):  # rounded to dt before the framework sees it (NumPy's bfloat16 + float is float32)
        return as_array((rng.random(shape) + offset).astype(dt))

    x = as_array((rng.standard_normal((2, 8, 4 * 64)) + 0.5).astype(dt))
    logits = as_array((rng.standard_normal((2, 2, 8, 512)) * 3).astype(dt))
    positions = as_array(np.arange(8, dtype=np.int64)[None] + 5)

    def angles(R):  # (1, 1, 8, R/2) in the stage's compute dtype
        return module.rope_angles(positions, inverse_frequencies(Rope(rotary_dim=R)), dt)

    calls = {
        "norm_rms_head": lambda: module.norm(x, u(64, offset=0.5), None, "rms", 1e-6, 4, "head"),
        "norm_layer_all": lambda: module.norm(x, u(4, 64, offset=0.5), u(4, 64), "layer", 1e-5, 4, "all"),
        "rope_angles": lambda: angles(64),
        "rope_half": lambda: module.rope(u(2, 4, 8, 64), angles(64), 64, False, 1.2),
        "rope_interleaved": lambda: module.rope(u(2, 4, 8, 64), angles(48), 48, True, 1.0),
        "softcap": lambda: module.softcap(logits, 5.0),
        "softmax_sinks": lambda: module.softmax(logits, "zero", as_array(rng.standard_normal(2).astype(dt))),
    }
    return calls[stage]()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("stage", ["norm_rms_head", "norm_layer_all", "rope_angles", "rope_half", "rope_interleaved",
                                   "softcap", "softmax_sinks"])
def test_precision_rule_16bit_new_stages(stage, dtype):
    """The spec's precision rule on the new stages: a 16-bit stage is its float32
    arithmetic rounded once to 16 bits (angles stay in float32), so it lands
    within one 16-bit ulp of impl_numpy's stage on the same inputs."""
    from impl_numpy import functional as numpy_functional

    got = _new_stage_call(stage, dtype, jax_functional, jnp.asarray)
    assert isinstance(got, jax.Array), f"{stage}: returned {type(got).__name__}, not a jax.Array"
    got = np.asarray(got)
    want = _new_stage_call(stage, dtype, numpy_functional, np.asarray)
    assert got.dtype == want.dtype and got.shape == want.shape, (
        f"{stage}: {got.dtype}{got.shape}, the spec's {want.dtype}{want.shape}")
    ulps = ulps_between(got, want, "float32" if stage == "rope_angles" else dtype)
    worst = np.unravel_index(int(np.argmax(ulps)), ulps.shape)
    assert ulps.max() <= 1, (
        f"{stage} {dtype}: {ulps.max():g} ulps from the spec at {list(worst)} "
        f"(got {got[worst]!r}, spec {want[worst]!r}); {int((ulps > 1).sum())} of {ulps.size} beyond 1 ulp")


# -- GPU ------------------------------------------------------------------------------------


def test_decode_step_builds_no_causal_mask(monkeypatch):
    """One bottom-right query sees every key: the fused path builds no causal
    mask for it (so no select and no empty-row pass over V), and still equals
    the float64 reference; three queries still build one."""
    def close(name, got, want, T):
        assert_close(name, got, want, config=cfg(num_heads=4, num_kv_heads=2), dtype="float64", quantity="output",
                     B=2, T=T, S=11 + T)

    built = decode_causal_masks_built(monkeypatch, jax_functional, impl_jax.apply, close)
    assert built == {1: 0, 3: 1}, f"causal masks built per T: {built}"


@pytest.mark.parametrize("config_name", ["gqa", "everything"])
def test_cache_not_returned_is_not_concatenated(config_name):
    """Without return_cache the fused path takes the cache and the new keys
    as two parts (their logits joined, (T, S), never the (S, H) keys): the
    jaxpr holds no concatenation of the cache, and the output equals the
    float64 reference's, with a mask, a bias, a window, softcap and sinks."""
    config = {"gqa": cfg(num_heads=4, num_kv_heads=2),
              "everything": cfg(num_heads=4, num_kv_heads=2, window_left=3, logit_softcap=5.0, use_sinks=True,
                                masked_row="uniform")}[config_name]
    tensors = weights.init(config, seed=4, dtype="float64")
    rng = np.random.default_rng(9)
    P = 13
    pk, pv = rng.standard_normal((2, 2, P, 4)), rng.standard_normal((2, 2, P, 4))
    for T, extra in ((1, {}), (3, {"mask": rng.random((2, 1, 3, P + 3)) < 0.8}),
                     (3, {"bias": rng.standard_normal((1, 4, 3, P + 3))})):
        x = rng.standard_normal((2, T, 8))
        options = dict(past_key=pk, past_value=pv, is_causal=True, causal_alignment="bottom_right", **extra)
        jaxpr = jax.make_jaxpr(lambda a: impl_jax.apply(config, tensors, a, **options))(x).jaxpr
        joined = [tuple(eqn.outvars[0].aval.shape) for eqn in jaxpr.eqns if eqn.primitive.name == "concatenate"]
        assert (2, 2, P + T, 4) not in joined, f"T={T} {sorted(extra)}: the cache was concatenated: {joined}"
        got = np.asarray(impl_jax.apply(config, tensors, x, **options))
        want = impl_numpy.multi_head_attention(config, tensors, x, trace=[], **options)
        assert_close(f"{config_name} T={T} {sorted(extra)}", got, want, config=config, dtype="float64",
                     quantity="output", B=2, T=T, S=P + T)


@pytest.mark.parametrize("name", list(indexer_refusals()))
def test_indexer_refusals_in_the_contracts_words(name):
    """A layer with an indexer: its cache's index keys required and sized, topk_indices refused beside it."""
    changes, message = indexer_refusals()[name]
    with pytest.raises(ValueError, match=message):
        jax_adapter.forward(*indexer_call(changes))
