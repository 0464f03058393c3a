"""Multi-head attention in keras.ops, one function per stage: mirrors impl_numpy/functional.py.

Same stage functions, same names, same einsum strings, same order as the
NumPy spec; every op is a keras.ops call, run on the TensorFlow backend
(impl_tf insists on it). A disagreement with the spec therefore names a stage.

Shape letters (impl_numpy's):
  B batch             T query length        S key/value length
  N query heads       K key/value heads     G = N / K query heads per K head
  H head dim (q, k)   V value head dim      D input features    O output features
  F a flattened head axis: N*H, K*H or K*V (N*V after merge_heads)

Stages: project -> split_heads -> logits (scale) -> mask (and bias) ->
softmax -> dropout -> attend -> merge_heads -> output.

Precision rule (the spec's): each stage's result is stored in the storage
dtype; its arithmetic (matmul accumulation, exp and sums) runs in
`compute_dtype`, float32 for float16/bfloat16 inputs, the dtype itself
otherwise.

Three differences of form, all for TensorFlow's autodiff to give the spec's
hand-written gradients (impl_numpy/backward.py); the forward values are the
same:
- softmax subtracts a stop_gradient row max (softmax does not depend on it);
- the mask stage adds 0 / -inf instead of selecting, and masked_row="nan"
  multiplies a fully masked row by NaN instead of filling it, so such a row's
  logits get a NaN gradient as in the spec rather than a select's 0.

Not mirrored: impl_numpy's chunked mode (`chunk_size`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from weights import AttentionConfig, dtype_from_name, validate_tensors
from weights.contract import check_bias_values, check_call

from ._keras import keras, tf
from .masks import causal_mask

ops = keras.ops

# The contractions, written once; the same strings as impl_numpy.
PROJECT = "BLD,DF->BLF"
LOGITS = "BKGTH,BKSH->BKGTS"
ATTEND = "BKGTS,BKSV->BKGTV"
OUTPUT = "BTF,FO->BTO"


@dataclasses.dataclass
class TraceEntry:
    stage: str
    value: Any  # the stage's output, a TensorFlow tensor


def _record(trace: list | None, stage: str, value):
    if trace is not None:
        trace.append(TraceEntry(stage, value))
    return value


def dtype_name(x) -> str:
    """The dtype of a tensor, array or dtype, by its NumPy-style name."""
    return keras.backend.standardize_dtype(getattr(x, "dtype", x))


def compute_dtype(dtype) -> str:
    """Where a stage's arithmetic runs: float32 for 16-bit storage, else the dtype."""
    name = keras.backend.standardize_dtype(dtype)
    return "float32" if name in ("float16", "bfloat16") else name


def _einsum(subscripts: str, a, b, dtype):
    ct = compute_dtype(dtype)
    return ops.cast(ops.einsum(subscripts, ops.cast(a, ct), ops.cast(b, ct)), dtype)


# -- stages --------------------------------------------------------------------

def project(x, kernel, bias):
    """PROJECT: x (B, L, D) times kernel (D, heads, width) flattened -> (B, L, F)."""
    D = kernel.shape[0]
    y = _einsum(PROJECT, x, ops.reshape(kernel, (D, -1)), x.dtype)  # (B, L, F)
    if bias is not None:
        ct = compute_dtype(x.dtype)
        y = ops.cast(ops.cast(y, ct) + ops.cast(ops.reshape(bias, (-1,)), ct), x.dtype)  # bias (F,); y (B, L, F)
    return y


def split_heads(x, num_heads: int):
    """(B, L, heads*width) -> (B, heads, L, width), as seed 003's split_heads."""
    B, L, F = ops.shape(x)
    x = ops.reshape(x, (B, L, num_heads, F // num_heads))  # (B, L, heads, width)
    return ops.transpose(x, (0, 2, 1, 3))  # (B, heads, L, width)


def logits(q, k, scale: float):
    """LOGITS times scale: q (B, N, T, H), k (B, K, S, H) -> (B, N, T, S).
    Query head n reads key head n // G."""
    B, N, T, H = ops.shape(q)
    K, S = k.shape[1], ops.shape(k)[2]
    qg = ops.reshape(q, (B, K, N // K, T, H))  # (B, K, G, T, H)
    ct = compute_dtype(q.dtype)
    scores = ops.einsum(LOGITS, ops.cast(qg, ct), ops.cast(k, ct))  # (B, K, G, T, S)
    return ops.cast(ops.reshape(scores * scale, (B, N, T, S)), q.dtype)  # (B, N, T, S)


def mask(x, allowed, bias):
    """Add bias, then -inf at disallowed positions. allowed and bias are
    rank-4 and broadcast to (B, N, T, S). A select, so a masked position gets
    no gradient (as in impl_numpy/backward.py)."""
    if bias is not None:
        x = ops.cast(ops.cast(x, compute_dtype(x.dtype)) + bias, x.dtype)
    if allowed is not None:
        x = ops.where(allowed, x, ops.cast(-math.inf, x.dtype))
    return x


def softmax(x, masked_row: str):
    """Softmax over S in compute dtype. A row with no finite logit (every key
    masked) becomes: "zero" all 0, "uniform" all 1/S, "nan" all NaN."""
    ct = compute_dtype(x.dtype)
    xc = ops.cast(x, ct)
    row_max = ops.stop_gradient(ops.max(xc, axis=-1, keepdims=True))  # (B, N, T, 1)
    empty = ops.equal(row_max, -math.inf)
    e = ops.exp(xc - ops.where(empty, ops.zeros_like(row_max), row_max))  # masked -> exactly 0
    total = ops.sum(e, axis=-1, keepdims=True)
    w = e / ops.where(empty, ops.ones_like(total), total)  # an empty row is all 0 here
    if masked_row == "uniform":
        w = ops.where(empty, ops.ones_like(w) / ops.cast(ops.shape(x)[-1], ct), w)
    elif masked_row == "nan":
        # times NaN, not a NaN fill: the row's gradient is NaN too, as in the spec
        w = w * ops.where(empty, ops.full_like(total, math.nan), ops.ones_like(total))
    return ops.cast(w, x.dtype)


def dropout(w, keep, rate: float):
    """Inverted dropout with an explicit keep-mask (B, N, T, S)."""
    if keep is None:
        return w
    wc = ops.cast(w, compute_dtype(w.dtype))
    return ops.cast(ops.where(keep, wc / (1.0 - rate), ops.zeros_like(wc)), w.dtype)


def attend(w, v):
    """ATTEND: weights (B, N, T, S), v (B, K, S, V) -> (B, N, T, V)."""
    B, N, T, S = ops.shape(w)
    K, V = v.shape[1], v.shape[-1]
    wg = ops.reshape(w, (B, K, N // K, T, S))  # (B, K, G, T, S)
    return ops.reshape(_einsum(ATTEND, wg, v, w.dtype), (B, N, T, V))  # (B, N, T, V)


def merge_heads(x):
    """(B, N, T, V) -> (B, T, N*V)."""
    B, N, T, V = ops.shape(x)
    x = ops.transpose(x, (0, 2, 1, 3))  # (B, T, N, V)
    return ops.reshape(x, (B, T, N * V))  # (B, T, N*V)


def output(x, kernel, bias):
    """OUTPUT: (B, T, N*V) times kernel (N, V, O) flattened -> (B, T, O)."""
    y = _einsum(OUTPUT, x, ops.reshape(kernel, (-1, kernel.shape[-1])), x.dtype)  # (B, T, O)
    if bias is not None:
        ct = compute_dtype(x.dtype)
        y = ops.cast(ops.cast(y, ct) + ops.cast(bias, ct), x.dtype)
    return y


# -- helpers shared by the whole call ---------------------------------------------

def _is_symbolic(x) -> bool:
    return keras.backend.is_keras_tensor(x) or (tf.is_tensor(x) and not tf.executing_eagerly())


def _static_shape(x) -> tuple[int, ...]:
    """Static shape; an unknown dimension (a traced batch) reads -1."""
    return tuple(-1 if d is None else int(d) for d in x.shape)


def _rank4(x):
    """(T, S) -> (1, 1, T, S); (B, T, S) -> (B, 1, T, S); rank 4 unchanged,
    the reading check_call has already accepted."""
    if len(x.shape) == 2:
        return x[None, None]  # (1, 1, T, S)
    if len(x.shape) == 3:
        return x[:, None]  # (B, 1, T, S)
    return x


def _size(static: int, x, axis: int):
    return static if static >= 0 else ops.shape(x)[axis]


def dropout_keep_mask(shape, rate: float, seed) -> Any:
    """Keras's own seeded keep-mask (stateless for an int seed). Seeds are per
    framework: for the same dropout across frameworks pass dropout_mask."""
    if isinstance(seed, (int, np.integer)):
        seed = int(seed)
    return keras.random.uniform(shape, seed=seed) >= rate


def allowed_mask(shapes, mask_tensor, is_causal: bool, causal_alignment: str, T, S):
    """mask AND causal, rank 4, broadcastable to (B, N, T, S); None if neither."""
    allowed = None
    if mask_tensor is not None:
        allowed = _rank4(ops.cast(mask_tensor, "bool"))
    if is_causal:
        causal = causal_mask(T, S, causal_alignment)[None, None]  # (1, 1, T, S)
        allowed = causal if allowed is None else ops.logical_and(allowed, causal)
    return allowed


def check_tensors(config: AttentionConfig, tensors) -> str:
    """validate_tensors on NumPy arrays; on framework tensors and variables,
    the same checks of names, shapes and dtype (values are not read).
    Returns the storage dtype's name."""
    proxies = {}
    for name, t in tensors.items():
        if isinstance(t, np.ndarray) or not (hasattr(t, "shape") and hasattr(t, "dtype")):
            proxies[name] = t
            continue
        try:
            dt = dtype_from_name(dtype_name(t))
        except ValueError:
            dt = np.dtype(object)
        proxies[name] = np.broadcast_to(np.zeros((), dt), tuple(t.shape))
    return validate_tensors(config, proxies).name


def check_inputs(config: AttentionConfig, dtype: str, query, key=None, value=None, *, mask=None, bias=None,
                 dropout_mask=None, is_causal=False, causal_alignment="top_left", training=False, seed=None,
                 return_weights=False):
    """The spec's checks on one call, shapes and dtypes only (plus bias values
    when they are concrete): ValueError with the spec's words. Returns CallShapes."""
    key = query if key is None else key
    value = key if value is None else value
    for name, x in (("query", query), ("key", key), ("value", value)):
        got = dtype_name(x)
        if not keras.backend.is_float_dtype(got) and got != dtype:
            raise ValueError(f"{name} must be a float array: got dtype {got}")
    shapes = check_call(
        config, query_shape=_static_shape(query), key_shape=_static_shape(key), value_shape=_static_shape(value),
        mask_shape=None if mask is None else _static_shape(mask),
        mask_dtype=None if mask is None else dtype_name(mask),
        bias_shape=None if bias is None else _static_shape(bias),
        bias_dtype=None if bias is None else dtype_name(bias),
        dropout_mask_shape=None if dropout_mask is None else _static_shape(dropout_mask),
        dropout_mask_dtype=None if dropout_mask is None else dtype_name(dropout_mask),
        is_causal=is_causal, causal_alignment=causal_alignment, training=training, seed=seed,
        return_weights=return_weights,
    )
    if bias is not None and not _is_symbolic(bias):
        check_bias_values(ops.convert_to_numpy(bias))  # traced bias values are not inspected
    return shapes


def _tensor(x):
    return None if x is None else ops.convert_to_tensor(x)


def prepare(config, tensors, query, key, value, *, mask, bias, dropout_mask, is_causal, causal_alignment,
            training, seed, return_weights, dtype):
    """Validate a call and cast everything to the storage dtype."""
    stored = check_tensors(config, tensors)
    dtype = stored if dtype is None else dtype_from_name(dtype).name
    training = bool(training)
    query = ops.convert_to_tensor(query)
    key = query if key is None else ops.convert_to_tensor(key)
    value = key if value is None else ops.convert_to_tensor(value)
    mask_t, bias_t, keep_t = _tensor(mask), _tensor(bias), _tensor(dropout_mask)
    shapes = check_inputs(
        config, dtype, query, key, value, mask=mask_t, bias=bias_t, dropout_mask=keep_t, is_causal=is_causal,
        causal_alignment=causal_alignment, training=training, seed=seed, return_weights=return_weights,
    )
    if bias_t is not None:
        bias_t = _rank4(ops.cast(bias_t, compute_dtype(dtype)))  # (B|1, N|1, T|1, S|1)
    params = {name: ops.cast(t, dtype) for name, t in tensors.items()}
    B, T, S = _size(shapes.B, query, 0), _size(shapes.T, query, 1), _size(shapes.S, key, 1)
    if training and keep_t is None and config.dropout > 0:
        keep_t = dropout_keep_mask((B, config.num_heads, T, S), config.dropout, seed)
    if not training:
        keep_t = None
    allowed = allowed_mask(shapes, mask_t, is_causal, causal_alignment, T, S)
    cast = [ops.cast(x, dtype) for x in (query, key, value)]
    return shapes, params, cast, allowed, bias_t, keep_t, dtype


def multi_head_attention(
    config: AttentionConfig,
    tensors,
    query,
    key=None,
    value=None,
    *,
    mask=None,
    bias=None,
    is_causal: bool = False,
    causal_alignment: str = "top_left",
    training: bool = False,
    dropout_mask=None,
    seed: int | None = None,
    return_weights: bool = False,
    dtype: str | None = None,
    trace: list | None = None,
):
    """The forward pass. Returns output (B, T, O), or (output, weights) with
    weights (B, N, T, S) after softmax and before dropout when return_weights.

    tensors: the canonical tensors (NumPy arrays, or tensors/variables of the
    canonical shapes). dtype: compute in this storage dtype (default: the
    tensors' dtype). trace: a list that receives a TraceEntry per stage.
    """
    shapes, p, (query, key, value), allowed, bias_r4, keep, dtype = prepare(
        config, tensors, query, key, value, mask=mask, bias=bias, dropout_mask=dropout_mask,
        is_causal=is_causal, causal_alignment=causal_alignment, training=training, seed=seed,
        return_weights=return_weights, dtype=dtype,
    )
    rec = lambda stage, value: _record(trace, stage, value)  # noqa: E731
    q = rec("query.project", project(query, p["query.kernel"], p.get("query.bias")))  # (B, T, N*H)
    k = rec("key.project", project(key, p["key.kernel"], p.get("key.bias")))  # (B, S, K*H)
    v = rec("value.project", project(value, p["value.kernel"], p.get("value.bias")))  # (B, S, K*V)
    q = rec("query.split_heads", split_heads(q, config.num_heads))  # (B, N, T, H)
    k = rec("key.split_heads", split_heads(k, config.num_kv_heads))  # (B, K, S, H)
    v = rec("value.split_heads", split_heads(v, config.num_kv_heads))  # (B, K, S, V)
    x = rec("logits", logits(q, k, config.effective_scale))  # (B, N, T, S)
    x = rec("mask", mask_stage(x, allowed, bias_r4))
    w = rec("softmax", softmax(x, config.masked_row))  # (B, N, T, S)
    wd = rec("dropout", dropout(w, keep, config.dropout))
    ctx = rec("attend", attend(wd, v))  # (B, N, T, V)
    ctx = rec("merge_heads", merge_heads(ctx))  # (B, T, N*V)
    out = rec("output", output(ctx, p["output.kernel"], p.get("output.bias")))  # (B, T, O)
    return (out, w) if return_weights else out


# `mask` is both a stage and an argument name; the call uses this alias.
mask_stage = mask

STAGES = (
    "query.project", "key.project", "value.project",
    "query.split_heads", "key.split_heads", "value.split_heads",
    "logits", "mask", "softmax", "dropout", "attend", "merge_heads", "output",
)
