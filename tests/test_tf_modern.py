"""What only impl_tf has of the modern attention (RoPE, QK-norm, softcap, windows, sinks, the KV
cache, segment ids): the XLA-compiled fused core and key blocks, longer chunked calls whose windows skip
key blocks, the module layout, the 16-bit rounding rule of the new stages (against impl_numpy's stage in
the same dtype), which path a call takes, the Keras layer in place, in .keras files and in a functional
Model, tf.function and XLA graphs, and the in-place cache's tf.Variable specifics.

What every mirror shares (the extra case combinations, the trace, decoding with the cache whole and in
place, the layer, masks, error wording, GPU) runs in tests/test_mirrors_modern.py on each mirror. Expected
values come from impl_numpy in float64; tolerances from conformance.suite.tolerance only.
"""

from __future__ import annotations

import dataclasses
import inspect
import os

import numpy as np
import pytest

INSTALL = "TensorFlow/Keras not installed: pip install -c constraints/cpu.txt '.[tf]'"
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
tf = pytest.importorskip("tensorflow", reason=INSTALL)
keras = pytest.importorskip("keras", reason=INSTALL)

from assertions import ulps_between  # noqa: E402
from mirrors import TracedOnTheStages, case_named  # noqa: E402
from modern_checks import (  # noqa: E402
    CACHE_POSITION_CASES,
    DECODE,
    DECODE_CONFIGS,
    TOTAL,
    YARN,
    cfg,
    check_in_place_decode,
    decode_causal_masks_built,
    decode_in_place,
    decode_reference,
    indexer_call,
    indexer_refusals,
)
from reference_checks import assert_case_conforms, error_of  # noqa: E402

import impl_numpy  # noqa: E402
import impl_numpy.adapter as numpy_adapter  # noqa: E402
import impl_tf  # noqa: E402
import weights  # noqa: E402
from conformance.suite.cases import (  # noqa: E402
    CASES,
    Case,
    cast_inputs,
    cast_tensors,
    make_inputs,
    make_tensors,
    output_cotangent,
)
from conformance.suite.compare import expected_for  # noqa: E402
from conformance.suite.tolerance import assert_close  # noqa: E402
from impl_tf import adapter as tf_adapter  # noqa: E402
from impl_tf import attention as tf_attention  # noqa: E402
from impl_tf import chunked as tf_chunked  # noqa: E402
from impl_tf import functional as tf_functional  # noqa: E402
from weights.config import Rope, RopeScaling  # noqa: E402
from weights.rope import inverse_frequencies  # noqa: E402

pytestmark = pytest.mark.tf


def _case(name: str) -> Case:
    return case_named("tf", name)


def Chunked(chunk_size: int) -> TracedOnTheStages:
    """The adapter with chunk_size; a traced forward goes through the stages (mirrors.TracedOnTheStages)."""
    return TracedOnTheStages(tf_adapter, chunk_size=chunk_size)


# -- the extra combinations, every dtype, every path ------------------------------------------


FORCED_XLA = ["modern_everything", "segments_packed", "sinks_masked_rows", "cache_window_gqa",
              "tf_softcap_bias_sinks_gqa", "tf_window_right_causal_long_query"]


@pytest.mark.parametrize("name", FORCED_XLA)
def test_fused_core_through_xla_honours_modern_features(name, monkeypatch):
    """Large calls run fused_attention compiled by XLA (softcap, windows,
    segments and sinks inside the compiled function): forced here, float32,
    output and gradients."""
    monkeypatch.setattr(tf_attention, "XLA_MIN_SCORES", 0)
    assert_case_conforms(dataclasses.replace(_case(name), return_weights=False), "float32", "tf", tf_adapter)


@pytest.mark.parametrize("name", ["modern_everything", "tf_softcap_window_segments", "tf_sinks_cache_mqa_empty_rows"])
def test_chunked_key_blocks_through_xla_honour_modern_features(name, monkeypatch):
    """The chunked path's key blocks compiled by XLA (softcap, window, segment
    ids as block inputs; sinks in the running state), float32, with gradients."""
    monkeypatch.setattr(tf_chunked, "XLA_MIN_BLOCK", 0)
    assert_case_conforms(dataclasses.replace(_case(name), return_weights=False), "float32", "tf", Chunked(2))


# Longer calls: several key blocks per query block, so windows skip whole blocks and runs of
# unmasked blocks go through the while loop, with sinks, segments, a cache and every masked_row.
LONG_CASES = {case.name: case for case in (
    Case("tf_long_window_causal_sinks", cfg(num_heads=4, num_kv_heads=2, window_left=9, use_sinks=True, rope={}),
         T=37, S=37, mask="padding", is_causal=True, return_weights=False),
    Case("tf_long_window_both_cache_softcap",
         cfg(window_left=11, window_right=3, logit_softcap=6.0, rope={"interleaved": True}, masked_row="nan"),
         T=13, S=13, P=20, bias="random", mask="empty_rows", **dict(DECODE, return_weights=False)),
    Case("tf_long_window_right_cross_uniform", cfg(window_left=4, window_right=2, masked_row="uniform"),
         self_attention=False, T=29, S=41, mask="empty_rows", return_weights=False),
    Case("tf_long_segments_norm", cfg(qk_norm={"type": "layer", "scope": "all"}, rope={}, window_left=12),
         T=35, S=35, positions="packed", is_causal=True, return_weights=False),
)}


@pytest.mark.parametrize("chunk", [4, 8])
@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
@pytest.mark.parametrize("name", list(LONG_CASES))
def test_chunked_long_modern_cases_match_reference(name, dtype, chunk):
    assert_case_conforms(LONG_CASES[name], dtype, "tf", Chunked(chunk))


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
@pytest.mark.parametrize("left,right,causal", [(3, -1, True), (5, 2, False), (-1, 1, False), (2, 0, False),
                                               (0, 0, True), (6, -1, False)])
@pytest.mark.parametrize("T,S,chunk", [(16, 16, 4), (10, 18, 4), (18, 10, 4), (13, 13, 5)])
def test_chunked_skips_window_hidden_blocks(T, S, chunk, left, right, causal, alignment, monkeypatch):
    """Exactly the key blocks in which some query of the block sees some key
    (by causal AND the window, numpy's masks) run; the others are never
    computed. (Eager calls of the TF-op step, counted.)"""
    calls = []
    real = tf_chunked.key_block

    def counted(*args, **kwargs):
        calls.append((int(args[6]), int(args[7])))  # t0, s0
        return real(*args, **kwargs)

    monkeypatch.setattr(tf_chunked, "key_block", counted)
    config = cfg(window_left=left, window_right=right)
    rng = np.random.default_rng(T * S + left)
    x, kv = rng.standard_normal((1, T, 8)), rng.standard_normal((1, S, 8))
    tensors = weights.init(config, seed=3, dtype="float64")
    options = dict(is_causal=causal, causal_alignment=alignment)
    got = impl_tf.multi_head_attention(config, tensors, x, kv, kv, chunk_size=chunk, **options)
    visible = impl_numpy.masks.window_mask(T, S, left, right, alignment)
    if causal:
        visible &= impl_numpy.causal_mask(T, S, alignment)
    want = sorted((t0, s0) for t0 in range(0, T, chunk) for s0 in range(0, S, chunk)
                  if visible[t0:t0 + chunk, s0:s0 + chunk].any())
    assert sorted(calls) == want, f"key blocks run {sorted(calls)}, expected {want}"
    expected = impl_numpy.multi_head_attention(config, tensors, x, kv, kv, trace=[], **options)  # the stages
    err = np.abs(np.asarray(got) - expected).max()
    assert err <= 1e-13, f"max abs difference to the reference {err:.3g}"


# -- names: inputs, answers, gradients -------------------------------------------------------


def test_module_layout_points_one_way():
    """functional.py holds the stages (impl_numpy's names) and imports neither
    attention.py nor chunked.py; the names moved from it stay readable there."""
    import ast

    from impl_numpy import functional as np_functional

    tree = ast.parse(inspect.getsource(tf_functional))
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert not imported & {"attention", "chunked"}, f"functional imports {sorted(imported)} at top level"
    for name in ("project", "norm", "split_heads", "rope_angles", "rope", "logits", "softcap", "mask", "softmax",
                 "dropout", "attend", "merge_heads", "output", "allowed_mask", "default_positions"):
        assert hasattr(np_functional, name) and hasattr(tf_functional, name), f"stage {name} missing in one mirror"
    assert not hasattr(tf_functional, "multi_head_attention"), "the call lives in attention.py alone"
    assert callable(tf_attention.multi_head_attention) and tf_attention.XLA_MIN_SCORES > 0


# -- the trace, stage by stage ----------------------------------------------------------------


def _modern_stage(stage, dtype):
    """A call of one new stage on positive data (no cancellation), NumPy arrays in `dtype`."""
    rng = np.random.default_rng(len(stage))
    dt = weights.dtype_from_name(dtype)
    u = lambda *shape: (rng.random(shape) + 0.5).astype(dt)  # noqa: E731
    x = u(2, 16, 64)
    logits = (rng.standard_normal((2, 4, 8, 64)) * 3).astype(dt)
    logits[0, 1, 2] = -np.inf  # a fully masked row: all its mass on the sink
    positions = rng.integers(0, 5000, (2, 16))
    inv_freq = inverse_frequencies(Rope(rotary_dim=8, scaling=RopeScaling.from_value(YARN)))
    return {
        "norm_rms_head": lambda f: f.norm(x, u(16), None, "rms", 1e-6, 4, "head"),
        "norm_layer_all": lambda f: f.norm(x, u(4, 16), u(4, 16), "layer", 1e-5, 4, "all"),
        "rope_angles": lambda f: f.rope_angles(positions, inv_freq, dt),
        "rope_half": lambda f: f.rope(u(2, 4, 16, 12), f.rope_angles(positions, inv_freq, dt), 8, False, 1.2),
        "rope_interleaved": lambda f: f.rope(u(2, 4, 16, 12), f.rope_angles(positions, inv_freq, dt), 8, True, 1.0),
        "softcap": lambda f: f.softcap(logits, 5.0),
        "softmax_sinks": lambda f: f.softmax(logits, "nan", rng.standard_normal(4).astype(dt)),
    }[stage]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("stage", ["norm_rms_head", "norm_layer_all", "rope_angles", "rope_half", "rope_interleaved",
                                   "softcap", "softmax_sinks"])
def test_precision_rule_16bit_modern_stages(stage, dtype):
    """The spec's precision rule for the new stages: a 16-bit stage is its
    float32 arithmetic rounded once to 16 bits, so impl_tf's and impl_numpy's
    results are equal or one ulp apart (arithmetic in 16 bits lands several
    ulps away). rope_angles stays in the compute dtype (float32), as the spec's."""
    from impl_numpy import functional as np_functional

    got = np.asarray(keras.ops.convert_to_numpy(_modern_stage(stage, dtype)(tf_functional)))
    want = _modern_stage(stage, dtype)(np_functional)
    assert got.dtype == want.dtype, f"{stage}: dtype {got.dtype}, the spec's {want.dtype}"
    ulps = ulps_between(got, want, want.dtype.name if want.dtype.name == "float32" else dtype)
    ulps = np.where(np.isnan(got) & np.isnan(want), 0.0, ulps)
    worst = np.unravel_index(int(np.nanargmax(ulps)), ulps.shape)
    assert np.nanmax(ulps) <= 1, (
        f"{stage} {dtype}: {np.nanmax(ulps):g} ulps from the spec at {list(worst)} "
        f"(got {got[worst]!r}, spec {want[worst]!r}); {int((ulps > 1).sum())} of {ulps.size} beyond 1 ulp")


# -- decoding token by token with the cache ---------------------------------------------------


def test_layer_decodes_in_place():
    """The Keras layer's __call__ passes cache_length on: the variables it is given are written and handed
    back, and the decoded rows and cache are the float64 reference's."""
    config = DECODE_CONFIGS["everything"]
    tensors, x, want, logits, _ = decode_reference("everything", "float32", perturb_norms=True)
    layer = impl_tf.MultiHeadAttention.from_tensors(config, tensors)

    def step(_tensors, part, pk, pv, P):
        return layer(tf.constant(part), past_key=pk, past_value=pv, cache_length=P, is_causal=True,
                     causal_alignment="bottom_right", return_cache=True)

    zeros = lambda shape: tf.Variable(tf.zeros(shape, tf.float32))  # noqa: E731
    outputs, pk, pv, same = decode_in_place(step, tensors, x, zeros)
    assert same, "the layer handed back other objects than the variables it was given"

    def compare(name, got, expected):
        assert_close(f"layer decoded in place {name}", got, expected, config=config, dtype="float32",
                     quantity="output", B=2, T=TOTAL, S=TOTAL, logits=logits)

    check_in_place_decode(outputs, pk, pv, want, compare)


# -- which path runs ------------------------------------------------------------------------

@pytest.fixture
def fused_spy(monkeypatch):
    """The keyword arguments of each fused_attention call (eager, below XLA_MIN_SCORES)."""
    calls = []
    real = tf_attention.fused_attention

    def spy(q, k, v, **kw):
        calls.append(sorted(kw))
        return real(q, k, v, **kw)

    monkeypatch.setattr(tf_attention, "fused_attention", spy)
    return calls


PLAIN_OPTIONS = ["bias", "causal_alignment", "is_causal", "keep", "mask4", "masked_row", "rate", "scale"]


@pytest.mark.parametrize("name, extra", [
    ("mask_and_bias_causal", []),  # plain: the options fused_attention always had, no more
    ("qk_norm_rms_head", []), ("rope_llama3", []), ("decode_cache", []),  # before the core, or the cache: none
    ("softcap", ["softcap"]),
    ("window_left_causal", ["window_left", "window_right"]),
    ("segments_packed", ["key_segment_ids", "segment_ids"]),
    ("sinks", ["sinks"]),
    ("modern_everything", ["sinks", "softcap", "window_left", "window_right"]),
])
def test_fused_path_takes_modern_calls(name, extra, fused_spy):
    """Without weights or trace, every modern call runs fused_attention (which
    expresses each feature), and a plain call passes exactly its old options."""
    case = dataclasses.replace(CASES[name], return_weights=False)
    tf_adapter.forward(case.config, make_tensors(case), make_inputs(case), case.options("float32"))
    assert fused_spy == [sorted(PLAIN_OPTIONS + extra)], f"{name}: fused_attention calls {fused_spy}"


# -- the layer --------------------------------------------------------------------------------


def test_keras_file_round_trip_with_modern_config(tmp_path):
    """.keras save and load keep the modern config and the norm and sink variables."""
    case = CASES["modern_everything"]
    tensors = make_tensors(case)
    rng = np.random.default_rng(4)
    for key in tensors:
        if ".norm." in key or key == "sinks":
            tensors[key] = rng.standard_normal(tensors[key].shape)
    layer = impl_tf.MultiHeadAttention.from_tensors(case.config, cast_tensors(tensors, "float32"))
    path = tmp_path / "modern.keras"
    keras.saving.save_model(layer, path)
    loaded = keras.saving.load_model(path)
    assert loaded.config == case.config, f"{loaded.config} != {case.config}"
    for (key, a), b in zip(layer.to_tensors().items(), loaded.to_tensors().values(), strict=True):
        assert a.tobytes() == b.tobytes(), f"{key} changed in the .keras round trip"
    inputs = cast_inputs(make_inputs(case), "float32")
    call = dict(past_key=inputs["past_key"], past_value=inputs["past_value"], positions=inputs["positions"],
                key_positions=inputs["key_positions"], mask=inputs["mask"], bias=inputs["bias"], is_causal=True,
                causal_alignment="bottom_right", return_cache=True)
    for got, want in zip(loaded(inputs["query"], inputs["key"], inputs["value"], **call),
                         layer(inputs["query"], inputs["key"], inputs["value"], **call), strict=True):
        assert np.array_equal(np.asarray(got), np.asarray(want)), "outputs differ after load"


def test_keras_model_with_cache_outputs():
    """The layer in a functional Model: symbolic call with a cache and
    return_cache gives the contract's shapes (P + S keys)."""
    config = DECODE_CONFIGS["everything"]
    q = keras.Input((1, config.query_dim))
    pk = keras.Input((config.num_kv_heads, 5, config.head_dim))
    pv = keras.Input((config.num_kv_heads, 5, config.value_head_dim))
    layer = impl_tf.MultiHeadAttention(config)
    out, present_key, present_value = layer(q, past_key=pk, past_value=pv, is_causal=True,
                                            causal_alignment="bottom_right", return_cache=True)
    shapes = [tuple(t.shape) for t in (out, present_key, present_value)]
    want = [(None, 1, config.out_dim), (None, config.num_kv_heads, 6, config.head_dim),
            (None, config.num_kv_heads, 6, config.value_head_dim)]
    assert shapes == want, f"symbolic shapes {shapes}, expected {want}"
    model = keras.Model([q, pk, pv], [out, present_key, present_value])
    rng = np.random.default_rng(0)
    args = [rng.standard_normal((2, *t.shape[1:])).astype("float32") for t in (q, pk, pv)]
    got = model.predict(args, verbose=0)
    tensors = {k: np.asarray(v) for k, v in layer.to_tensors().items()}
    want_out = impl_numpy.multi_head_attention(config, tensors, args[0], past_key=args[1], past_value=args[2],
                                               is_causal=True, causal_alignment="bottom_right", return_cache=True)
    for label, a, b in zip(("output", "present_key", "present_value"), got, want_out, strict=True):
        err = np.abs(np.asarray(a, np.float64) - b).max()
        assert err <= 1e-5, f"model.predict {label}: max abs difference {err:.3g} to impl_numpy in float32"


# -- graphs ----------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["tf.function", "xla"])
@pytest.mark.parametrize("path", ["fused", "chunked", "stages"])
def test_modern_decode_step_in_graphs_with_gradient(mode, path):
    """A decode step with every feature (rope, norm, window, softcap, sinks, the
    cache, a mask and a bias) under tf.function and XLA, a GradientTape inside
    the graph, against the float64 reference's output, cache and gradients."""
    case = CASES["modern_everything"]
    exp = expected_for(case, "float64")
    inputs = make_inputs(case)
    layer = impl_tf.MultiHeadAttention.from_tensors(case.config, make_tensors(case))
    extra = dict(chunk_size=2) if path == "chunked" else dict(return_weights=path == "stages")
    names = ("query", "key", "value", "past_key", "past_value")

    @tf.function(jit_compile=mode == "xla")
    def run(query, key, value, past_key, past_value):
        with tf.GradientTape() as tape:
            tape.watch([query, key, value, past_key, past_value])
            result = layer(query, key, value, past_key=past_key, past_value=past_value, is_causal=True,
                           causal_alignment="bottom_right", return_cache=True, mask=inputs["mask"],
                           bias=inputs["bias"], positions=inputs["positions"],
                           key_positions=inputs["key_positions"], **extra)
            out, pk, pv = result[0], result[-2], result[-1]
        grads = tape.gradient(out, [query, key, value, past_key, past_value],
                              output_gradients=tf.constant(output_cotangent(case)))
        return out, pk, pv, grads

    out, pk, pv, grads = run(*(tf.constant(inputs[n]) for n in names))
    checks = [("output", out, exp["output"], "output"), ("present_key", pk, exp["present_key"], "output"),
              ("present_value", pv, exp["present_value"], "output")]
    checks += [(f"d_{n}", g, exp["grads"][n], "grad") for n, g in zip(names, grads, strict=True)]
    for label, got, want, quantity in checks:
        floor = np.abs(exp["magnitudes"][label[2:]]).max() if quantity == "grad" else 0.0
        assert_close(f"{mode} {path} {label}", np.asarray(got), want, config=case.config, dtype="float64",
                     quantity=quantity, B=case.B, T=case.T, S=case.S_total, logits=exp["logits"], scale_floor=floor)


def _graph_rows():
    """Every path for the ALiBi and chunks case; the temperature case (0.2-0.4 s a row) on the chunked path,
    which computes its queries' temperature block by block from positions of its own, the rest `slow`."""
    for case_name in CACHE_POSITION_CASES:
        for path in ("fused", "chunked", "stages", "in_place"):
            slow = case_name == "cache_positions_temperature" and path != "chunked"
            yield pytest.param(case_name, path, id=f"{case_name}-{path}", marks=[pytest.mark.slow] if slow else [])


@pytest.mark.parametrize("case_name, path", _graph_rows())
def test_cache_positions_in_a_graph(case_name, path):
    """A left-padded decode step (past_key_positions, and the temperature from the cache index) inside
    tf.function, the positions graph tensors (so the chunked path masks every block instead of skipping
    from their values), on each path; in place on tf.Variables the function captures. Float64 output
    against the reference's."""
    case = CACHE_POSITION_CASES[case_name]
    exp = expected_for(case, "float64")
    inputs = make_inputs(case)
    params = {n: tf.constant(t) for n, t in make_tensors(case).items()}
    extra = {"fused": {}, "chunked": dict(chunk_size=2), "stages": dict(trace=[]), "in_place": {}}[path]
    cache = {n: tf.constant(inputs[n]) for n in ("past_key", "past_value")}
    if path == "in_place":
        for name in cache:
            past = inputs[name]
            buffer = np.zeros((*past.shape[:2], past.shape[2] + case.S + 1, past.shape[3]))
            buffer[:, :, :case.P] = past
            cache[name] = tf.Variable(buffer)
        extra["cache_length"] = case.P

    @tf.function(autograph=False)
    def run(query, key, value, positions, key_positions, past_key_positions, mask):
        return impl_tf.multi_head_attention(case.config, params, query, key, value, **cache, mask=mask,
                                            positions=positions, key_positions=key_positions,
                                            past_key_positions=past_key_positions, is_causal=True,
                                            causal_alignment="bottom_right", **extra)

    names = ("query", "key", "value", "positions", "key_positions", "past_key_positions")
    out = run(*(tf.constant(inputs[n]) for n in names), None if "mask" not in inputs else tf.constant(inputs["mask"]))
    assert_close(f"tf.function {path} output", np.asarray(out), exp["output"], config=case.config, dtype="float64",
                 quantity="output", B=case.B, T=case.T, S=case.S_total, logits=exp["logits"])


# -- masks and error wording ------------------------------------------------------------------


def test_infinite_cache_is_refused_as_the_reference_refuses_it():
    config = cfg(num_kv_heads=1)
    tensors = weights.init(config, seed=0, dtype="float64")
    past = np.zeros((1, 1, 2, 4))
    past[0, 0, 1, 2] = np.inf
    inputs = {"query": np.zeros((1, 1, 8)), "past_key": past, "past_value": np.zeros((1, 1, 2, 4))}
    want = error_of(numpy_adapter.forward, config, tensors, inputs, {})
    got = error_of(tf_adapter.forward, config, tensors, inputs, {})
    assert got == want, f"forward: tf {got!r}, numpy {want!r}"
    got = error_of(tf_adapter.vjp, config, tensors, inputs, {}, np.zeros((1, 1, 8)))
    assert got == want, f"vjp: tf {got!r}, numpy {want!r}"


# -- GPU --------------------------------------------------------------------------------------


def test_decode_step_builds_no_causal_mask(monkeypatch):
    """One bottom-right query sees every key: the fused path builds no causal
    mask for it, and still equals the float64 reference; three queries still
    build one."""
    import impl_tf.functional as tf_functional

    def close(name, got, want, T):
        err = float(np.abs(got - want).max())
        assert err <= 1e-12, f"{name}: max abs difference {err:.3g}"

    built = decode_causal_masks_built(monkeypatch, tf_functional, impl_tf.multi_head_attention, close)
    assert built == {1: 0, 3: 1}, f"causal masks built per T: {built}"


@pytest.mark.parametrize("config_name", ["gqa", "everything"])
def test_cache_not_returned_is_not_concatenated(config_name, monkeypatch):
    """Without return_cache the fused path takes the cache and the new keys
    as two parts (their logits joined, (T, S), never the (S, H) keys): no
    concatenation of the cache runs, and the output equals the float64
    reference's, with a mask, a bias, a window, softcap and sinks, eager and
    through XLA (XLA_MIN_SCORES 0)."""
    import impl_tf.attention as tf_attention

    joined = []
    real = tf_attention.ops.concatenate
    monkeypatch.setattr(tf_attention.ops, "concatenate",
                        lambda xs, axis=0: joined.append(tuple(tuple(x.shape) for x in xs)) or real(xs, axis=axis))
    config = {"gqa": weights.AttentionConfig(num_heads=4, num_kv_heads=2, query_dim=8, head_dim=4),
              "everything": weights.AttentionConfig(num_heads=4, num_kv_heads=2, query_dim=8, head_dim=4,
                                                    window_left=3, logit_softcap=5.0, use_sinks=True,
                                                    masked_row="uniform")}[config_name]
    tensors = weights.init(config, seed=4, dtype="float64")
    rng = np.random.default_rng(9)
    P = 13
    pk, pv = rng.standard_normal((2, 2, P, 4)), rng.standard_normal((2, 2, P, 4))
    for xla_min in (2**62, 0):
        monkeypatch.setattr(tf_attention, "XLA_MIN_SCORES", xla_min)
        for T, extra in ((1, {}), (3, {"mask": rng.random((2, 1, 3, P + 3)) < 0.8}),
                         (3, {"bias": rng.standard_normal((1, 4, 3, P + 3))})):
            x = rng.standard_normal((2, T, 8))
            options = dict(past_key=pk, past_value=pv, is_causal=True, causal_alignment="bottom_right", **extra)
            joined.clear()
            got = np.asarray(impl_tf.multi_head_attention(config, tensors, x, **options))
            cache_joins = [shapes for shapes in joined if (2, 2, P, 4) in shapes]
            assert cache_joins == [], f"T={T} {sorted(extra)}: the cache was concatenated: {cache_joins}"
            want = impl_numpy.multi_head_attention(config, tensors, x, trace=[], **options)
            err = float(np.abs(got - want).max())
            assert err <= 1e-12, f"{config_name} xla_min={xla_min} T={T} {sorted(extra)}: max abs difference {err:.3g}"


# -- an in-place cache (cache_length=): the caller's tf.Variables, written where the new keys go ------------


@pytest.mark.parametrize("path", ["fused", "fused_xla", "stages", "chunked"])
@pytest.mark.parametrize("rows", ["causal", "empty_rows_uniform"])
def test_an_in_place_cache_computes_what_the_cache_passed_whole_does(path, rows, monkeypatch):
    """GQA, rope and a window, P = 5 cached keys and S = T = 2 new ones in buffers of P + S + 3 positions:
    the output equals the call with the cache passed whole (and both the float64 reference's); the
    buffers then hold the cache and the new keys (the whole call's present_key / present_value), and the
    spare positions, finite values far from zero here, stay as they were and change nothing. With a mask
    that empties a row and masked_row="uniform", that row spreads over the P + S keys, not the buffers'."""
    uniform = rows == "empty_rows_uniform"
    config = cfg(num_heads=4, num_kv_heads=2, rope={}, window_left=2, **({"masked_row": "uniform"} if uniform else {}))
    tensors = weights.init(config, seed=3, dtype="float64")
    rng = np.random.default_rng(11)
    B, P, S, SPARE, K, H = 2, 5, 2, 3, 2, 4
    x = rng.standard_normal((B, S, 8))
    past_key, past_value = rng.standard_normal((B, K, P, H)), rng.standard_normal((B, K, P, H))
    options = dict(is_causal=True, causal_alignment="bottom_right")
    if uniform:
        mask = rng.random((B, 1, S, P + S)) < 0.7
        mask[1, 0, 0] = False  # batch 1's first query sees no key
        options["mask"] = mask
    extra = {"stages": {"trace": []}, "chunked": {"chunk_size": 2}}.get(path, {})
    if path == "fused_xla":
        monkeypatch.setattr(tf_attention, "XLA_MIN_SCORES", 0)
    spare = 50.0 + rng.standard_normal((2, B, K, SPARE, H))
    buffers = [tf.Variable(np.concatenate([past, np.zeros((B, K, S, H)), far], axis=2))
               for past, far in zip((past_key, past_value), spare)]
    whole = impl_tf.multi_head_attention(config, tensors, x, past_key=past_key, past_value=past_value,
                                         return_cache=True, **options, **extra)
    got = impl_tf.multi_head_attention(config, tensors, x, past_key=buffers[0], past_value=buffers[1],
                                       cache_length=P, return_cache=True, **options, **extra)
    assert got[1] is buffers[0] and got[2] is buffers[1], "the buffers were not handed back"
    want = impl_numpy.multi_head_attention(config, tensors, x, past_key=past_key, past_value=past_value,
                                           return_cache=True, trace=[], **options)
    for label, reference in (("the whole-cache call", np.asarray(whole[0])), ("the float64 reference", want[0])):
        err = float(np.abs(np.asarray(got[0]) - reference).max())
        assert err <= 1e-12, f"{path} {rows}: output differs from {label} by {err:.3g}"
    if uniform:
        row = impl_numpy.multi_head_attention(config, tensors, x, past_key=past_key, past_value=past_value,
                                              return_weights=True, **options)[1][1, :, 0]
        assert np.allclose(row, 1 / (P + S)), "the reference's empty row is not uniform over P + S keys"
    for name, buffer, present, far in zip(("present_key", "present_value"), buffers, want[1:], spare):
        held = buffer.numpy()
        err = float(np.abs(held[:, :, :P + S] - present).max())
        assert err <= 1e-12, f"{path} {rows}: {name}'s first P + S positions differ by {err:.3g}"
        assert np.array_equal(held[:, :, P + S:], far), f"{path} {rows}: {name}'s spare positions were written"


def test_an_in_place_cache_refuses_a_buffer_it_cannot_write():
    """A tensor, a NumPy array or a variable of another dtype cannot take the writes (a cast would write
    a copy the caller never sees); nor can a call under a recording GradientTape (no gradient passes
    through the writes). One line, naming the argument and what it got."""
    config = cfg(num_kv_heads=1)
    tensors = weights.init(config, seed=0)  # float32
    x = tf.zeros((1, 1, 8), tf.float32)
    good = tf.Variable(tf.zeros((1, 1, 4, 4), tf.float32))

    def error(past_key, past_value=good):
        return error_of(impl_tf.multi_head_attention, config, tensors, x, past_key=past_key, past_value=past_value,
                        cache_length=1, is_causal=True, causal_alignment="bottom_right")

    start = "past_key with cache_length is written in place: it must be a tf.Variable of the storage dtype float32: "
    assert error(tf.zeros((1, 1, 4, 4), tf.float32)) == start + "got a EagerTensor"
    assert error(np.zeros((1, 1, 4, 4), np.float32)) == start + "got a ndarray"
    assert error(tf.Variable(tf.zeros((1, 1, 4, 4), tf.float64))) == start + "got dtype float64"
    assert error(good, tf.zeros((1, 1, 4, 4), tf.float32)) == start.replace("past_key", "past_value") + (
        "got a EagerTensor")
    with tf.GradientTape():
        assert error(good, tf.Variable(tf.zeros((1, 1, 4, 4), tf.float32))) == (
            "cache_length writes past_key/past_value in place, which no gradient passes through: got a call under "
            "a recording GradientTape (an in-place cache is for inference)")
    assert not good.numpy().any(), "a refused call wrote into the buffer"


# -- the indexer's index cache in place (past_index_keys with cache_length): written by XLA (tf_only.write_rows) ---


def _decode_index_cache_in_place(dtype: str) -> list[float]:
    """indexer_dsa_prefill's DSA (MLA) layer, batch 2: a prefill of 5 tokens, then 4 decode steps, once with
    every cache in place (tf.Variables of 9 + 2 spare positions, cache_length=P) and once copying (each step
    handed the caches the last returned). After every call the index buffer's first P + S rows equal the copying
    call's present_index_keys, its spare rows stay as they were, and the outputs agree; in float64 the index keys
    equal the reference's too (impl_numpy, the same prefill). Returns each call's relative error of the index
    buffer against present_index_keys (asserted here as it is measured, so a mutant fails at its step)."""
    case = CASES["indexer_dsa_prefill"]
    config, tensors = case.config, cast_tensors(make_tensors(case), dtype)
    x = make_inputs(case)["query"].astype(dtype)  # (2, 9, D)
    B, T, SPARE = x.shape[0], x.shape[1], 2
    kw = dict(is_causal=True, causal_alignment="bottom_right")
    # The two calls run the same stages on the same values (the buffers' rows are the copies' rows), so they agree
    # to a few roundings; 8 units of the dtype's epsilon, relative, leave room for another order of summation and
    # no more (a row written one position early is off by the rows' own size, ~1).
    tol = 8 * float(np.finfo(dtype).eps)
    _, pk, pv, pik = impl_tf.multi_head_attention(config, tensors, x[:, :5], return_cache=True, **kw)
    shapes = [tuple(a.shape) for a in (pk, pv, pik)]
    rng = np.random.default_rng(5)
    spare = (50.0 + rng.standard_normal((B, SPARE, shapes[2][2]))).astype(dtype)
    grown = [np.zeros(s[:-2] + (T + SPARE, s[-1]), dtype) for s in shapes]  # positions: the next-to-last axis
    grown[2][:, T:] = spare
    buffers = [tf.Variable(a) for a in grown]
    copying, P, errors = None, 0, []
    for S in (5, 1, 1, 1, 1):
        step = x[:, P:P + S]
        caches = {} if copying is None else dict(zip(("past_key", "past_value", "past_index_keys"), copying[1:]))
        copying = impl_tf.multi_head_attention(config, tensors, step, step, step, return_cache=True, **caches, **kw)
        placed = impl_tf.multi_head_attention(config, tensors, step, step, step, past_key=buffers[0],
                                              past_value=buffers[1], past_index_keys=buffers[2], cache_length=P,
                                              return_cache=True, **kw)
        assert placed[3] is buffers[2], "the index buffer was not handed back"
        want, held = np.asarray(copying[3]), buffers[2].numpy()
        assert want.shape[1] == P + S
        err = float(np.abs(held[:, :P + S] - want).max() / np.abs(want).max())
        assert err <= tol, f"{dtype} P={P}: the index buffer's rows 0..{P + S - 1} differ from present_index_keys by " \
                           f"{err:.3g} (relative)"
        errors.append(err)
        assert np.array_equal(held[:, T:], spare), f"{dtype} P={P}: the index buffer's spare rows were written"
        out, ref = np.asarray(placed[0]), np.asarray(copying[0])
        err = float(np.abs(out - ref).max() / np.abs(ref).max())
        assert err <= tol, f"{dtype} P={P}: the in-place output differs from the copying call's by {err:.3g}"
        P += S
    if dtype == "float64":
        reference = impl_numpy.multi_head_attention(config, tensors, x, return_cache=True, is_causal=True)[3]
        err = float(np.abs(buffers[2].numpy()[:, :T] - reference).max())
        assert err <= 1e-12, f"the index buffer differs from the float64 reference's present_index_keys by {err:.3g}"
    return errors


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_the_index_cache_in_place_holds_the_copying_calls_index_keys(dtype):
    errors = _decode_index_cache_in_place(dtype)  # the prefill and four decode steps, each checked as it ran
    assert len(errors) == 5 and max(errors) <= 8 * float(np.finfo(dtype).eps), errors


def test_an_index_cache_written_one_row_early_fails(monkeypatch):
    """The mutant: the index keys written at P - 1 (an off-by-one a port makes): the check above fails at the first
    decode step (at the prefill XLA clamps the offset -1 to 0: the same write)."""
    from impl_tf import tf_only

    real = tf_only.write_rows
    monkeypatch.setattr(tf_only, "write_rows", lambda buffer, value, start, axis: real(buffer, value, start - 1, axis))
    with pytest.raises(AssertionError, match=r"float64 P=5: the index buffer's rows 0..5 differ"):
        _decode_index_cache_in_place("float64")


@pytest.mark.parametrize("name", list(indexer_refusals()))
def test_indexer_refusals_in_the_contracts_words(name):
    """A layer with an indexer: its cache's index keys required and sized, topk_indices refused beside it."""
    changes, message = indexer_refusals()[name]
    with pytest.raises(ValueError, match=message):
        tf_adapter.forward(*indexer_call(changes))


@pytest.mark.parametrize("name", ["indexer_dsa_decode", "indexer_m3_blocks"])
def test_the_indexer_runs_inside_tf_function(name):
    """impl_tf's indexer is keras.ops with nothing read to the host (static shapes): the layer with an indexer
    called inside tf.function selects keys the tolerance policy accepts against the float64 reference's, and
    its output is the reference's within the case's float32 tolerance."""
    from conformance.suite.selection import judge_call_selection
    from impl_tf.layer import MultiHeadAttention

    case = CASES[name]
    options = case.options("float32")
    tensors, inputs = cast_tensors(make_tensors(case), "float32"), cast_inputs(make_inputs(case), "float32")
    layer = MultiHeadAttention.from_tensors(case.config, tensors, dtype="float32")
    kwargs = tf_adapter._kwargs(inputs, options)
    q, k, v = (None if inputs.get(n) is None else tf.constant(inputs[n]) for n in ("query", "key", "value"))
    output, selection = tf.function(lambda q, k, v: layer(q, k, v, return_selection=True, **kwargs))(q, k, v)
    verdict = judge_call_selection(case.config, make_tensors(case), make_inputs(case), options, selection.numpy(),
                                   dtype="float32")
    assert verdict.ok, verdict
    expected = expected_for(case, "float32")
    assert_close("output", output.numpy(), expected["output"], config=case.config, dtype="float32",
                 quantity="output", B=case.B, T=case.T, S=case.S_total, logits=expected["logits"])
