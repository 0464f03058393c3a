"""Backend keras-hub: keras_hub.layers.CachedMultiHeadAttention with
keras_hub.layers.RotaryEmbedding, on TensorFlow (keras-hub 0.32).

CachedMultiHeadAttention is keras.layers.MultiHeadAttention with a cache
argument: it is built and filled from the canonical tensors as keras-native-mha
is (impl_tf.native.to_native, layout keras-mha) and called as layer(query,
value, key=, attention_mask=, cache=, cache_update_index=,
return_attention_scores=); gradients by tf.GradientTape through the same
layout table.

RoPE: the layer has no RoPE argument; keras-hub's own RoPE attention layers
(GPT-NeoX, Llama) turn the projected q and k with RotaryEmbedding right after
the query and key projections, before the key joins the cache. The backend
does the same: the layer's _query_dense and _key_dense are wrapped so that
their (B, L, N, H) output goes through RotaryEmbedding(max_wavelength=theta,
rope_type=, scaling_factor=, ...) with the call's positions (its `positions`
argument). The cache therefore holds keys after RoPE, as the contract's does.
RotaryEmbedding pairs half-split features (i, i + R/2) (`mha check
--conventions` measures it); an interleaved config runs through the q/k
feature permutation of weights.layouts.repair_pairing (every q . k
unchanged), past_key permuted on the way in and present_key back. A
rotary_dim < head_dim turns the first rotary_dim features and passes the rest
(as keras-hub's GPT-NeoX attention slices them). Scalings: rope_type linear
(inverse frequencies / factor) and yarn (with its fixed attention factor
0.1 ln(factor) + 1); no llama3.

Decoding: cache (B, 2, P + S, N, H), the past at 0..P-1, cache_update_index=P:
the layer projects (and here rotates) the new keys and values and splices them
in at P; the returned cache is present_key / present_value. The call has no
causal flag (use_causal_mask is MultiHeadAttention.call's, which this layer
replaces), so causal, of either alignment, goes into attention_mask (B, T,
P + S), True = attend.

Measured differences ("known difference", float64 only): the scale
1/sqrt(head_dim) goes through float32 (as keras-native-mha's), and
RotaryEmbedding computes positions, inverse frequencies and angles in float32.

Cannot express ("unsupported", with the reason): GQA and mixed bias flags
(keras-mha weights), a scale other than 1/sqrt(head_dim), an additive bias,
per-head masks that differ, dropout in training, a cache with value_head_dim
!= head_dim (keys and values share one cache tensor), llama3 scaling, a yarn
attention factor other than keras-hub's, windows (sliding_window is applied
by MultiHeadAttention.call's mask builder, which CachedMultiHeadAttention.call
does not run), softcap, QK-norm, sinks and segment ids (no argument).

Gradients: with a past cache TensorFlow has none (the layer splices the new keys in with
keras.ops.slice_update, XlaDynamicUpdateSlice, which has no registered gradient: "gradient registry
has no entry for: XlaDynamicUpdateSlice"); such a vjp is refused in TensorFlow's words, the forward
pass still runs and is judged.

A query row with no allowed key: the layer's two paths as keras-native-mha's
(scores: 0; the fused path: uniform), measured by a probe of this layer.
"""

from __future__ import annotations

import math
import sys
import warnings

import numpy as np

from . import (
    SELECTION_WHY,
    allowed4,
    check_default_scale,
    check_dropout,
    check_layout,
    check_masked_rows,
    grads_to_canonical,
    order_grads,
    prepare_call,
    qkv,
    require,
    why_each,
)

require("keras", "tensorflow", "keras_hub")
if "keras" in sys.modules and sys.modules["keras"].backend.backend() != "tensorflow":
    raise ImportError(f"keras-hub needs Keras on the TensorFlow backend; keras is already running on "
                      f"{sys.modules['keras'].backend.backend()!r}")

NAME = "keras-hub"
LAYOUT = "keras-mha"
EXPRESSES = ("rope", "positions", "key_positions", "past_key", "past_value", "return_cache")
WHY = ("CachedMultiHeadAttention takes attention_mask, cache and cache_update_index, and RotaryEmbedding turns q and "
       "k: no window (sliding_window is applied only by MultiHeadAttention.call), softcap, QK-norm, sinks or "
       "segment-id argument")
# The frontier fields: read from keras-hub 0.32's source. Its public layers (keras_hub.layers) include AlibiBias
# and RMSNormalization; the rest lives inside models' own attention layers, which this wrapper does not use.
FRONTIER_WHY = {
    "topk_indices": SELECTION_WHY,
    "alibi": "keras_hub.layers.AlibiBias adds its own slopes (from alibi_bias_max, not a weight tensor) times "
             "j - (S - 1), not |pos_q - pos_k|, to scores it is handed, and CachedMultiHeadAttention has no bias "
             "argument to take it",
    "local_chunk": "CachedMultiHeadAttention has no chunk argument (keras-hub 0.32 has no Llama 4)",
    "past_key_positions": "CachedMultiHeadAttention's cache holds keys and values, not their positions (cache "
                          "slot j is position j)",
    "query_temperature": "CachedMultiHeadAttention scales every query alike (no temperature argument)",
    "qkv_clip": "CachedMultiHeadAttention has no clip argument",
    "output_gate": "CachedMultiHeadAttention has no gate argument (Qwen3.5's gate is inside keras-hub's own "
                   "Qwen3.5 attention layer, not in keras_hub.layers)",
    "value_norm": "CachedMultiHeadAttention has no value-norm argument (Gemma 4's v_norm is inside its own "
                  "attention layer)",
    "latent": "keras-hub 0.32 has no latent attention layer",
    "rope.scaling longrope": "keras_hub.layers.RotaryEmbedding takes rope_type linear, dynamic or yarn (Phi-3's "
                             "SU-scaled rotary class is model-internal, not in keras_hub.layers)",
    "rope.scaling proportional": "keras_hub.layers.RotaryEmbedding has no partial-frequency rule (Gemma 4's is "
                                 "inside its own attention layer)",
}


def _keras():
    from impl_tf._keras import keras, tf  # KERAS_BACKEND=tensorflow before keras is imported

    return keras, tf


def _hub():
    _keras()
    from keras_hub.layers import CachedMultiHeadAttention, RotaryEmbedding

    return CachedMultiHeadAttention, RotaryEmbedding


def known_difference(case, dtype: str) -> str | None:
    """The expected failure of a case, with its reason; None if it must pass."""
    if dtype != "float64":
        return None
    why = []
    exact = 1.0 / math.sqrt(case.config.head_dim)
    if float(np.float32(exact)) != exact:
        why.append(f"the scale 1/sqrt({case.config.head_dim}) goes through float32 ({float(np.float32(exact))!r} "
                   f"instead of {exact!r})")
    if case.config.rope is not None:
        why.append("RotaryEmbedding computes positions, inverse frequencies and angles in float32")
    return ("float64: " + "; ".join(why)) if why else None


def devices() -> list[str]:
    _, tf = _keras()
    return ["cpu"] + (["gpu"] if tf.config.list_physical_devices("GPU") else [])


_ROWS: dict[tuple, str] = {}


def native_masked_row(device: str, dtype: str, scores: bool) -> str:
    """What CachedMultiHeadAttention gives for a query row with no allowed key, measured by keras_native_mha's
    probe on this layer class; cached."""
    key = (device, dtype, scores)
    if key not in _ROWS:
        from .keras_native_mha import masked_row_of

        CachedMultiHeadAttention, _ = _hub()
        _ROWS[key] = masked_row_of(CachedMultiHeadAttention, device, dtype, scores)
    return _ROWS[key]


def _rope_arguments(config) -> dict:
    """RotaryEmbedding's arguments for the config's rope (rotary_dim handled by the caller)."""
    rope = config.rope
    args = {"max_wavelength": rope.theta}
    scaling = rope.scaling
    if scaling is None:
        return args
    if scaling.type == "linear":
        return {**args, "rope_type": "linear", "scaling_factor": scaling.factor}
    if scaling.type == "yarn":
        fixed = 0.1 * math.log(scaling.factor) + 1.0
        if not math.isclose(scaling.attention_factor, fixed, rel_tol=1e-12):
            raise NotImplementedError(f"{NAME}: RotaryEmbedding's yarn multiplies cos and sin by 0.1 ln(factor) + 1 = "
                                      f"{fixed:.6g}; the case asks attention_factor={scaling.attention_factor}")
        return {**args, "rope_type": "yarn", "scaling_factor": scaling.factor, "beta_fast": scaling.beta_fast,
                "beta_slow": scaling.beta_slow, "truncate": bool(scaling.truncate),
                "original_max_position_embeddings": scaling.original_max_position_embeddings}
    raise NotImplementedError(f"{NAME}: RotaryEmbedding's rope_type is linear, dynamic or yarn; the case asks "
                              f"{scaling.type!r} scaling")


def _prepare(config, tensors, inputs, options, device, precision):
    dtype, tensors, inputs, shapes = prepare_call(NAME, config, tensors, inputs, options, device, precision, devices(),
                                                  expresses=EXPRESSES,
                                                  why=why_each(config, inputs, options, WHY, FRONTIER_WHY))
    check_layout(NAME, LAYOUT, config)
    check_default_scale(NAME, config)
    check_dropout(NAME, config, inputs, options)
    if inputs.get("bias") is not None:
        raise NotImplementedError(f"{NAME}: CachedMultiHeadAttention takes no additive attention bias (attention_mask "
                                  "is boolean)")
    cached = inputs.get("past_key") is not None or bool(options.get("return_cache"))
    if cached and config.value_head_dim != config.head_dim:
        raise NotImplementedError(f"{NAME}: keys and values share one cache tensor (B, 2, S, num_heads, key_dim); the "
                                  f"case asks value_head_dim={config.value_head_dim} with head_dim={config.head_dim}")
    if config.rope is not None:
        _rope_arguments(config)
    allowed = allowed4(shapes, inputs, options)
    if allowed is not None and allowed.shape[1] != 1 and not (allowed == allowed[:, :1]).all():
        raise NotImplementedError(f"{NAME}: attention_mask is (B, T, S), one mask for every head; the case's mask "
                                  f"differs between heads (shape {tuple(np.shape(inputs['mask']))})")
    scores = bool(options.get("return_weights", False))
    path = "return_attention_scores=True" if scores else "the fused path (no scores)"
    check_masked_rows(NAME, config, shapes, inputs, options, native_masked_row(device, dtype, scores),
                      f"CachedMultiHeadAttention, {path}, on {device}, {dtype}")
    return dtype, tensors, inputs, shapes


class _Rotated:
    """One of the layer's projections, then RotaryEmbedding on the first rotary_dim features of each head, as
    keras-hub's RoPE attention layers turn q and k right after projecting them."""

    def __init__(self, dense, rope, rotary_dim: int, positions: np.ndarray):
        self.dense, self.rope, self.rotary_dim, self.positions = dense, rope, rotary_dim, positions

    def __call__(self, x, *args, **kwargs):
        keras, _ = _keras()
        y = self.dense(x, *args, **kwargs)  # (B, L, N, H)
        turned = self.rope(y[..., :self.rotary_dim], positions=self.positions)
        return turned if self.rotary_dim == y.shape[-1] else keras.ops.concatenate([turned, y[..., self.rotary_dim:]],
                                                                                   axis=-1)


def _build(config, tensors, shapes, inputs, device, dtype):
    """The layer filled with the canonical weights (in RotaryEmbedding's pairing), RoPE around its q and k
    projections. Returns (layer, its variables by relative path, the pairing permutation or None)."""
    from impl_numpy.functional import default_positions
    from impl_tf.layer import placement
    from impl_tf.native import to_native
    from weights import layouts

    CachedMultiHeadAttention, RotaryEmbedding = _hub()
    perm = None
    if config.rope is not None and config.rope.interleaved:
        config, tensors = layouts.repair_pairing(config, tensors, False)
        perm = layouts._pairing_permutation(config.head_dim, config.rope.rotary_dim, False)
    with placement(device):
        layer = CachedMultiHeadAttention(num_heads=config.num_heads, key_dim=config.head_dim,
                                         value_dim=config.value_head_dim, output_shape=config.out_dim,
                                         use_bias=config.use_query_bias, dtype=dtype)
        layer.build(query_shape=(None, None, config.query_dim), value_shape=(None, None, config.value_dim),
                    key_shape=(None, None, config.key_dim))
        to_native(config, tensors, into=layer, layout=LAYOUT)
    prefix = layer.path + "/"
    variables = {(v.path[len(prefix):] if v.path.startswith(prefix) else v.path.split("/", 1)[-1]): v
                 for v in layer.weights}
    if config.rope is not None:
        rope = RotaryEmbedding(**_rope_arguments(config), dtype=dtype)
        R = config.rope.rotary_dim
        q_pos = default_positions(inputs.get("positions"), shapes.P, shapes.T)  # (B|1, T)
        k_pos = default_positions(inputs.get("key_positions"), shapes.P, shapes.S)  # (B|1, S): the new keys
        layer._query_dense = _Rotated(layer._query_dense, rope, R, q_pos)
        layer._key_dense = _Rotated(layer._key_dense, rope, R, k_pos)
    return layer, variables, perm


def _cache(config, shapes, inputs, perm):
    """(B, 2, P + S, N, H): the past at 0..P-1 (keys in RotaryEmbedding's pairing), zeros after."""
    B, P, N, H = shapes.B, shapes.P, config.num_heads, config.head_dim
    cache = np.zeros((B, 2, P + shapes.S, N, H))  # float64 holds every storage dtype's values; cast by the caller
    if P:
        past_key = np.asarray(inputs["past_key"])
        past_key = past_key if perm is None else past_key[..., perm]
        cache[:, 0, :P] = past_key.transpose(0, 2, 1, 3)  # (B, K, P, H) -> (B, P, N, H)
        cache[:, 1, :P] = np.asarray(inputs["past_value"]).transpose(0, 2, 1, 3)
    return cache


def _call(layer, config, shapes, inputs, options, xs, cache):
    """layer(...) -> (output, scores or None, cache or None)."""
    allowed = allowed4(shapes, inputs, options)
    mask = None if allowed is None else np.ascontiguousarray(np.broadcast_to(allowed[:, 0],
                                                                             (shapes.B, shapes.T, shapes.S_total)))
    want = bool(options.get("return_weights", False))
    extra = {} if cache is None else {"cache": cache, "cache_update_index": shapes.P}
    with warnings.catch_warnings():  # keras warns that a softmax over one key is always 1: the grid's key_len_1
        warnings.filterwarnings("ignore", message="You are using a softmax over axis", category=UserWarning)
        result = layer(xs["query"], xs["value"], key=xs["key"], attention_mask=mask, return_attention_scores=want,
                       training=False, **extra)
    result = list(result) if isinstance(result, tuple | list) else [result]
    out = result.pop(0)
    scores = result.pop(0) if want else None
    return out, scores, (result.pop(0) if cache is not None else None)


def forward(config, tensors, inputs, options, *, device="cpu", precision="highest", trace=False):
    keras, tf = _keras()
    from impl_tf.layer import matmul_precision, placement

    dtype, tensors, inputs, shapes = _prepare(config, tensors, inputs, options, device, precision)
    layer, _, perm = _build(config, tensors, shapes, inputs, device, dtype)
    cached = inputs.get("past_key") is not None or bool(options.get("return_cache"))
    with placement(device), matmul_precision(precision):
        xs = {n: tf.convert_to_tensor(x) for n, x in zip(("query", "key", "value"), qkv(inputs))}
        cache = tf.cast(_cache(config, shapes, inputs, perm), dtype) if cached else None
        out, scores, cache = _call(layer, config, shapes, inputs, options, xs, cache)
    as_numpy = lambda t: np.asarray(keras.ops.convert_to_numpy(t))  # noqa: E731
    answer = {"output": as_numpy(out)}
    if scores is not None:
        answer["weights"] = as_numpy(scores)  # (B, N, T, S)
    if options.get("return_cache"):
        present = as_numpy(cache)  # (B, 2, P+S, N, H)
        key = present[:, 0].transpose(0, 2, 1, 3)  # (B, N, P+S, H)
        answer["present_key"] = np.ascontiguousarray(key if perm is None else key[..., np.argsort(perm)])
        answer["present_value"] = np.ascontiguousarray(present[:, 1].transpose(0, 2, 1, 3))
    return answer


def vjp(config, tensors, inputs, options, d_output, *, device="cpu", precision="highest"):
    keras, tf = _keras()
    from impl_tf.layer import matmul_precision, placement

    dtype, tensors, inputs, shapes = _prepare(config, tensors, inputs, options, device, precision)
    layer, variables, perm = _build(config, tensors, shapes, inputs, device, dtype)
    options = dict(options, return_weights=bool(options.get("return_weights", False)))  # the forward's path
    cached = inputs.get("past_key") is not None
    with placement(device), matmul_precision(precision):
        xs = {n: tf.convert_to_tensor(x) for n, x in zip(("query", "key", "value"), qkv(inputs))}
        cache = tf.cast(_cache(config, shapes, inputs, perm), dtype) if cached else None
        with tf.GradientTape() as tape:
            tape.watch(list(xs.values()))
            out, _, _ = _call(layer, config, shapes, inputs, options, xs, cache)
        d_out = np.asarray(d_output)
        if d_out.shape != tuple(out.shape):
            raise ValueError(f"d_output must have shape (B, T, O) = {tuple(out.shape)}: got {d_out.shape}")
        sources = [*xs.values(), *variables.values()]
        try:
            found = tape.gradient(out, sources, output_gradients=tf.cast(d_out, out.dtype))
        except LookupError as err:  # TensorFlow's own words: the cache splice has no registered gradient
            raise NotImplementedError(f"{NAME}: no gradient through the cache update (keras.ops.slice_update on "
                                      f"TensorFlow): {err}") from None
    as_numpy = lambda g, src: np.asarray(keras.ops.convert_to_numpy(tf.zeros_like(src) if g is None else g))  # noqa: E731
    grads = [as_numpy(g, s) for s, g in zip(sources, found)]
    canonical = grads_to_canonical(LAYOUT, dict(zip(variables, grads[3:])))
    if perm is not None:  # the permuted q and k features' gradients back in the contract's order
        back = np.argsort(perm)
        for name in ("query.kernel", "query.bias", "key.kernel", "key.bias"):
            if name in canonical:
                canonical[name] = np.ascontiguousarray(canonical[name][..., back])
    canonical.update(zip(("query", "key", "value"), grads[:3]))
    return {"output": np.asarray(keras.ops.convert_to_numpy(out)), "grads": order_grads(config, canonical)}
