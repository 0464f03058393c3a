"""impl_tf (Keras on TensorFlow) against the float64 NumPy reference.

Every case of conformance.suite.cases.CASES in every dtype: output, returned
weights and gradients (tf.GradientTape, through impl_tf.adapter) under the
one tolerance policy (conformance.suite.tolerance). For float16 and bfloat16 the
policy's floor is the NumPy reference's own error in that dtype. Then the
mask builders, the weight round trips (.keras and canonical tensors), error
wording, tf.function / XLA, the fused fast path (no weights, no trace), the
chunked path (chunk_size=), and the GPU (skipped with a reason without one).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os

import numpy as np
import pytest

INSTALL = "TensorFlow/Keras not installed: pip install -c constraints/cpu.txt '.[tf]'"
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
tf = pytest.importorskip("tensorflow", reason=INSTALL)
keras = pytest.importorskip("keras", reason=INSTALL)

from assertions import ulps_between  # noqa: E402
from reference_checks import (  # noqa: E402
    assert_case_conforms,
    assert_nan_rows,
    assert_spec_gradients,
    bias_masked_rows_call,
    nan_key_call,
)

import impl_numpy  # noqa: E402
import impl_numpy.adapter as ref  # noqa: E402
import impl_tf  # noqa: E402
import weights  # noqa: E402
from conformance.suite.cases import (  # noqa: E402
    CASES,
    LONG_GRID,
    MHA_CASES,
    Case,
    cast_inputs,
    cast_tensors,
    make_inputs,
    make_tensors,
    output_cotangent,
)
from conformance.suite.tolerance import assert_close, max_finite_abs  # noqa: E402
from impl_tf import adapter  # noqa: E402
from impl_tf import attention as tf_attention  # noqa: E402
from impl_tf import chunked as tf_chunked  # noqa: E402
from impl_tf import functional as tf_functional  # noqa: E402

pytestmark = pytest.mark.tf

DTYPES = ("float64", "float32", "float16", "bfloat16")
HAS_GPU = bool(tf.config.list_physical_devices("GPU"))
needs_gpu = pytest.mark.skipif(
    not HAS_GPU, reason="no GPU visible to TensorFlow (tf.config.list_physical_devices('GPU') is empty); "
    "install tensorflow[and-cuda] on a CUDA machine to run")
WEIGHT_CASES = [name for name, case in CASES.items() if case.return_weights]


# -- computed once per case and dtype -------------------------------------------------

def _max_abs_error(actual, expected) -> float:
    """Largest |actual - expected| over finite pairs; NaN matching NaN counts 0."""
    a, r = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    err = np.abs(a - r)
    err = np.where(np.isnan(a) & np.isnan(r), 0.0, err)
    finite = err[np.isfinite(err)]
    return float(finite.max()) if finite.size else 0.0


def _inputs(case, dtype):
    return cast_inputs(make_inputs(case), dtype)


def _cotangent(case, dtype):
    return output_cotangent(case).astype(weights.dtype_from_name(dtype))


@functools.cache
def reference(case_name: str) -> dict:
    """float64 NumPy reference: forward (with trace) and vjp."""
    case = CASES[case_name]
    tensors, inputs, options = make_tensors(case), make_inputs(case), case.options("float64")
    forward = ref.forward(case.config, tensors, inputs, options, trace=True)
    back = ref.vjp(case.config, tensors, inputs, options, output_cotangent(case))
    return {"forward": forward, "grads": back["grads"], "logits": dict(forward["trace"])["logits"]}


@functools.cache
def same_precision_error(case_name: str, dtype: str) -> dict:
    """The NumPy reference run in `dtype`: its max abs error vs float64 per quantity."""
    case = CASES[case_name]
    tensors, inputs, options = cast_tensors(make_tensors(case), dtype), _inputs(case, dtype), case.options(dtype)
    forward = ref.forward(case.config, tensors, inputs, options)
    back = ref.vjp(case.config, tensors, inputs, options, _cotangent(case, dtype))
    r = reference(case_name)
    errors = {"output": _max_abs_error(forward["output"], r["forward"]["output"])}
    if "weights" in forward:
        errors["weights"] = _max_abs_error(forward["weights"], r["forward"]["weights"])
    errors.update({f"grad:{n}": _max_abs_error(g, r["grads"][n]) for n, g in back["grads"].items()})
    return errors


@functools.cache
def tf_run(case_name: str, dtype: str) -> dict:
    case = CASES[case_name]
    tensors, inputs, options = cast_tensors(make_tensors(case), dtype), _inputs(case, dtype), case.options(dtype)
    forward = adapter.forward(case.config, tensors, inputs, options)
    back = adapter.vjp(case.config, tensors, inputs, options, _cotangent(case, dtype))
    return {"forward": forward, "vjp": back}


def _close(name, actual, expected, case, dtype, quantity, spe_key):
    spe = same_precision_error(case.name, dtype)[spe_key] if dtype in ("float16", "bfloat16") else None
    return assert_close(
        name, actual, expected, config=case.config, dtype=dtype, quantity=quantity, B=case.B, T=case.T, S=case.S,
        logits=reference(case.name)["logits"], same_precision_error=spe,
    )


def _check_dtype(name, array, dtype):
    want = weights.dtype_from_name(dtype)
    assert array.dtype == want, f"{name}: dtype {array.dtype}, expected {want}"


# -- the case grid -------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case_name", list(MHA_CASES))
def test_case_matches_reference(case_name, dtype):
    """Output, weights and every gradient, judged exactly as `mha check` does."""
    assert_case_conforms(CASES[case_name], dtype, "tf", adapter)
    run = tf_run(case_name, dtype)
    for name, g in run["vjp"]["grads"].items():
        _check_dtype(f"grad {name}", g, dtype)


def test_weights_only_when_asked():
    case = CASES["no_weights"]
    answer = tf_run(case.name, "float32")["forward"]
    assert sorted(answer) == ["output"], f"return_weights=False answered keys {sorted(answer)}"


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_self_attention_grads_fold_into_query(dtype):
    """key and value omitted: their gradients land on query, as in the reference."""
    case = CASES["causal_square"]
    inputs = {"query": _inputs(case, dtype)["query"]}
    tensors, options = cast_tensors(make_tensors(case), dtype), case.options(dtype)
    got = adapter.vjp(case.config, tensors, inputs, options, _cotangent(case, dtype))["grads"]
    want = ref.vjp(case.config, make_tensors(case), {"query": make_inputs(case)["query"]}, case.options("float64"),
                   output_cotangent(case))["grads"]
    assert list(got) == list(want), f"gradient names {list(got)}, reference has {list(want)}"
    magnitudes = impl_numpy.multi_head_attention_vjp(case.config, make_tensors(case), make_inputs(case)["query"],
                                                     d_output=output_cotangent(case), is_causal=case.is_causal,
                                                     gradient_magnitudes=True)[2]
    for name in got:
        assert_close(f"self-attention grad {name}", got[name], want[name], config=case.config, dtype=dtype,
                     quantity="grad", B=case.B, T=case.T, S=case.S, logits=reference(case.name)["logits"],
                     scale_floor=max_finite_abs(magnitudes[name]))


@pytest.mark.filterwarnings("ignore:invalid value encountered in subtract:RuntimeWarning")  # -inf - -inf in compare()
@pytest.mark.parametrize("case_name", ["self_basic", "gqa", "mask_and_bias_causal", "dropout_train"])
def test_trace_stages(case_name):
    """Every stage, by impl_numpy's names, against the float64 reference's stage."""
    case = CASES[case_name]
    got = adapter.forward(case.config, cast_tensors(make_tensors(case), "float32"), _inputs(case, "float32"),
                          case.options("float32"), trace=True)["trace"]
    want = reference(case_name)["forward"]["trace"]
    assert [s for s, _ in got] == [s for s, _ in want], f"stages {[s for s, _ in got]}, the spec's {[s for s, _ in want]}"
    for (stage, value), (_, expected) in zip(got, want):
        _close(f"{case_name} stage {stage}", value, expected, case, "float32", "stage", None)


def test_functional_entry_point_matches_reference():
    case = CASES["mask_and_bias_causal"]
    inputs, options = make_inputs(case), case.options("float64")
    out, w = impl_tf.multi_head_attention(
        case.config, make_tensors(case), inputs["query"], inputs["key"], inputs["value"], mask=inputs["mask"],
        bias=inputs["bias"], is_causal=True, return_weights=True,
    )
    r = reference(case.name)["forward"]
    assert options["return_weights"]
    _close("functional output", np.asarray(out), r["output"], case, "float64", "output", None)
    _close("functional weights", np.asarray(w), r["weights"], case, "float64", "weights", None)


def _stage_inputs(stage, dtype):
    """Non-negative data (no cancellation) with long reductions, NumPy arrays in `dtype`."""
    rng = np.random.default_rng(len(stage))
    dt = weights.dtype_from_name(dtype)
    u = lambda *shape: rng.random(shape).astype(dt)  # noqa: E731
    logits = (rng.standard_normal((2, 2, 8, 512)) * 3).astype(dt)
    return {
        "project": lambda f: f.project(u(2, 8, 256), u(256, 2, 4) / dt.type(16), u(2, 4)),
        "logits": lambda f: f.logits(u(2, 4, 8, 256), u(2, 2, 8, 256), 0.0625),
        "mask": lambda f: f.mask(logits, None, rng.random((2, 1, 8, 512)).astype(np.float32)),
        "softmax": lambda f: f.softmax(logits, "zero"),
        "dropout": lambda f: f.dropout(u(2, 2, 8, 512), rng.random((2, 2, 8, 512)) < 0.7, 0.3),
        "attend": lambda f: f.attend(u(2, 4, 8, 512) / dt.type(512), u(2, 2, 512, 4)),
        "output": lambda f: f.output(u(2, 8, 256), u(32, 8, 4) / dt.type(16), u(4)),
    }[stage]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("stage", ["project", "logits", "mask", "softmax", "dropout", "attend", "output"])
def test_precision_rule_16bit_stages(stage, dtype):
    """The spec's precision rule: a 16-bit stage is its float32 arithmetic
    rounded once to 16 bits. On non-negative data two float32 evaluations
    differ by under n*2**-24 relative (no cancellation), far below a 16-bit
    ulp, so the rounded results are equal or one ulp apart; arithmetic in 16
    bits (e.g. softmax's exp and sum) lands several ulps away. This checks the
    rule, not accuracy (that is the tolerance policy's job, above)."""
    from impl_numpy import functional as np_functional

    got = np.asarray(keras.ops.convert_to_numpy(_stage_inputs(stage, dtype)(tf_functional)))
    want = _stage_inputs(stage, dtype)(np_functional)
    assert got.dtype == want.dtype, f"{stage}: dtype {got.dtype}, the spec's {want.dtype}"
    ulps = ulps_between(got, want, dtype)
    worst = np.unravel_index(int(np.argmax(ulps)), ulps.shape)
    assert ulps.max() <= 1, (
        f"{stage} {dtype}: {ulps.max():g} ulps from the spec at {list(worst)} "
        f"(got {got[worst]!r}, spec {want[worst]!r}); {int((ulps > 1).sum())} of {ulps.size} beyond 1 ulp"
    )


# -- the layer: Keras layout, split_heads, seeds, masks from Keras --------------------------

def _layer(case_name="gqa", dtype="float64", **kwargs):
    case = CASES[case_name]
    return case, impl_tf.MultiHeadAttention.from_tensors(case.config, cast_tensors(make_tensors(case), dtype), **kwargs)


def test_dense_layout_and_split_heads():
    case, layer = _layer("gqa")
    c = case.config
    shapes = {d.name: tuple(d.kernel.shape) for d in (layer.wq, layer.wk, layer.wv, layer.wo)}
    want = {"wq": (c.query_dim, c.num_heads * c.head_dim), "wk": (c.key_dim, c.num_kv_heads * c.head_dim),
            "wv": (c.value_dim, c.num_kv_heads * c.value_head_dim), "wo": (c.num_heads * c.value_head_dim, c.out_dim)}
    assert shapes == want, f"Dense kernels {shapes}, expected {want}"
    inputs = make_inputs(case)
    _, entries = layer.trace(inputs["query"], inputs["key"], inputs["value"])
    stages = {e.stage: np.asarray(e.value) for e in entries}
    projected = layer.wq(inputs["query"])  # the Dense layer itself, Keras's matmul + bias
    _close("wq(query)", np.asarray(projected), stages["query.project"], case, "float64", "stage", None)
    split = np.asarray(layer.split_heads(stages["query.project"], case.B))
    assert split.shape == (case.B, c.num_heads, case.T, c.head_dim), f"split_heads shape {split.shape}"
    assert np.array_equal(split, stages["query.split_heads"]), (
        f"split_heads differs from the stage: max abs {np.abs(split - stages['query.split_heads']).max()}"
    )
    split_k = np.asarray(layer.split_heads(stages["key.project"], case.B, c.num_kv_heads))
    assert np.array_equal(split_k, stages["key.split_heads"]), f"key split_heads shape {split_k.shape}"


def test_call_seed_is_reproducible_and_layer_seed_draws():
    case = CASES["dropout_train"]
    inputs = make_inputs(case)
    args = (inputs["query"], inputs["key"], inputs["value"])
    _, layer = _layer(case.name)
    a = np.asarray(layer(*args, training=True, seed=7))
    b = np.asarray(layer(*args, training=True, seed=7))
    c = np.asarray(layer(*args, training=True, seed=8))
    assert np.array_equal(a, b), f"seed 7 twice differs by {np.abs(a - b).max()}"
    assert not np.array_equal(a, c), "seeds 7 and 8 gave the same dropout"
    eval_out = np.asarray(layer(*args, training=False))
    assert not np.array_equal(a, eval_out), "training with dropout=0.25 equals inference"
    _, seeded = _layer(case.name, seed=3)
    d, e = (np.asarray(seeded(*args, training=True)) for _ in range(2))
    assert not np.array_equal(d, e), "the layer's SeedGenerator drew the same keep-mask twice"
    with pytest.raises(ValueError) as err:
        layer(*args, training=True)
    want = "training with dropout=0.25 needs dropout_mask (a bool keep-mask) or seed; got neither"
    assert str(err.value) == want, f"{str(err.value)!r} != {want!r}"


def test_keras_padding_masks_become_the_mask():
    """Embedding(mask_zero=True) style (B, L) masks on the inputs act as the contract mask."""
    case, layer = _layer("cross_basic")
    inputs = make_inputs(case)
    q_len, kv_len = np.array([4, 2]), np.array([6, 3])
    q_mask = np.arange(case.T)[None] < q_len[:, None]  # (B, T)
    kv_mask = np.arange(case.S)[None] < kv_len[:, None]  # (B, S)
    q, k, v = (tf.constant(inputs[n]) for n in ("query", "key", "value"))
    q._keras_mask, k._keras_mask, v._keras_mask = tf.constant(q_mask), tf.constant(kv_mask), tf.constant(kv_mask)
    got = layer(q, k, v)
    explicit = q_mask[:, None, :, None] & kv_mask[:, None, None, :]  # (B, 1, T, S)
    want = layer(inputs["query"], inputs["key"], inputs["value"], mask=explicit)
    got_np, want_np = np.asarray(got), np.asarray(want)
    assert np.array_equal(got_np, want_np), f"max abs {np.abs(got_np - want_np).max()}"
    out_mask = np.asarray(getattr(got, "_keras_mask", None))
    assert np.array_equal(out_mask, q_mask), f"output Keras mask {out_mask}, expected the query's {q_mask}"


def test_model_fit_with_embedding_masks_and_dropout():
    """Keras's own training loop: Embedding(mask_zero=True) masks, causal, dropout
    drawn from the layer's SeedGenerator, traced batches of two sizes."""
    config = weights.AttentionConfig(num_heads=2, query_dim=8, head_dim=4, dropout=0.1)
    tokens = keras.Input((6,), dtype="int32")
    embedded = keras.layers.Embedding(20, 8, mask_zero=True)(tokens)
    attended = impl_tf.MultiHeadAttention(config, seed=1)(embedded, is_causal=True)
    assert getattr(attended, "_keras_mask", None) is not None, "the query's Keras mask was not carried to the output"
    model = keras.Model(tokens, keras.layers.GlobalAveragePooling1D()(attended))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    x = np.random.default_rng(0).integers(1, 20, (16, 6))
    x[:, 4:] = 0  # padding
    y = np.random.default_rng(1).standard_normal((16, 8)).astype("float32")
    loss = model.fit(x, y, epochs=5, batch_size=5, verbose=0).history["loss"]
    assert all(np.isfinite(loss)) and loss[-1] < loss[0], f"loss per epoch {loss}"


# -- mask builders -----------------------------------------------------------------------

@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
@pytest.mark.parametrize("T,S", [(1, 1), (5, 5), (4, 6), (6, 4), (1, 7), (7, 1)])
def test_causal_mask_equals_reference(T, S, alignment):
    got = np.asarray(impl_tf.causal_mask(T, S, alignment))
    want = impl_numpy.causal_mask(T, S, alignment)
    assert got.dtype == np.bool_ and got.shape == want.shape, f"dtype {got.dtype} shape {got.shape}, want {want.shape}"
    assert np.array_equal(got, want), f"differs at {np.argwhere(got != want).tolist()}"


@pytest.mark.parametrize("lengths,S", [([3, 0, 5], 5), ([1], 1), (np.array([2, 7], np.int32), 7), ([0, 0], 3)])
def test_padding_mask_equals_reference(lengths, S):
    got = np.asarray(impl_tf.padding_mask(lengths, S))
    want = impl_numpy.padding_mask(lengths, S)
    assert got.dtype == np.bool_ and got.shape == want.shape, f"dtype {got.dtype} shape {got.shape}, want {want.shape}"
    assert np.array_equal(got, want), f"differs at {np.argwhere(got != want).tolist()}"


@pytest.mark.parametrize("call", [
    lambda m: m.causal_mask(3, 4, "center"),
    lambda m: m.padding_mask([[1, 2]], 4),
    lambda m: m.padding_mask([1.5, 2.0], 4),
    lambda m: m.padding_mask([1, 5], 4),
    lambda m: m.padding_mask([-1, 2], 4),
], ids=["alignment", "rank", "float", "too_long", "negative"])
def test_mask_builder_errors_match_reference(call):
    with pytest.raises(ValueError) as want:
        call(impl_numpy)
    with pytest.raises(ValueError) as got:
        call(impl_tf)
    assert str(got.value) == str(want.value), f"{str(got.value)!r} != {str(want.value)!r}"


# -- weights: canonical round trip, weight files, .keras, get_config --------------------------

ROUND_TRIP_CASES = ["gqa", "value_head_dim", "out_dim", "no_biases"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case_name", ROUND_TRIP_CASES)
def test_tensors_round_trip_bit_exact(case_name, dtype):
    case = CASES[case_name]
    tensors = cast_tensors(make_tensors(case), dtype)
    back = impl_tf.MultiHeadAttention.from_tensors(case.config, tensors).to_tensors()
    assert list(back) == list(case.config.tensor_shapes()), f"names {list(back)}"
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and back[name].shape == t.shape, (
            f"{name}: {back[name].dtype} {back[name].shape}, expected {t.dtype} {t.shape}"
        )
        differ = np.argwhere(back[name] != t)[:3].tolist()
        assert back[name].tobytes() == t.tobytes(), f"{name}: bytes differ, first at {differ}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_from_file_bit_exact(tmp_path, dtype):
    case = CASES["gqa"]
    path = tmp_path / f"w-{dtype}.safetensors"
    weights.save(path, case.config, cast_tensors(make_tensors(case), dtype))
    layer = impl_tf.MultiHeadAttention.from_file(path)
    config, stored = weights.load(path)
    assert layer.config == config, f"{layer.config} != {config}"
    back = layer.to_tensors()
    for name, t in stored.items():
        assert back[name].dtype == t.dtype, f"{name}: {back[name].dtype} vs {t.dtype}"
        assert back[name].tobytes() == t.tobytes(), f"{name}: bytes differ, first at {np.argwhere(back[name] != t)[:3]}"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_keras_file_round_trip(tmp_path, dtype):
    case, layer = _layer("mask_and_bias_causal", dtype, precision="highest")
    inputs = _inputs(case, dtype)
    call = dict(mask=inputs["mask"], bias=inputs["bias"], is_causal=True, return_weights=True)
    path = tmp_path / "layer.keras"
    keras.saving.save_model(layer, path)
    loaded = keras.saving.load_model(path)
    assert isinstance(loaded, impl_tf.MultiHeadAttention), f"loaded a {type(loaded).__name__}"
    assert loaded.config == layer.config and loaded.dtype_policy.name == dtype, f"{loaded.config} {loaded.dtype_policy}"
    for (name, a), b in zip(layer.to_tensors().items(), loaded.to_tensors().values()):
        assert a.tobytes() == b.tobytes(), f"{name} changed in the .keras round trip"
    for got, want in zip(loaded(inputs["query"], **call), layer(inputs["query"], **call)):
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        assert np.array_equal(got, want), f"outputs differ after load: max abs {np.abs(got - want).max()}"


def test_keras_model_file_round_trip(tmp_path):
    """The layer inside a functional Model: symbolic call, save, load, predict."""
    case, layer = _layer("causal_top_left", "float32")
    c = case.config
    q, k, v = keras.Input((case.T, c.query_dim)), keras.Input((case.S, c.key_dim)), keras.Input((case.S, c.value_dim))
    out = layer(q, k, v, is_causal=True)
    assert tuple(out.shape) == (None, case.T, c.out_dim), f"symbolic output shape {out.shape}"
    model = keras.Model([q, k, v], out)
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    inputs = _inputs(case, "float32")
    args = [inputs["query"], inputs["key"], inputs["value"]]
    got, want = loaded.predict(args, verbose=0), model.predict(args, verbose=0)
    assert np.array_equal(got, want), f"predict differs after load: max abs {np.abs(got - want).max()}"
    _close("model.predict", got, reference(case.name)["forward"]["output"], case, "float32", "output", None)


def test_get_config_from_config():
    case, layer = _layer("masked_rows_uniform", "float16", precision="tf32" if HAS_GPU else "highest", seed=11)
    config = layer.get_config()
    json.dumps(config)  # a .keras file stores it as JSON
    assert config["config"] == case.config.to_dict(), f"{config['config']} != {case.config.to_dict()}"
    clone = impl_tf.MultiHeadAttention.from_config(config)
    got = (clone.config, clone.dtype_policy.name, clone.device, clone.precision, clone.seed)
    want = (layer.config, "float16", layer.device, layer.precision, 11)
    assert got == want, f"from_config gave {got}, expected {want}"
    clone.set_tensors(layer.to_tensors())
    inputs = _inputs(case, "float16")
    a = np.asarray(layer(inputs["query"], inputs["key"], inputs["value"], mask=inputs["mask"]), np.float64)
    b = np.asarray(clone(inputs["query"], inputs["key"], inputs["value"], mask=inputs["mask"]), np.float64)
    assert np.array_equal(a, b), f"clone differs: max abs {np.abs(a - b).max()}"


# -- error wording: the reference's words, from every entry point ----------------------------

def _bad(**change):
    def make():
        case = CASES["cross_basic"]
        inputs = make_inputs(case)
        call = {"query": inputs["query"], "key": inputs["key"], "value": inputs["value"]}
        call.update(change)
        return case, call
    return make


B, T, S, N = 2, 4, 6, 2
rng = np.random.default_rng(0)
nan_bias = rng.standard_normal((B, 1, T, S))
nan_bias[1, 0, 2, 3] = np.nan
BAD_CALLS = {
    "query_rank": _bad(query=rng.standard_normal((T, 8))),
    "query_features": _bad(query=rng.standard_normal((B, T, 7))),
    "value_features": _bad(value=rng.standard_normal((B, S, 5))),
    "batch_mismatch": _bad(key=rng.standard_normal((3, S, 8)), value=rng.standard_normal((3, S, 8))),
    "length_mismatch": _bad(value=rng.standard_normal((B, S + 1, 8))),
    "empty_query": _bad(query=np.zeros((B, 0, 8))),
    "int_query": _bad(query=np.ones((B, T, 8), np.int64)),
    "float_mask": _bad(mask=np.ones((B, 1, T, S))),
    "int_mask": _bad(mask=np.ones((T, S), np.int32)),
    "mask_shape": _bad(mask=np.ones((B, 3, T, S), bool)),
    "mask_rank": _bad(mask=np.ones((S,), bool)),
    "mask_rank3_wrong_batch": _bad(mask=np.ones((T, T, S), bool)),
    "bias_int": _bad(bias=np.ones((T, S), np.int64)),
    "bias_shape": _bad(bias=np.ones((B, N, T, S + 1))),
    "bias_nan": _bad(bias=nan_bias),
    "bias_pos_inf": _bad(bias=np.full((T, S), np.inf)),
    "causal_alignment": _bad(is_causal=True, causal_alignment="center"),
    "is_causal_not_bool": _bad(is_causal="yes"),
    "dropout_mask_without_training": _bad(dropout_mask=np.ones((B, N, T, S), bool)),
    "dropout_mask_dtype": _bad(training=True, dropout_mask=np.ones((B, N, T, S))),
    "dropout_mask_shape": _bad(training=True, dropout_mask=np.ones((B, 1, T, S), bool)),
    "seed_not_int": _bad(training=True, seed=1.5),
}


def _reference_error(make):
    case, call = make()
    with pytest.raises(ValueError) as err:
        impl_numpy.multi_head_attention(case.config, make_tensors(case), **call)
    return case, call, str(err.value)


@pytest.mark.parametrize("bad", list(BAD_CALLS))
def test_error_wording_layer(bad):
    case, call, want = _reference_error(BAD_CALLS[bad])
    layer = impl_tf.MultiHeadAttention.from_tensors(case.config, make_tensors(case))
    with pytest.raises(ValueError) as err:
        layer(call.pop("query"), call.pop("key"), call.pop("value"), **call)
    assert str(err.value) == want, f"{str(err.value)!r} != {want!r}"


@pytest.mark.parametrize("bad", list(BAD_CALLS))
def test_error_wording_functional(bad):
    case, call, want = _reference_error(BAD_CALLS[bad])
    with pytest.raises(ValueError) as err:
        impl_tf.multi_head_attention(case.config, make_tensors(case), **call)
    assert str(err.value) == want, f"{str(err.value)!r} != {want!r}"


@pytest.mark.parametrize("bad", ["query_features", "float_mask", "causal_alignment", "dropout_mask_without_training",
                                 "bias_nan"])
def test_error_wording_adapter(bad):
    case, call, want = _reference_error(BAD_CALLS[bad])
    options = {k: call.pop(k) for k in ("is_causal", "causal_alignment", "training", "seed") if k in call}
    with pytest.raises(ValueError) as err:
        adapter.forward(case.config, make_tensors(case), call, options)
    assert str(err.value) == want, f"{str(err.value)!r} != {want!r}"
    with pytest.raises(ValueError) as err:
        adapter.vjp(case.config, make_tensors(case), call, options, output_cotangent(case))
    assert str(err.value) == want, f"vjp: {str(err.value)!r} != {want!r}"


def test_bad_weights_same_words_as_reference():
    case = CASES["gqa"]
    tensors = make_tensors(case)
    tensors["key.kernel"] = tensors["key.kernel"][:, :1]
    del tensors["output.bias"]
    tensors["extra"] = np.zeros(3)
    with pytest.raises(ValueError) as want:
        impl_numpy.MultiHeadAttention.from_tensors(case.config, tensors)
    with pytest.raises(ValueError) as got:
        impl_tf.MultiHeadAttention.from_tensors(case.config, tensors)
    assert str(got.value) == str(want.value), f"{str(got.value)!r} != {str(want.value)!r}"


def test_d_output_shape_error_matches_reference():
    case = CASES["cross_basic"]
    inputs, options = make_inputs(case), case.options("float64")
    bad = np.zeros((case.B, case.T + 1, case.config.out_dim))
    with pytest.raises(ValueError) as want:
        ref.vjp(case.config, make_tensors(case), inputs, options, bad)
    with pytest.raises(ValueError) as got:
        adapter.vjp(case.config, make_tensors(case), inputs, options, bad)
    assert str(got.value) == str(want.value), f"{str(got.value)!r} != {str(want.value)!r}"


@pytest.mark.parametrize("kwargs,message", [
    ({"device": "tpu"}, "device must be one of cpu, gpu: got 'tpu'"),
    ({"precision": "fast"}, "precision must be one of highest, tf32: got 'fast'"),
    ({"dtype": "mixed_float16"}, "dtype must be one policy for variables and arithmetic (float16, bfloat16, float32 or "
                                 "float64; the layer casts 16-bit to float32 itself): got mixed_float16"),
    ({"seed": 1.5}, "seed must be an integer: got 1.5"),
])
def test_layer_argument_errors(kwargs, message):
    with pytest.raises(ValueError) as err:
        impl_tf.MultiHeadAttention(CASES["self_basic"].config, **kwargs)
    assert str(err.value) == message, f"{str(err.value)!r} != {message!r}"


def test_gpu_request_without_gpu_is_refused():
    if HAS_GPU:
        pytest.skip("a GPU is present: the no-GPU error cannot occur here")
    want = "device gpu requested but TensorFlow sees no GPU (tf.config.list_physical_devices('GPU') is empty)"
    with pytest.raises(ValueError) as err:
        impl_tf.MultiHeadAttention(CASES["self_basic"].config, device="gpu")
    assert str(err.value) == want, f"{str(err.value)!r} != {want!r}"
    with pytest.raises(ValueError) as err:
        adapter.forward(CASES["self_basic"].config, make_tensors(CASES["self_basic"]),
                        make_inputs(CASES["self_basic"]), {}, device="gpu")
    assert str(err.value) == want, f"adapter: {str(err.value)!r} != {want!r}"
    assert adapter.devices() == ["cpu"], f"devices() {adapter.devices()} without a GPU"


# -- the backend: impl_tf picks TensorFlow, and refuses another -------------------------------

def _import_in_subprocess(env_backend, code):
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
    if env_backend is not None:
        env["KERAS_BACKEND"] = env_backend
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_import_selects_tensorflow_backend():
    done = _import_in_subprocess(None, "import impl_tf, keras; print(keras.backend.backend())")
    assert done.returncode == 0 and done.stdout.strip() == "tensorflow", (
        f"rc {done.returncode}, stdout {done.stdout!r}, stderr tail {done.stderr[-500:]!r}"
    )


# It needs jax as well as TensorFlow (keras started on the jax backend): marked jax too, so that tox's `all`
# env (every framework; it deselects a test marked with one framework only) runs it; the tf env has no jax.
@pytest.mark.jax
def test_import_picks_the_backend_keras_runs_on():
    """Keras already on jax: impl_tf runs there (tests/test_keras_backends.py judges it); a backend impl_tf
    has no form for (Keras's numpy backend, no autodiff) is refused with the reason."""
    pytest.importorskip("jax", reason="needs jax to start keras on another backend")
    done = _import_in_subprocess("jax", "import keras; import impl_tf; print(impl_tf._keras.BACKEND)")
    assert done.returncode == 0 and done.stdout.split()[-1] == "jax", f"rc {done.returncode}: {done.stderr[-700:]!r}"
    done = _import_in_subprocess("numpy", "import impl_tf")
    want = ("ImportError: impl_tf runs on Keras's tensorflow, jax, torch backends, but keras is running on 'numpy' "
            "(KERAS_BACKEND='numpy'); set KERAS_BACKEND before keras is first imported")
    assert done.returncode != 0 and want in done.stderr, f"rc {done.returncode}, stderr tail {done.stderr[-700:]!r}"


# -- graphs: tf.function and XLA ------------------------------------------------------------

@pytest.mark.parametrize("jit_compile", [False, True], ids=["tf.function", "xla"])
def test_tf_function(jit_compile):
    case, layer = _layer("mask_and_bias_causal", "float32")
    inputs = _inputs(case, "float32")

    @tf.function(jit_compile=jit_compile)
    def run(query, mask, bias):
        return layer(query, mask=mask, bias=bias, is_causal=True, return_weights=True)

    out, w = run(inputs["query"], inputs["mask"], inputs["bias"])
    r = reference(case.name)["forward"]
    judged = [_close("tf.function output", np.asarray(out), r["output"], case, "float32", "output", None),
              _close("tf.function weights", np.asarray(w), r["weights"], case, "float32", "weights", None)]
    assert all(c.ok and c.margin <= 1 for c in judged), [c.describe() for c in judged]


def test_tf_function_dynamic_batch_and_gradient():
    """A traced batch dimension (as model.fit traces) and a gradient inside the graph."""
    case, layer = _layer("cross_basic", "float32")
    c = case.config
    spec = [tf.TensorSpec((None, case.T, c.query_dim), tf.float32),
            tf.TensorSpec((None, case.S, c.key_dim), tf.float32)]

    @tf.function(input_signature=spec)
    def run(query, key):
        with tf.GradientTape() as tape:
            tape.watch(query)
            out = layer(query, key, key)
        return out, tape.gradient(out, query, output_gradients=tf.ones_like(out))

    inputs = _inputs(case, "float32")
    out, d_query = run(inputs["query"], inputs["key"])
    want = ref.forward(c, make_tensors(case), {**make_inputs(case), "value": make_inputs(case)["key"]},
                       case.options("float64"), trace=True)
    d_want = ref.vjp(c, make_tensors(case), {**make_inputs(case), "value": make_inputs(case)["key"]},
                     case.options("float64"), np.ones((case.B, case.T, c.out_dim)))["grads"]["query"]
    judged = [_close("dynamic-batch output", np.asarray(out), want["output"], case, "float32", "output", None),
              _close("dynamic-batch grad query", np.asarray(d_query), d_want, case, "float32", "grad", None)]
    assert all(c.ok and c.margin <= 1 for c in judged), [c.describe() for c in judged]


# -- the fused path (no weights, no trace) and the chunked path (chunk_size=) -------------------

NO_WEIGHTS = {name: dataclasses.replace(case, return_weights=False) for name, case in CASES.items()}


class Chunked:
    """The adapter with options["chunk_size"]; a traced forward (run_case's
    localisation of a failure) goes through the stages, which the chunked
    path refuses, so that a failure reports its stage rather than that refusal."""

    def __init__(self, chunk_size):
        self.chunk_size = chunk_size

    def devices(self):
        return adapter.devices()

    def forward(self, config, tensors, inputs, options, **kwargs):
        extra = {} if kwargs.get("trace") else {"chunk_size": self.chunk_size}
        return adapter.forward(config, tensors, inputs, {**options, **extra}, **kwargs)

    def vjp(self, config, tensors, inputs, options, d_output, **kwargs):
        return adapter.vjp(config, tensors, inputs, {**options, "chunk_size": self.chunk_size}, d_output, **kwargs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case_name", list(MHA_CASES))
def test_fused_path_matches_reference(case_name, dtype):
    """Without weights or trace a call runs fused_attention: every case's output,
    judged as `mha check` does. (Its gradients are test_case_matches_reference's:
    the vjp asks for no weights, so it differentiates this path.)"""
    assert_case_conforms(NO_WEIGHTS[case_name], dtype, "tf", adapter, gradients=False)


XLA_CASES = ["gqa", "mqa", "causal_bottom_right_long_query", "mask_bts", "bias_neg_inf", "mask_and_bias_causal",
             "masked_rows_zero", "masked_rows_uniform", "masked_rows_nan", "large_logits", "dropout_train"]


@pytest.mark.parametrize("case_name,dtype", [
    pytest.param(name, dtype, marks=() if dtype == "float32" else pytest.mark.slow)
    for name in XLA_CASES for dtype in ("float64", "float32", "bfloat16")
])
def test_fused_core_through_xla_matches_reference(case_name, dtype, monkeypatch):
    """Large calls run fused_attention compiled by XLA: forced here on the small
    cases, output and gradients (a compilation each: float32 by default, the
    other dtypes with the slow tests)."""
    monkeypatch.setattr(tf_attention, "XLA_MIN_SCORES", 0)
    assert_case_conforms(NO_WEIGHTS[case_name], dtype, "tf", adapter)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case_name", [name for name in MHA_CASES if name not in LONG_GRID])
def test_chunked_matches_reference(case_name, dtype):
    """Every case through chunk_size=2 (T, S of 1 to 6: full blocks, a last
    partial block, blocks on the causal diagonal), output and gradients. The
    realistic lengths (LONG_GRID: T 256 would be 16384 eager blocks of 2) run
    through the chunked path with `mha check`'s blocks (weights.paths.chunk_size)
    in test_long_profile and `mha check --paths chunked`."""
    assert_case_conforms(NO_WEIGHTS[case_name], dtype, "tf", Chunked(2))


def _cfg(**kw):
    return weights.AttentionConfig(**{"num_heads": 2, "query_dim": 8, "head_dim": 4, **kw})


# Longer sequences: several full key blocks per query block (the while loop), a last partial block,
# both causal alignments (bottom_right with T > S leaves the first rows no key at all), every
# masked_row policy with fully masked rows, GQA / MQA, bias with -inf, dropout.
LONG_CASES = {c.name: c for c in [
    Case("long_self_causal_gqa", _cfg(num_heads=4, num_kv_heads=2), T=37, S=37, mask="padding", bias="random",
         is_causal=True, return_weights=False),
    Case("long_cross_bottom_right_uniform", _cfg(masked_row="uniform", dropout=0.2), self_attention=False, T=29,
         S=41, mask="random_bts", is_causal=True, causal_alignment="bottom_right", training=True,
         return_weights=False),
    Case("long_cross_bottom_right_t_over_s_nan", _cfg(masked_row="nan", dropout=0.3), self_attention=False, T=41,
         S=23, bias="neg_inf", is_causal=True, causal_alignment="bottom_right", training=True, return_weights=False),
    Case("long_cross_empty_rows_mqa", _cfg(num_heads=3, num_kv_heads=1, masked_row="zero"), self_attention=False,
         T=33, S=40, mask="empty_rows", return_weights=False),
    Case("long_cross_uniform_dropout_empty_rows", _cfg(masked_row="uniform", dropout=0.25), self_attention=False,
         T=30, S=27, mask="empty_rows", bias="random", training=True, return_weights=False),
    Case("long_cross_nan_causal_empty_rows", _cfg(masked_row="nan"), self_attention=False, T=26, S=35,
         mask="empty_rows", is_causal=True, return_weights=False),
]}


@pytest.mark.parametrize("chunk", [8, 16])
@pytest.mark.parametrize("dtype", ["float64", "float32", "float16"])
@pytest.mark.parametrize("case_name", list(LONG_CASES))
def test_chunked_long_cases_match_reference(case_name, dtype, chunk):
    assert_case_conforms(LONG_CASES[case_name], dtype, "tf", Chunked(chunk))


XLA_FAST = {("long_self_causal_gqa", "float32"), ("long_cross_bottom_right_t_over_s_nan", "float32")}


@pytest.mark.parametrize("case_name,dtype", [
    pytest.param(name, dtype, marks=() if (name, dtype) in XLA_FAST else pytest.mark.slow)
    for name in LONG_CASES for dtype in ("float32", "bfloat16")
])
def test_chunked_key_blocks_through_xla_match_reference(case_name, dtype, monkeypatch):
    """Large key blocks run compiled by XLA: forced here, output and gradients
    (each case compiles several block shapes forward and backward: most are slow)."""
    monkeypatch.setattr(tf_chunked, "XLA_MIN_BLOCK", 0)
    assert_case_conforms(LONG_CASES[case_name], dtype, "tf", Chunked(8))


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
@pytest.mark.parametrize("T,S,chunk", [(16, 16, 4), (10, 18, 4), (18, 10, 4), (13, 13, 5)])
def test_chunked_skips_hidden_causal_blocks(T, S, chunk, alignment, monkeypatch):
    """Exactly the key blocks in which some query of the block sees some key run;
    the others are never computed. (Eager calls of the TF-op step, counted.)"""
    calls = []
    real = tf_chunked.key_block

    def counted(*args, **kwargs):
        calls.append((int(args[6]), int(args[7])))  # t0, s0
        return real(*args, **kwargs)

    monkeypatch.setattr(tf_chunked, "key_block", counted)
    config = _cfg()
    rng = np.random.default_rng(T * S)
    x, kv = rng.standard_normal((1, T, 8)), rng.standard_normal((1, S, 8))
    tensors = weights.init(config, seed=3, dtype="float64")
    got = impl_tf.multi_head_attention(config, tensors, x, kv, kv, is_causal=True, causal_alignment=alignment,
                                       chunk_size=chunk)
    offset = 0 if alignment == "top_left" else S - T
    want = sorted((t0, s0) for t0 in range(0, T, chunk) for s0 in range(0, S, chunk)
                  if s0 <= min(T, t0 + chunk) - 1 + offset)
    assert sorted(calls) == want, f"key blocks run {sorted(calls)}, expected {want}"
    expected = impl_numpy.multi_head_attention(config, tensors, x, kv, kv, is_causal=True, causal_alignment=alignment)
    err = np.abs(np.asarray(got) - expected).max()
    assert err <= 1e-13, f"max abs difference to the reference {err:.3g}"


@pytest.mark.parametrize("mode", ["tf.function", "xla", "traced batch"])
def test_chunked_in_graphs_with_gradient(mode):
    """The layer's chunk_size under tf.function and XLA (with a mask and a bias;
    and a traced batch size, as model.fit traces, without them), a GradientTape
    inside the graph, against the float64 reference's output and vjp."""
    case = LONG_CASES["long_self_causal_gqa"]
    if mode == "traced batch":
        case = dataclasses.replace(case, mask=None, bias=None)
    c = case.config
    layer = impl_tf.MultiHeadAttention.from_tensors(c, cast_tensors(make_tensors(case), "float32"))
    inputs, inputs64 = _inputs(case, "float32"), make_inputs(case)
    cotangent = _cotangent(case, "float32")
    spec = [tf.TensorSpec((None, case.T, c.query_dim), tf.float32)] if mode == "traced batch" else None

    @tf.function(jit_compile=mode == "xla", input_signature=spec)
    def run(query):
        with tf.GradientTape() as tape:
            tape.watch(query)
            out = layer(query, mask=inputs.get("mask"), bias=inputs.get("bias"), is_causal=True, chunk_size=8)
        return out, tape.gradient(out, query, output_gradients=cotangent)

    out, d_query = run(tf.constant(inputs["query"]))
    given = {k: inputs64[k] for k in ("query", "mask", "bias") if k in inputs64}
    options = case.options("float64")
    want = ref.vjp(c, make_tensors(case), given, options, output_cotangent(case))
    logits = dict(ref.forward(c, make_tensors(case), given, options, trace=True)["trace"])["logits"]
    magnitudes = impl_numpy.multi_head_attention_vjp(
        c, make_tensors(case), given["query"], d_output=output_cotangent(case), mask=given.get("mask"),
        bias=given.get("bias"), is_causal=True, gradient_magnitudes=True)[2]
    assert_close(f"chunked output ({mode})", np.asarray(out), want["output"], config=c, dtype="float32",
                 quantity="output", B=case.B, T=case.T, S=case.S, logits=logits)
    assert_close(f"chunked grad query ({mode})", np.asarray(d_query), want["grads"]["query"], config=c,
                 dtype="float32", quantity="grad", B=case.B, T=case.T, S=case.S, logits=logits,
                 scale_floor=max_finite_abs(magnitudes["query"]))


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "8"])
def test_chunk_size_errors_match_reference(bad, monkeypatch):
    """Same words as the reference, and before any projection runs."""
    case = CASES["cross_basic"]
    inputs = make_inputs(case)
    args = (case.config, make_tensors(case), inputs["query"], inputs["key"], inputs["value"])
    with pytest.raises(ValueError) as want:
        impl_numpy.multi_head_attention(*args, chunk_size=bad)

    def project(*args, **kwargs):
        raise AssertionError("a projection ran before chunk_size was checked")

    monkeypatch.setattr(tf_functional, "project", project)
    monkeypatch.setattr(tf_chunked, "project", project)
    with pytest.raises(ValueError) as got:
        impl_tf.multi_head_attention(*args, chunk_size=bad)
    assert str(got.value) == str(want.value), f"{str(got.value)!r} != {str(want.value)!r}"
    layer = impl_tf.MultiHeadAttention.from_tensors(case.config, make_tensors(case))
    with pytest.raises(ValueError) as got:
        layer(inputs["query"], inputs["key"], inputs["value"], chunk_size=bad)
    assert str(got.value) == str(want.value), f"layer: {str(got.value)!r} != {str(want.value)!r}"


def test_layer_chunk_size_default_and_config():
    """A layer built with chunk_size runs its calls chunked (the same result as a
    call's chunk_size, which overrides it), and keeps it through get_config."""
    case = LONG_CASES["long_self_causal_gqa"]
    inputs = _inputs(case, "float32")
    call = dict(mask=inputs["mask"], bias=inputs["bias"], is_causal=True)
    layer = impl_tf.MultiHeadAttention.from_tensors(case.config, cast_tensors(make_tensors(case), "float32"),
                                                    chunk_size=8)
    plain = impl_tf.MultiHeadAttention.from_tensors(case.config, cast_tensors(make_tensors(case), "float32"))
    got, want = np.asarray(layer(inputs["query"], **call)), np.asarray(plain(inputs["query"], chunk_size=8, **call))
    assert np.array_equal(got, want), f"layer chunk_size=8 differs from a call's chunk_size=8: {np.abs(got - want).max()}"
    clone = impl_tf.MultiHeadAttention.from_config(layer.get_config())
    assert clone.chunk_size == 8, f"chunk_size after from_config: {clone.chunk_size}"
    with pytest.raises(ValueError) as err:
        layer(inputs["query"], return_weights=True, **call)
    assert "chunk_size cannot be combined with return_weights" in str(err.value), str(err.value)
    with pytest.raises(ValueError) as err:
        impl_tf.MultiHeadAttention(case.config, chunk_size=0)
    assert str(err.value) == "chunk_size must be a positive integer: got 0", str(err.value)


@pytest.mark.parametrize("ask", ["return_weights", "trace"])
def test_chunked_refuses_weights_and_trace(ask):
    case = CASES["cross_basic"]
    inputs = make_inputs(case)
    args = (case.config, make_tensors(case), inputs["query"], inputs["key"], inputs["value"])
    kwargs = {"return_weights": True} if ask == "return_weights" else {"trace": []}
    with pytest.raises(ValueError) as want:
        impl_numpy.multi_head_attention(*args, chunk_size=4, **kwargs)
    with pytest.raises(ValueError) as got:
        impl_tf.multi_head_attention(*args, chunk_size=4, **kwargs)
    assert str(got.value) == str(want.value), f"{str(got.value)!r} != {str(want.value)!r}"


def test_chunked_needs_static_lengths():
    config = _cfg()
    tensors = weights.init(config, seed=0, dtype="float32")
    run = tf.function(lambda q: impl_tf.multi_head_attention(config, tensors, q, chunk_size=4), autograph=False,
                      input_signature=[tf.TensorSpec((2, None, 8), tf.float32)])
    with pytest.raises(ValueError) as err:
        run(tf.zeros((2, 6, 8)))
    want = "chunk_size needs the query and key lengths known when the graph is traced: got T=None, S=None"
    assert str(err.value) == want, f"{str(err.value)!r} != {want!r}"


@pytest.mark.parametrize("masked_row", ["zero", "uniform", "nan"])
@pytest.mark.parametrize("chunk", [None, 2, 3])
def test_nan_value_reaches_fully_masked_rows_as_in_the_spec(chunk, masked_row):
    """NaN in a value propagates (README): a fully masked row's weights (0 under
    "zero") meet it in the spec's attend, 0 * NaN, so that row's output is NaN
    too, in the float64 stages and in impl_numpy's chunked mode. The fused
    path (chunk None) and the chunked path must give the same rows NaN."""
    config = _cfg(masked_row=masked_row)
    tensors = weights.init(config, seed=5, dtype="float64")
    rng = np.random.default_rng(5)
    q, k, v = rng.standard_normal((1, 5, 8)), rng.standard_normal((1, 6, 8)), rng.standard_normal((1, 6, 8))
    v[0, 4, 0] = np.nan  # key 4's value
    mask = np.ones((5, 6), bool)
    mask[1] = False  # row 1: no allowed key
    mask[3, 4] = False  # row 3 hides key 4 (its weight there is 0 too)
    want = impl_numpy.multi_head_attention(config, tensors, q, k, v, mask=mask, trace=[])  # the stages
    got = np.asarray(impl_tf.multi_head_attention(config, tensors, q, k, v, mask=mask, chunk_size=chunk))
    want_rows, got_rows = np.isnan(want[0]).any(axis=-1), np.isnan(got[0]).any(axis=-1)
    assert want_rows.all(), f"the reference itself: NaN rows {want_rows.tolist()}"  # 0 * NaN everywhere
    assert np.array_equal(got_rows, want_rows), f"NaN rows {got_rows.tolist()}, the spec's {want_rows.tolist()}"


@pytest.mark.parametrize("kind", ["mask", "bias", "causal"])
@pytest.mark.parametrize("path", ["stages", "fused", "chunked"])
def test_a_nan_key_reaches_exactly_the_rows_that_see_it(path, kind):
    """As the spec (tests/test_numpy_reference.py): a NaN in key 4 reaches only
    the rows that see key 4; a bool mask, a -inf bias and the causal mask each
    hide it, on the stages, the fused path and chunk_size=2."""
    config, tensors, (q, k, v), options, sees_key = nan_key_call(kind)
    out = impl_tf.multi_head_attention(config, tensors, q, k, v, **options, return_weights=path == "stages",
                                       chunk_size=2 if path == "chunked" else None)
    assert_nan_rows(out[0] if path == "stages" else out, sees_key)


@pytest.mark.parametrize("masked_row", ["zero", "uniform", "nan"])
@pytest.mark.parametrize("path", ["stages", "fused", "chunked"])
def test_row_masked_by_bias_passes_the_spec_gradients(path, masked_row):
    """A row whose every key has bias -inf (no bool mask): GradientTape's
    gradients on each path (the stages, taken with return_weights; the fused
    path; chunk_size=2) equal impl_numpy's hand-written vjp in float64, NaN
    where it is NaN ("nan": the value gradient only) and nowhere else."""
    config, tensors, (q, k, v), bias, d_out, want = bias_masked_rows_call(masked_row)
    xs = [tf.constant(x) for x in (q, k, v)]
    with tf.GradientTape() as tape:
        tape.watch(xs)
        out = impl_tf.multi_head_attention(config, tensors, *xs, bias=bias, return_weights=path == "stages",
                                           chunk_size=2 if path == "chunked" else None)
        out = out[0] if path == "stages" else out
    got = tape.gradient(out, xs, output_gradients=tf.constant(d_out))
    assert_spec_gradients(dict(zip(("query", "key", "value"), got)), want)


def test_chunked_memory_is_blocks_not_t_by_s():
    """T = S = 4096, N = 4, causal: the chunked call's peak resident-set growth
    stays far below one (B, N, T, S) float32 array (256 MiB; the plain path
    holds several). Measured as `mha bench` does for TensorFlow on the CPU."""
    from conformance.bench.measure import rss_memory as _rss_memory

    config = weights.AttentionConfig(num_heads=4, query_dim=64, head_dim=16)
    tensors = {k: tf.constant(v) for k, v in weights.init(config, seed=0, dtype="float32").items()}
    x = tf.constant(np.random.default_rng(0).standard_normal((1, 4096, 64)).astype(np.float32))

    def call():
        return impl_tf.multi_head_attention(config, tensors, x, is_causal=True, chunk_size=256).numpy()

    call()  # compile the key-block steps
    peak, method, out = _rss_memory(call)
    if peak is None:
        pytest.skip(f"peak memory not measurable here: {method}")
    ts = config.num_heads * 4096 * 4096 * 4
    io = 2 * x.numpy().nbytes
    assert peak < ts / 4, (f"peak {peak / 2**20:.1f} MiB ({method}); one (B, N, T, S) array is {ts / 2**20:.0f} MiB, "
                           f"inputs+outputs {io / 2**20:.1f} MiB")
    assert np.isfinite(out).all(), "non-finite output"


# -- GPU (collected everywhere, run where TensorFlow sees one) -----------------------------------

GPU_CASES = ["self_basic", "gqa", "mask_and_bias_causal", "masked_rows_nan", "large_logits", "dropout_train"]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case_name", GPU_CASES)
def test_gpu_matches_reference(case_name, dtype):
    case = CASES[case_name]
    tensors, inputs = cast_tensors(make_tensors(case), dtype), _inputs(case, dtype)
    assert adapter.devices() == ["cpu", "gpu"], f"devices() {adapter.devices()}"
    layer = impl_tf.MultiHeadAttention.from_tensors(case.config, tensors, device="gpu")
    out = layer(inputs["query"], inputs["key"], inputs["value"], mask=inputs.get("mask"), bias=inputs.get("bias"),
                is_causal=case.is_causal, causal_alignment=case.causal_alignment, training=case.training,
                dropout_mask=inputs.get("dropout_mask"))
    assert "GPU" in out.device, f"output placed on {out.device}"
    assert_case_conforms(case, dtype, "tf", adapter, device="gpu")


@pytest.mark.gpu
@needs_gpu
def test_gpu_tf32_only_when_asked():
    """precision="tf32" passes the TF32 policy; "highest" passes float32's (TF32 switched off)."""
    case = CASES["large_logits"]
    tensors, inputs = cast_tensors(make_tensors(case), "float32"), _inputs(case, "float32")
    options = case.options("float32")
    r = reference(case.name)
    before = tf.config.experimental.tensor_float_32_execution_enabled()
    for precision in ("tf32", "highest"):
        out = adapter.forward(case.config, tensors, inputs, options, device="gpu", precision=precision)["output"]
        assert_close(f"gpu {precision}", out, r["forward"]["output"], config=case.config, dtype="float32",
                     quantity="output", B=case.B, T=case.T, S=case.S, logits=r["logits"], precision=precision)
    after = tf.config.experimental.tensor_float_32_execution_enabled()
    assert after == before, f"TF32 setting changed by the call: {before} -> {after}"


def test_the_adapter_reuses_its_layer_only_for_the_same_unchanged_tensors():
    """adapter._layer keeps the last Keras layer for the next call with the same tensors (mha check's
    forward and vjp on each path); a tensor changed in place, another dtype or a large model builds anew,
    and every answer is the reference's for the tensors as they are now."""
    case = CASES["self_basic"]
    tensors = {name: t.astype(np.float32) for name, t in make_tensors(case).items()}
    inputs = {name: v.astype(np.float32) for name, v in make_inputs(case).items()}
    options = case.options("float32") | {"return_weights": False}
    first = adapter.forward(case.config, tensors, inputs, options)["output"]
    layer = adapter._last["layer"]
    again = adapter.forward(case.config, tensors, inputs, options)["output"]
    assert adapter._last["layer"] is layer, "the same unchanged tensors must reuse the layer"
    np.testing.assert_array_equal(again, first)
    tensors["output.bias"] += 1.0  # in place: the same dict, the same array object
    changed = adapter.forward(case.config, tensors, inputs, options)["output"]
    assert adapter._last["layer"] is not layer, "a tensor changed in place must build a new layer"
    want = ref.forward(case.config, tensors, inputs, options)["output"]
    np.testing.assert_allclose(changed, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(changed - first, 1.0, rtol=1e-5)  # the bias moved every output by 1
    as64 = adapter.forward(case.config, {n: t.astype(np.float64) for n, t in tensors.items()}, inputs,
                           options | {"dtype": "float64"})["output"]
    assert as64.dtype == np.float64 and adapter._last["layer"] is not layer
