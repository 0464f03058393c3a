"""Backend keras-native-mha: keras.layers.MultiHeadAttention on TensorFlow.

The layer is built and filled from the canonical tensors by
impl_tf.native.to_native (layout keras-mha), in the tensors' dtype, and
called as layer(query, value, key=key, attention_mask=..., use_causal_mask=...,
return_attention_scores=...); gradients by tf.GradientTape, mapped back to
canonical names through the same layout table.

Masks: attention_mask is (B, T, S), True = attend (our polarity), one mask
for every head. Causal top-left is use_causal_mask=True (Keras' causal mask
is top-left); bottom-right is folded into attention_mask.

Measured difference: in float64 the scale 1/sqrt(head_dim) is rounded to
float32 (keras.ops.cast of a Python float goes through a float32 tensor), so
float64 results are only float32-accurate in the logits unless sqrt(head_dim)
is a power of two (see `known_difference`).

Windows: sliding_window=W, which lets query i see key j iff |i - j| < W,
counted from the top-left corner: window_left = window_right = W - 1, or
window_left = W - 1 under a causal mask. A one-sided window without causal,
or a bottom_right window over S > T keys, has no argument. The rest of the
modern contract (RoPE, cache, softcap, QK-norm, sinks, segment ids) has none
either: refused.

Cannot express: GQA, mixed bias flags (one use_bias), a scale other than
1/sqrt(head_dim), a per-head mask (B, N, T, S) with differing heads, an
additive bias (no argument for one), an explicit dropout mask.

A query row with no allowed key: Keras has two paths. With
return_attention_scores=True (or dropout > 0) it computes the weights itself
and its masked softmax zeroes masked positions: weights 0, output 0. Without
(the fused path, ops.dot_product_attention) the row gets uniform weights (the
mean of V). The call uses return_attention_scores = the case's
return_weights (forward and vjp alike), and such a row runs only where that
path's answer, measured by a probe call (`native_masked_row`), is the case's
masked_row.
"""

from __future__ import annotations

import math
import sys

import numpy as np

from . import (
    SELECTION_WHY,
    allowed4,
    check_default_scale,
    check_dropout,
    check_layout,
    check_masked_rows,
    classify_row,
    grads_to_canonical,
    order_grads,
    prepare_call,
    qkv,
    require,
    why_each,
)

require("keras", "tensorflow")
if "keras" in sys.modules and sys.modules["keras"].backend.backend() != "tensorflow":
    raise ImportError(f"keras-native-mha needs Keras on the TensorFlow backend; keras is already running on "
                      f"{sys.modules['keras'].backend.backend()!r}")

NAME = "keras-native-mha"
LAYOUT = "keras-mha"


def known_difference(case, dtype: str) -> str | None:
    """The expected failure of a case, with its reason; None if it must pass."""
    exact = 1.0 / math.sqrt(case.config.head_dim)
    if dtype == "float64" and float(np.float32(exact)) != exact:
        return (f"float64: the layer scales by ops.cast(1/sqrt(key_dim), 'float64'), which converts the Python float "
                f"through float32 first: 1/sqrt({case.config.head_dim}) = {float(np.float32(exact))!r} instead of "
                f"{exact!r}, a relative error of {abs(float(np.float32(exact)) / exact - 1):.1e} in every logit")
    return None


def _keras():
    from impl_tf._keras import keras, tf  # sets KERAS_BACKEND=tensorflow before keras is imported

    return keras, tf


def devices() -> list[str]:
    _, tf = _keras()
    return ["cpu"] + (["gpu"] if tf.config.list_physical_devices("GPU") else [])


_ROWS: dict[tuple, str] = {}


def native_masked_row(device: str, dtype: str, scores: bool) -> str:
    """What the layer gives for a query row with no allowed key, measured (masked_row_of); cached."""
    key = (device, dtype, scores)
    if key not in _ROWS:
        keras, _ = _keras()
        _ROWS[key] = masked_row_of(keras.layers.MultiHeadAttention, device, dtype, scores)
    return _ROWS[key]


def masked_row_of(layer_class, device: str, dtype: str, scores: bool) -> str:
    """What a Keras MultiHeadAttention (or a subclass: keras-hub's CachedMultiHeadAttention) gives for a
    query row with no allowed key, measured: identity projections, one head, query 0 with every key masked."""
    keras, _ = _keras()
    from impl_tf.layer import placement

    with placement(device):
        layer = layer_class(num_heads=1, key_dim=2, use_bias=False, dtype=dtype)
        layer.build((1, 2, 2), (1, 3, 2))
        eye = np.eye(2)
        for dense, kernel in ((layer.query_dense, eye.reshape(2, 1, 2)), (layer.key_dense, eye.reshape(2, 1, 2)),
                              (layer.value_dense, eye.reshape(2, 1, 2)), (layer.output_dense, eye.reshape(1, 2, 2))):
            dense.kernel.assign(kernel.astype(dense.kernel.dtype))
        q = np.ones((1, 2, 2), dtype=np.float32)  # (B, T, D)
        v = np.array([[[0.0, 2.0], [2.0, 4.0], [4.0, 0.0]]], dtype=np.float32)  # (B, S, D)
        allowed = np.ones((1, 2, 3), dtype=bool)
        allowed[0, 0] = False  # query 0: no key
        result = layer(keras.ops.cast(q, dtype), keras.ops.cast(v, dtype), attention_mask=allowed,
                       return_attention_scores=scores)
    out = result[0] if scores else result
    return classify_row(np.asarray(keras.ops.convert_to_numpy(keras.ops.cast(out, "float32")))[0, 0], v[0])


WHY = ("keras MultiHeadAttention takes sliding_window and nothing else of the modern contract (no RoPE, KV cache, "
       "softcap, QK-norm, sinks or segment-id argument)")


def sliding_window(config, shapes, options) -> int | None:
    """sliding_window=W for the config's window, None without one. Keras lets
    query i see key j iff |i - j| < W (measured by `mha check --conventions`),
    counted from the top-left corner: window_left = window_right = W - 1, or
    window_left = W - 1 under a causal mask (which hides the right side)."""
    left, right = config.window_left, config.window_right
    if left < 0 and right < 0:
        return None
    causal = bool(options.get("is_causal"))
    if options.get("causal_alignment", "top_left") == "bottom_right" and shapes.T != shapes.S_total:
        raise NotImplementedError(f"{NAME}: sliding_window counts from the top-left corner (|i - j| < W); a "
                                  f"bottom_right window over T={shapes.T} queries and S={shapes.S_total} keys has no "
                                  "argument")
    if left >= 0 and (right == left or causal):
        return left + 1
    raise NotImplementedError(f"{NAME}: sliding_window=W is symmetric (|i - j| < W: W - 1 keys on each side); "
                              f"window_left={left}, window_right={right}" + ("" if causal else " without a causal mask")
                              + " has no argument")


def _prepare(config, tensors, inputs, options, device, precision):
    dtype, tensors, inputs, shapes = prepare_call(NAME, config, tensors, inputs, options, device, precision, devices(),
                                                  expresses=("window_left", "window_right"), why=why_each(config, inputs, options, WHY, {"topk_indices": SELECTION_WHY}))
    sliding_window(config, shapes, options)  # refuses a window it cannot express before anything runs
    check_layout(NAME, LAYOUT, config)
    check_default_scale(NAME, config)
    check_dropout(NAME, config, inputs, options)
    if inputs.get("bias") is not None:
        raise NotImplementedError(f"{NAME}: MultiHeadAttention takes no additive attention bias (attention_mask is "
                                  "boolean)")
    scores = bool(options.get("return_weights", False)) or config.dropout > 0
    path = "return_attention_scores=True" if scores else "the fused path (no scores)"
    check_masked_rows(NAME, config, shapes, inputs, options, native_masked_row(device, dtype, scores),
                      f"keras MultiHeadAttention, {path}, on {device}, {dtype}")
    return dtype, tensors, inputs, shapes


def _call_args(config, shapes, inputs, options) -> dict:
    """attention_mask (B, T, S) and use_causal_mask for the case."""
    top_left = bool(options.get("is_causal")) and options.get("causal_alignment", "top_left") == "top_left"
    allowed = allowed4(shapes, inputs, options, causal=bool(options.get("is_causal")) and not top_left)
    args = {"use_causal_mask": top_left}
    if allowed is not None:
        if allowed.shape[1] != 1 and not (allowed == allowed[:, :1]).all():
            raise NotImplementedError(f"{NAME}: attention_mask is (B, T, S), one mask for every head; the case's mask "
                                      f"differs between heads (shape {tuple(np.shape(inputs['mask']))})")
        args["attention_mask"] = np.broadcast_to(allowed[:, 0], (shapes.B, shapes.T, shapes.S))  # (B, T, S)
    return args


def _build(config, tensors, device, window: int | None = None):
    """The layer with the canonical weights; with `window`, keras's own
    sliding_window argument set (the layer built here, filled by to_native)."""
    from impl_tf.layer import placement
    from impl_tf.native import to_native

    with placement(device):
        if window is None:
            return to_native(config, tensors)
        keras, _ = _keras()
        layer = keras.layers.MultiHeadAttention(
            num_heads=config.num_heads, key_dim=config.head_dim, value_dim=config.value_head_dim,
            output_shape=config.out_dim, use_bias=config.use_query_bias, dropout=config.dropout,
            dtype=np.dtype(next(iter(tensors.values())).dtype).name, sliding_window=window)
        layer.build(query_shape=(None, None, config.query_dim), value_shape=(None, None, config.value_dim),
                    key_shape=(None, None, config.key_dim))
        return to_native(config, tensors, into=layer, layout=LAYOUT)


def forward(config, tensors, inputs, options, *, device="cpu", precision="highest", trace=False):
    keras, tf = _keras()
    from impl_tf.layer import matmul_precision, placement

    dtype, tensors, inputs, shapes = _prepare(config, tensors, inputs, options, device, precision)
    layer = _build(config, tensors, device, sliding_window(config, shapes, options))
    want = bool(options.get("return_weights", False))
    q, k, v = (tf.convert_to_tensor(x) for x in qkv(inputs))
    with placement(device), matmul_precision(precision):
        result = layer(q, v, key=k, return_attention_scores=want, training=False,
                       **_call_args(config, shapes, inputs, options))
    out, w = result if want else (result, None)
    answer = {"output": np.asarray(keras.ops.convert_to_numpy(out))}
    if want:
        answer["weights"] = np.asarray(keras.ops.convert_to_numpy(w))  # (B, N, T, S)
    return answer


def _variables(layer) -> dict:
    """The layer's variables by path relative to the layer (query/kernel ...)."""
    prefix = layer.path + "/"
    return {(v.path[len(prefix):] if v.path.startswith(prefix) else v.path.split("/", 1)[-1]): v for v in layer.weights}


def vjp(config, tensors, inputs, options, d_output, *, device="cpu", precision="highest"):
    keras, tf = _keras()
    from impl_tf.layer import matmul_precision, placement

    dtype, tensors, inputs, shapes = _prepare(config, tensors, inputs, options, device, precision)
    layer = _build(config, tensors, device, sliding_window(config, shapes, options))
    want = bool(options.get("return_weights", False))  # the forward's path (see the docstring)
    xs = {n: tf.convert_to_tensor(x) for n, x in zip(("query", "key", "value"), qkv(inputs))}
    variables = _variables(layer)
    with placement(device), matmul_precision(precision):
        with tf.GradientTape() as tape:
            tape.watch(list(xs.values()))
            result = layer(xs["query"], xs["value"], key=xs["key"], return_attention_scores=want, training=False,
                           **_call_args(config, shapes, inputs, options))
            out = result[0] if want else result
        d_out = np.asarray(d_output)
        if d_out.shape != tuple(out.shape):
            raise ValueError(f"d_output must have shape (B, T, O) = {tuple(out.shape)}: got {d_out.shape}")
        sources = [*xs.values(), *variables.values()]
        found = tape.gradient(out, sources, output_gradients=tf.cast(d_out, out.dtype))
    as_numpy = lambda g, src: np.asarray(keras.ops.convert_to_numpy(tf.zeros_like(src) if g is None else g))  # noqa: E731
    grads = {n: as_numpy(g, s) for n, s, g in zip([*xs, *variables], sources, found)}
    canonical = grads_to_canonical(LAYOUT, {n: grads[n] for n in variables})
    canonical.update({n: grads[n] for n in xs})
    return {"output": np.asarray(keras.ops.convert_to_numpy(out)), "grads": order_grads(config, canonical)}
