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

Differences of form, all for TensorFlow's autodiff to give the spec's
hand-written gradients (impl_numpy/backward.py); the forward values are the
same:
- softmax subtracts a stop_gradient row max (softmax does not depend on it);
- masked_row="nan" multiplies a fully masked row by NaN instead of filling
  it, so such a row's softmax input gets a NaN gradient as in the spec (the
  value gradient too); the mask stage's select (a -inf bias included) then
  passes none of it to the logits, as the spec's backward zeroes every -inf
  position.

Two paths beyond the stages, both exact to the tolerance policy:
- When neither `trace` nor `return_weights` is asked for, logits -> mask ->
  softmax -> dropout -> attend run as one fused computation
  (`fused_attention`): the scale folded into q, TensorFlow's own softmax
  kernel, masks and masked rows handled with as few passes over the (B, N,
  T, S) scores as the call allows. The stages above stay the spec's; trace
  and weights always come from them.
- `chunk_size=` (chunked.py): impl_numpy's chunked mode, exact attention with
  an online softmax over key blocks that never holds a (T, S) array and
  skips key blocks the causal mask hides.

The stages' contractions run through tf.einsum with the spec's strings:
keras.ops.einsum rewrites "BLD,DF->BLF" into a broadcasting 3-D matmul that
TensorFlow runs about 1.3x slower than the einsum it came from. The fused and
chunked paths write LOGITS and ATTEND as matmuls on the grouped (B, K, G*T, .)
queries, as impl_numpy computes them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from weights import DTYPES, AttentionConfig, dtype_from_name, validate_tensors
from weights.contract import check_bias_values, check_call, check_chunk_size

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


def _cast(x, dtype: str):
    """ops.cast, without its dispatch when x is a tensor of that dtype already
    (most casts of a float32 or float64 call: about 30 us each, eagerly)."""
    if tf.is_tensor(x) and x.dtype == dtype:
        return x
    return ops.cast(x, dtype)


def _einsum(subscripts: str, a, b, dtype):
    ct = compute_dtype(dtype)
    return _cast(tf.einsum(subscripts, _cast(a, ct), _cast(b, ct)), dtype)


# -- stages --------------------------------------------------------------------

def project(x, kernel, bias):
    """PROJECT: x (B, L, D) times kernel (D, heads, width) flattened -> (B, L, F)."""
    D = kernel.shape[0]
    y = _einsum(PROJECT, x, ops.reshape(kernel, (D, -1)), x.dtype)  # (B, L, F)
    if bias is not None:
        ct = compute_dtype(x.dtype)
        y = _cast(_cast(y, ct) + _cast(ops.reshape(bias, (-1,)), ct), x.dtype)  # bias (F,); y (B, L, F)
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
    scores = tf.einsum(LOGITS, _cast(qg, ct), _cast(k, ct))  # (B, K, G, T, S)
    return _cast(ops.reshape(scores * scale, (B, N, T, S)), q.dtype)  # (B, N, T, S)


def mask(x, allowed, bias):
    """Add bias, then -inf at disallowed positions. allowed and bias are
    rank-4 and broadcast to (B, N, T, S). A select, so a masked position gets
    no gradient (as in impl_numpy/backward.py); a -inf in bias masks, so it
    joins the select (the value is -inf either way): otherwise a "nan" row
    masked by bias alone would pass its NaN to the query and key gradients."""
    if bias is not None:
        ct = compute_dtype(x.dtype)
        x = _cast(_cast(x, ct) + bias, x.dtype)
        finite = bias > tf.constant(-math.inf, ct)  # (B|1, N|1, T|1, S|1)
        allowed = finite if allowed is None else ops.logical_and(allowed, finite)
    if allowed is not None:
        x = ops.where(allowed, x, _cast(-math.inf, x.dtype))
    return x


def softmax(x, masked_row: str):
    """Softmax over S in compute dtype. A row with no finite logit (every key
    masked) becomes: "zero" all 0, "uniform" all 1/S, "nan" all NaN."""
    ct = compute_dtype(x.dtype)
    xc = _cast(x, ct)
    row_max = ops.stop_gradient(ops.max(xc, axis=-1, keepdims=True))  # (B, N, T, 1)
    empty = ops.equal(row_max, -math.inf)
    e = ops.exp(xc - ops.where(empty, ops.zeros_like(row_max), row_max))  # masked -> exactly 0
    total = ops.sum(e, axis=-1, keepdims=True)
    w = e / ops.where(empty, ops.ones_like(total), total)  # an empty row is all 0 here
    if masked_row == "uniform":
        w = ops.where(empty, ops.ones_like(w) / _cast(ops.shape(x)[-1], ct), w)
    elif masked_row == "nan":
        # times NaN, not a NaN fill: the row's gradient is NaN too, as in the spec
        w = w * ops.where(empty, ops.full_like(total, math.nan), ops.ones_like(total))
    return _cast(w, x.dtype)


def dropout(w, keep, rate: float):
    """Inverted dropout with an explicit keep-mask (B, N, T, S)."""
    if keep is None:
        return w
    wc = _cast(w, compute_dtype(w.dtype))
    return _cast(ops.where(keep, wc / (1.0 - rate), ops.zeros_like(wc)), w.dtype)


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
        y = _cast(_cast(y, ct) + _cast(bias, ct), x.dtype)
    return y


# -- the fused fast path (no trace, no weights) -----------------------------------

def may_have_empty_rows(mask4, bias, is_causal: bool, causal_alignment: str, T, S) -> bool:
    """False only where no query row can lose every key: no mask, no bias, and
    causal (if at all) aligned so that every query sees key 0 or more."""
    if mask4 is not None or bias is not None:
        return True
    if not is_causal or causal_alignment == "top_left":
        return False
    return not (isinstance(T, int) and isinstance(S, int) and S >= T)  # bottom_right: query 0 sees S - T + 1 keys


def fused_attention(q, k, v, *, mask4, bias, keep, is_causal: bool, causal_alignment: str, scale: float,
                    rate: float, masked_row: str):
    """logits -> mask -> softmax -> dropout -> attend as one computation, for
    calls that ask for neither the trace nor the weights: q (B, N, T, H),
    k (B, K, S, H), v (B, K, S, V) -> (B, N, T, V) in the storage dtype.

    Equal to the stages within the tolerance policy (the arithmetic runs in the
    compute dtype throughout; the stages round each result to the storage
    dtype). The differences of form: the scale multiplies q (T*H values, not
    T*S); TensorFlow's softmax kernel; a position whose bias is -inf is folded
    into the allowed mask, so that, as in the spec, no masked position passes
    a gradient; and a fully masked row (every allowed flag False) is found on
    the (broadcast) mask instead of the scores, then given its `masked_row`
    value with one select. Its softmax is NaN before that select, and that
    NaN reaches no gradient: every position of such a row is masked, and the
    mask's select passes none.
    """
    dtype = dtype_name(q)
    ct = compute_dtype(dtype)
    B, N, T, H = ops.shape(q)
    K, S, V = k.shape[1], ops.shape(k)[2], v.shape[-1]
    # LOGITS and ATTEND as matmuls on the grouped (B, K, G*T, .) queries, as impl_numpy computes
    # them: XLA runs these 1.3-1.7x faster than the 5-D einsum's dot.
    qg = ops.reshape(_cast(q, ct) * tf.constant(scale, ct), (B, K, (N // K) * T, H))  # (B, K, G*T, H)
    x = ops.reshape(tf.matmul(qg, _cast(k, ct), transpose_b=True), (B, N, T, S))  # (B, N, T, S), scaled
    allowed = mask4
    if is_causal:
        causal = causal_mask(T, S, causal_alignment)[None, None]  # (1, 1, T, S)
        allowed = causal if allowed is None else ops.logical_and(allowed, causal)
    if bias is not None:
        x = x + bias
        finite = bias > tf.constant(-math.inf, ct)  # (B|1, N|1, T|1, S|1)
        allowed = finite if allowed is None else ops.logical_and(allowed, finite)
    if allowed is not None:
        x = tf.where(allowed, x, tf.constant(-math.inf, ct))
    w = tf.nn.softmax(x, axis=-1)  # (B, N, T, S); a row with no allowed key is NaN here
    if may_have_empty_rows(mask4, bias, is_causal, causal_alignment, T, S):
        empty = ops.logical_not(ops.any(allowed, axis=-1, keepdims=True))  # (B|1, N|1, T|1, 1), on the mask
        fill = {"zero": 0.0, "uniform": 1.0, "nan": math.nan}[masked_row]
        fill = tf.constant(fill, ct) / tf.cast(S, ct) if masked_row == "uniform" else tf.constant(fill, ct)
        w = tf.where(empty, fill, w)
    if keep is not None:
        w = tf.where(keep, w / tf.constant(1.0 - rate, ct), tf.constant(0.0, ct))
    wg = ops.reshape(w, (B, K, (N // K) * T, S))  # (B, K, G*T, S)
    ctx = tf.matmul(wg, _cast(v, ct))  # (B, K, G*T, V)
    return _cast(ops.reshape(ctx, (B, N, T, V)), dtype)  # (B, N, T, V)


# Score arrays of this many elements or more run fused_attention compiled by
# XLA, eagerly too: TensorFlow's own CPU kernels run the (T, H) x (H, S) batched
# matmuls at 20-35% of their large-matmul rate (XLA: 40-90%), and every
# elementwise op over (B, N, T, S) writes a fresh array, one page fault per 4
# KiB once it passes glibc's 32 MiB mmap threshold. XLA fuses those passes.
# Smaller calls (the conformance grid) stay eager: compiling would cost more
# than it saves. The first call of a shape pays the compile.
XLA_MIN_SCORES = 2**18

_fused_attention_xla = tf.function(fused_attention, jit_compile=True, autograph=False)


def _attention(q, k, v, **options):
    """fused_attention, through XLA when the scores are large (XLA_MIN_SCORES)."""
    B, N, T = q.shape[:3]
    S = k.shape[2]
    if None not in (N, T, S) and (B or 1) * N * T * S >= XLA_MIN_SCORES:
        return _fused_attention_xla(q, k, v, **options)
    return fused_attention(q, k, v, **options)


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


def allowed_mask(mask4, is_causal: bool, causal_alignment: str, T, S):
    """mask AND causal, rank 4, broadcastable to (B, N, T, S); None if neither."""
    allowed = mask4
    if is_causal:
        causal = causal_mask(T, S, causal_alignment)[None, None]  # (1, 1, T, S)
        allowed = causal if allowed is None else ops.logical_and(allowed, causal)
    return allowed


def check_tensors(config: AttentionConfig, tensors) -> str:
    """validate_tensors on NumPy arrays; on framework tensors and variables,
    the same checks of names, shapes and dtype (values are not read).
    Returns the storage dtype's name."""
    expected = config.tensor_shapes()
    if len(tensors) == len(expected) and not any(isinstance(t, np.ndarray) for t in tensors.values()):
        # Framework tensors, the usual call: names, shapes and one dtype checked
        # here; anything amiss goes the long way for validate_tensors' words.
        try:
            same_shapes = all(tuple(tensors[name].shape) == shape for name, shape in expected.items())
            names = {dtype_name(tensors[name]) for name in expected} if same_shapes else set()
        except (KeyError, AttributeError, ValueError, TypeError):
            names = set()
        if len(names) == 1 and next(iter(names)) in DTYPES:
            return next(iter(names))
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
                 return_weights=False, materializes_scores=True):
    """The spec's checks on one call, shapes and dtypes only (plus bias values
    when they are concrete): ValueError with the spec's words. Returns CallShapes.
    materializes_scores: the call holds (B, N, T, S) arrays (all but the chunked
    path), refused up front when they cannot fit in memory."""
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
        return_weights=return_weights, materializes_scores=materializes_scores,
        scores_itemsize=np.dtype(compute_dtype(dtype)).itemsize,
    )
    if bias is not None and not _is_symbolic(bias):
        check_bias_values(ops.convert_to_numpy(bias))  # traced bias values are not inspected
    return shapes


def _tensor(x):
    return None if x is None else ops.convert_to_tensor(x)


def prepare(config, tensors, query, key, value, *, mask, bias, dropout_mask, is_causal, causal_alignment,
            training, seed, return_weights, dtype, materializes_scores=True):
    """Validate a call and cast everything to the storage dtype. Returns
    (shapes, params, [query, key, value], mask4, bias_r4, keep, dtype): mask4
    the caller's mask at rank 4 (causal not folded in), bias_r4 in the compute
    dtype at rank 4, keep the dropout keep-mask when training, else None."""
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
        materializes_scores=materializes_scores,
    )
    if bias_t is not None:
        bias_t = _rank4(_cast(bias_t, compute_dtype(dtype)))  # (B|1, N|1, T|1, S|1)
    params = {name: _cast(t, dtype) for name, t in tensors.items()}
    B, T, S = _size(shapes.B, query, 0), _size(shapes.T, query, 1), _size(shapes.S, key, 1)
    if training and keep_t is None and config.dropout > 0:
        keep_t = dropout_keep_mask((B, config.num_heads, T, S), config.dropout, seed)
    if not training:
        keep_t = None
    mask4 = None if mask_t is None else _rank4(_cast(mask_t, "bool"))  # (B|1, N|1, T|1, S|1)
    cast = [_cast(x, dtype) for x in (query, key, value)]
    return shapes, params, cast, mask4, bias_t, keep_t, dtype


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
    chunk_size: int | None = None,
    trace: list | None = None,
):
    """The forward pass. Returns output (B, T, O), or (output, weights) with
    weights (B, N, T, S) after softmax and before dropout when return_weights.

    tensors: the canonical tensors (NumPy arrays, or tensors/variables of the
    canonical shapes). dtype: compute in this storage dtype (default: the
    tensors' dtype). chunk_size: exact online softmax over key blocks of this
    size, queries in blocks of the same size; never holds a (T, S) array (see
    chunked.py). Not with return_weights or trace. trace: a list that
    receives a TraceEntry per stage.
    """
    shapes, p, (query, key, value), mask4, bias_r4, keep, dtype = prepare(
        config, tensors, query, key, value, mask=mask, bias=bias, dropout_mask=dropout_mask,
        is_causal=is_causal, causal_alignment=causal_alignment, training=training, seed=seed,
        return_weights=return_weights, dtype=dtype, materializes_scores=chunk_size is None or return_weights,
    )
    T, S = _size(shapes.T, query, 1), _size(shapes.S, key, 1)
    chunk_size = check_chunk_size(chunk_size, return_weights=return_weights, traced=trace is not None)
    if chunk_size is not None:
        from .chunked import chunked_attention

        ctx = chunked_attention(
            config, query, p["query.kernel"], p.get("query.bias"),
            split_heads(project(key, p["key.kernel"], p.get("key.bias")), config.num_kv_heads),  # (B, K, S, H)
            split_heads(project(value, p["value.kernel"], p.get("value.bias")), config.num_kv_heads),  # (B, K, S, V)
            mask4=mask4, bias=bias_r4, keep=keep, is_causal=is_causal, causal_alignment=causal_alignment,
            chunk_size=chunk_size,
        )  # (B, T, N*V): the queries are projected block by block, k and v released before this returns
        return output(ctx, p["output.kernel"], p.get("output.bias"))  # (B, T, O)
    if trace is None and not return_weights:
        q = split_heads(project(query, p["query.kernel"], p.get("query.bias")), config.num_heads)  # (B, N, T, H)
        k = split_heads(project(key, p["key.kernel"], p.get("key.bias")), config.num_kv_heads)  # (B, K, S, H)
        v = split_heads(project(value, p["value.kernel"], p.get("value.bias")), config.num_kv_heads)  # (B, K, S, V)
        ctx = _attention(
            q, k, v, mask4=mask4, bias=bias_r4, keep=keep, is_causal=is_causal, causal_alignment=causal_alignment,
            scale=config.effective_scale, rate=config.dropout, masked_row=config.masked_row,
        )  # (B, N, T, V)
        return output(merge_heads(ctx), p["output.kernel"], p.get("output.bias"))  # (B, T, O)
    allowed = allowed_mask(mask4, is_causal, causal_alignment, T, S)
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
