"""Multi-head attention in JAX, one pure function per stage: mirrors impl_numpy/functional.py.

Same stage functions, same names, same order, same einsum strings as the
NumPy spec; jax.numpy and jax.lax only. Shape letters as in impl_numpy:
  B batch             T query length        S key/value length
  N query heads       K key/value heads     G = N / K query heads per K head
  H head dim (q, k)   V value head dim      D input features    O output features
  F a flattened head axis: N*H, K*H or K*V (N*V after merge_heads)

Stages: project -> split_heads -> logits (scale) -> mask (and bias) ->
softmax -> dropout -> attend -> merge_heads -> output.

Paths. With return_weights or a trace, or dropout, or 16-bit storage, every
stage runs as written. Otherwise logits .. attend run as one expression
(fused_attention: same einsums, softmax normalised on the context), which
XLA CPU compiles into one kernel instead of five passes over (B, N, T, S).
chunk_size= takes chunked.py's online softmax over blocks instead: no (T, S)
array, causal blocks skipped.

Precision rule (as the spec): each stage's result is stored in the storage
dtype; its arithmetic runs in `compute_dtype`, float32 for float16/bfloat16,
the dtype itself otherwise. Every einsum runs at lax.Precision.HIGHEST
(true float32 on GPUs, where JAX's default is TF32) unless the caller passes
precision="tf32" or "default" (both lax.Precision.DEFAULT: TF32 on Ampere and
later GPUs unless jax_default_matmul_precision says otherwise, float32 on CPUs).

float64 needs JAX's x64 mode. This module never switches it on (that would
change the default dtypes of every other JAX program in the process); a
float64 call without it raises ValueError saying how to enable it, instead
of silently computing in float32. impl_jax.adapter (the conformance entry
point) does enable it.

`apply` is pure and works under jax.jit, jax.grad and jax.vmap. Validation
(weights.contract.check_call) reads only static shapes and dtypes, so it runs
at trace time; the one value check (NaN / +inf in bias) runs only when bias
is concrete (eager calls), so jit callers check bias themselves
(weights.contract.check_bias_values; the adapter does). Under jit pass
STATIC_ARGNAMES as static_argnames.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from weights import DTYPES, AttentionConfig, compute_dtype, dtype_from_name, validate_tensors
from weights.contract import check_bias_values, check_call, check_chunk_size
from weights.dtypes import is_float, resolve_dtype

from .masks import causal_mask

# The contractions, written once; the same strings as impl_numpy.
PROJECT = "BLD,DF->BLF"
LOGITS = "BKGTH,BKSH->BKGTS"
ATTEND = "BKGTS,BKSV->BKGTV"
OUTPUT = "BTF,FO->BTO"

PRECISIONS = {
    "highest": lax.Precision.HIGHEST,  # float32 matmuls everywhere (the correctness setting)
    "tf32": lax.Precision.DEFAULT,  # TF32 on Ampere+ GPUs: asked for explicitly
    "default": lax.Precision.DEFAULT,  # whatever the platform does by default
}

# Arguments of `apply` that must be static under jax.jit (hashable Python values).
STATIC_ARGNAMES = (
    "config", "is_causal", "causal_alignment", "training", "seed", "return_weights", "precision", "dtype",
    "chunk_size",
)

X64_MESSAGE = (
    "float64 needs JAX's x64 mode, which is off: call jax.config.update('jax_enable_x64', True) "
    "(or set JAX_ENABLE_X64=1) before creating arrays; impl_jax never computes a float64 request in float32"
)


@dataclasses.dataclass
class TraceEntry:
    stage: str
    value: Any  # the stage's output, a jax.Array (a tracer inside jit)


def _record(trace: list | None, stage: str, value):
    if trace is not None:
        trace.append(TraceEntry(stage, value))
    return value


def _precision(precision: str) -> lax.Precision:
    try:
        return PRECISIONS[precision]
    except (KeyError, TypeError):
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}: got {precision!r}") from None


def _einsum(spec: str, a, b, dtype, precision: str):
    """einsum in compute dtype, result stored in `dtype` (the spec's _matmul)."""
    ct = compute_dtype(dtype)
    y = jnp.einsum(spec, a.astype(ct), b.astype(ct), precision=_precision(precision))
    return y.astype(dtype)


# -- stages --------------------------------------------------------------------

def project(x, kernel, bias, precision: str = "highest"):
    """PROJECT: x (B, L, D) times kernel (D, heads, width) flattened -> (B, L, F)."""
    D = kernel.shape[0]
    y = _einsum(PROJECT, x, kernel.reshape(D, -1), x.dtype, precision)  # (B, L, F)
    if bias is not None:
        ct = compute_dtype(x.dtype)
        y = (y.astype(ct) + bias.reshape(-1).astype(ct)).astype(x.dtype)  # (B, L, F)
    return y


def split_heads(x, num_heads: int):
    """(B, L, heads*width) -> (B, heads, L, width), as seed 003's split_heads."""
    B, L, F = x.shape
    x = x.reshape(B, L, num_heads, F // num_heads)  # (B, L, heads, width)
    return x.transpose(0, 2, 1, 3)  # (B, heads, L, width)


def logits(q, k, scale: float, precision: str = "highest"):
    """LOGITS times scale: q (B, N, T, H), k (B, K, S, H) -> (B, N, T, S).
    Query head n reads key head n // G."""
    B, N, T, H = q.shape
    K, S = k.shape[1], k.shape[2]
    qg = q.reshape(B, K, N // K, T, H)  # (B, K, G, T, H)
    ct = compute_dtype(q.dtype)
    scores = jnp.einsum(LOGITS, qg.astype(ct), k.astype(ct), precision=_precision(precision))  # (B, K, G, T, S)
    return (scores * jnp.asarray(scale, ct)).reshape(B, N, T, S).astype(q.dtype)  # (B, N, T, S)


def mask(x, allowed, bias):
    """Add bias, then set disallowed positions to -inf. allowed and bias are
    rank-4 and broadcast to (B, N, T, S). A -inf in bias is a mask, the same
    as a False in allowed: the position is set to -inf, whatever the logit (a
    NaN logit there, from a NaN key, is hidden as a bool mask hides it). A
    select, so a masked position gets no gradient (as in impl_numpy/backward.py)."""
    if bias is not None:
        x = (x.astype(compute_dtype(x.dtype)) + bias).astype(x.dtype)
        finite = bias > -jnp.inf  # (B|1, N|1, T|1, S|1)
        allowed = finite if allowed is None else allowed & finite
    if allowed is not None:
        x = jnp.where(allowed, x, jnp.asarray(-jnp.inf, x.dtype))
    return x


def softmax(x, masked_row: str):
    """Softmax over S in compute dtype. A row with no finite logit (every key
    masked) becomes: "zero" all 0, "uniform" all 1/S, "nan" all NaN."""
    ct = compute_dtype(x.dtype)
    xc = x.astype(ct)
    row_max = jnp.max(xc, axis=-1, keepdims=True)  # (B, N, T, 1)
    empty = row_max == -jnp.inf
    # softmax is shift-invariant: the shift carries no gradient
    shift = lax.stop_gradient(jnp.where(empty, jnp.asarray(0, ct), row_max))  # (B, N, T, 1)
    e = jnp.exp(xc - shift)  # masked -> exactly 0
    total = e.sum(axis=-1, keepdims=True)  # (B, N, T, 1)
    w = e / jnp.where(empty, jnp.asarray(1, ct), total)
    fill = {"zero": 0.0, "uniform": 1.0 / x.shape[-1], "nan": np.nan}[masked_row]
    w = jnp.where(empty, jnp.asarray(fill, ct), w)  # the filled row carries no gradient to its logits
    return w.astype(x.dtype)


def dropout(w, keep, rate: float):
    """Inverted dropout with an explicit keep-mask (B, N, T, S)."""
    if keep is None:
        return w
    ct = compute_dtype(w.dtype)
    return jnp.where(keep, w.astype(ct) / jnp.asarray(1.0 - rate, ct), jnp.asarray(0, ct)).astype(w.dtype)


def attend(w, v, precision: str = "highest"):
    """ATTEND: weights (B, N, T, S), v (B, K, S, V) -> (B, N, T, V)."""
    B, N, T, S = w.shape
    K = v.shape[1]
    wg = w.reshape(B, K, N // K, T, S)  # (B, K, G, T, S)
    return _einsum(ATTEND, wg, v, w.dtype, precision).reshape(B, N, T, v.shape[-1])  # (B, N, T, V)


def merge_heads(x):
    """(B, N, T, V) -> (B, T, N*V)."""
    B, N, T, V = x.shape
    return x.transpose(0, 2, 1, 3).reshape(B, T, N * V)  # (B, T, N*V)


def output(x, kernel, bias, precision: str = "highest"):
    """OUTPUT: (B, T, N*V) times kernel (N, V, O) flattened -> (B, T, O)."""
    y = _einsum(OUTPUT, x, kernel.reshape(-1, kernel.shape[-1]), x.dtype, precision)  # (B, T, O)
    if bias is not None:
        ct = compute_dtype(x.dtype)
        y = (y.astype(ct) + bias.astype(ct)).astype(x.dtype)  # (B, T, O)
    return y


# -- the fast path: logits .. attend in one expression -----------------------------

def fused_attention(q, k, v, allowed, bias, scale: float, masked_row: str, precision: str = "highest"):
    """logits -> mask -> softmax -> attend in one expression, for calls that
    ask for neither the weights nor the trace, in float32 or float64 (where
    every stage's rounding to the storage dtype is the identity) and without
    dropout. The same contractions (LOGITS and ATTEND with G folded into T,
    as impl_numpy's matmuls do) and the same arithmetic up to the order of
    rounding: the softmax's division by the row sum is applied to the (T, V)
    context instead of the (T, S) weights.

    Written for XLA CPU's YNNPACK fusion, which fuses dot, max, exp, sum,
    dot and the division as long as the expression holds no select: a call
    with neither mask, causality nor bias runs as that one fusion. Otherwise
    one select hides positions, as mask() does (an added -inf would not: a
    NaN or infinite logit there, from a NaN key or an overflowing product,
    plus -inf is NaN and would reach the whole row, where the stages give it
    weight 0), and a bias is added where it is finite; the select sits
    outside the fusion (one more pass over the logits). A row with no allowed key is
    computed finite (every position kept, no bias) and its context replaced
    afterwards by the masked_row policy's (0 x V, the mean of V, NaN), as
    functional.softmax fills its weights.

    q (B, N, T, H), k (B, K, S, H), v (B, K, S, V); allowed (bool) and bias
    rank 4, broadcasting to (B, N, T, S), or None -> context (B, N, T, V)."""
    B, N, T, H = q.shape
    K, S, V = k.shape[1], k.shape[2], v.shape[3]
    ct = compute_dtype(q.dtype)
    pr = _precision(precision)
    add = empty = visible = None
    if allowed is not None or bias is not None:
        ok = allowed
        if bias is not None:
            finite = bias > -jnp.inf
            ok = finite if ok is None else ok & finite
        empty = ~jnp.any(ok, axis=-1, keepdims=True)  # (B|1, N|1, T|1, 1): rows with no allowed key
        visible = ok | empty  # the positions mask() keeps, and an empty row's (computed finite, then replaced)
        if bias is not None:  # 0 where hidden or in an empty row: the select below sets what is hidden
            add = jnp.where(ok, bias.astype(ct), jnp.asarray(0, ct))
    G = N // K

    def grouped(a):
        """A rank-4 (b, n, t, s) array broadcasting to (B, N, T, S) -> broadcasting to (B, K, G*T, S)."""
        b, n, t, s = a.shape
        if n > 1:  # per head: (b, N, T, s) -> (b, K, G*T, s)
            return jnp.broadcast_to(a, (b, N, T, s)).reshape(b, K, G * T, s)
        if t > 1 and G > 1:  # the same (T, s) for each of the G query heads of a K head
            return jnp.broadcast_to(a[:, :, None], (b, 1, G, T, s)).reshape(b, 1, G * T, s)
        return a

    # LOGITS and ATTEND with G and T as one axis (a free reshape of (B, N, T, H)), as impl_numpy's
    # matmuls do: XLA then fuses the whole expression, where a separate G axis costs a layout copy.
    qg = q.reshape(B, K, G * T, H).astype(ct)  # (B, K, G*T, H)
    x = jnp.einsum(LOGITS.replace("G", ""), qg, k.astype(ct), precision=pr) * jnp.asarray(scale, ct)  # (B, K, G*T, S)
    if add is not None:
        x = x + grouped(add)  # (B, K, G*T, S)
    if visible is not None:  # a hidden NaN or inf logit must not reach its row (as in mask())
        x = jnp.where(grouped(visible), x, jnp.asarray(-jnp.inf, ct))  # (B, K, G*T, S)
    row_max = lax.stop_gradient(x.max(axis=-1, keepdims=True))  # softmax is shift-invariant
    e = jnp.exp(x - row_max)  # (B, K, G*T, S)
    ctx = jnp.einsum(ATTEND.replace("G", ""), e, v.astype(ct), precision=pr) / e.sum(axis=-1, keepdims=True)
    ctx = ctx.reshape(B, N, T, V)  # (B, N, T, V)
    if empty is not None:
        # the fill weights (0, 1/S or NaN) times V, as the stages' attend: V's gradient is the plain path's,
        # and "zero" gives 0 x V (NaN in a column where a value is NaN), not a plain 0
        v_sum = v.astype(ct).sum(axis=2, keepdims=True)  # (B, K, 1, V)
        v_sum = jnp.broadcast_to(v_sum[:, :, None], (B, K, N // K, 1, V)).reshape(B, N, 1, V)  # (B, N, 1, V)
        w = {"zero": 0.0, "uniform": 1.0 / S, "nan": np.nan}[masked_row]
        fill = jnp.where(empty, jnp.asarray(w, ct), jnp.asarray(0, ct)) * v_sum  # NaN only on empty rows
        ctx = jnp.where(empty, fill, ctx)
    return ctx.astype(q.dtype)


# -- helpers shared by the whole call ---------------------------------------------

def dropout_keep_mask(shape: tuple[int, ...], rate: float, rng) -> jax.Array:
    """JAX's own keep-mask from a PRNG key. Seeds are per framework: for the
    same dropout across frameworks pass an explicit dropout_mask instead."""
    return jax.random.bernoulli(rng, 1.0 - rate, shape)


def allowed_mask(mask4, T: int, S: int, is_causal: bool, causal_alignment: str):
    """mask AND causal, rank 4, broadcastable to (B, N, T, S); None if neither."""
    allowed = mask4
    if is_causal:
        causal = causal_mask(T, S, causal_alignment)[None, None]  # (1, 1, T, S)
        allowed = causal if allowed is None else allowed & causal
    return allowed


# -- validation: static shapes and dtypes, so it runs at jit trace time -------------

def is_concrete(x) -> bool:
    """True for values that can be read (NumPy, eager jax.Array); False for tracers."""
    return not isinstance(x, jax.core.Tracer)


def x64_enabled() -> bool:
    return bool(jax.config.jax_enable_x64)


def _as_array(x):
    """Arrays (NumPy, jax, tracers) as they are; anything else through NumPy."""
    return x if hasattr(x, "shape") and hasattr(x, "dtype") else np.asarray(x)


def check_params(config: AttentionConfig, params) -> np.dtype:
    """Names, shapes and the one dtype of `params` (jax or NumPy arrays, or
    tracers) in weights.validate_tensors' words; returns the dtype. Values
    (NaN / Inf) are checked where tensors enter (the layer, the adapter)."""
    expected = config.tensor_shapes()
    params = {name: _as_array(t) for name, t in params.items()}
    dtypes = {np.dtype(t.dtype) for t in params.values()}
    if (
        set(params) == set(expected)
        and all(tuple(params[n].shape) == shape for n, shape in expected.items())
        and len(dtypes) == 1
        and next(iter(dtypes)) in DTYPES.values()
    ):
        return resolve_dtype(next(iter(dtypes)))
    # Something is wrong: the reference words it, from stand-ins of the same
    # shapes and dtypes that hold no memory of their own.
    return validate_tensors(config, {n: np.broadcast_to(np.zeros((), t.dtype), t.shape) for n, t in params.items()})


def check(config, params, query, key=None, value=None, *, mask=None, bias=None, dropout_mask=None,
          is_causal=False, causal_alignment="top_left", training=False, seed=None, rng=None,
          return_weights=False, dtype=None, precision="highest", materializes_scores=True):
    """Validate a call in the reference's order and words; returns (CallShapes,
    storage dtype). Reads shapes and dtypes only, and bias values when bias
    is concrete. materializes_scores=False (the chunked path) skips the
    up-front refusal of (B, N, T, S) arrays that cannot fit in memory."""
    stored = check_params(config, params)
    dtype = stored if dtype is None else dtype_from_name(dtype)
    if dtype == np.float64 and not x64_enabled():
        raise ValueError(X64_MESSAGE)
    _precision(precision)
    query = _as_array(query)
    key = query if key is None else _as_array(key)
    value = key if value is None else _as_array(value)
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not is_float(x.dtype):
            raise ValueError(f"{name} must be a float array: got dtype {x.dtype}")
    if seed is not None and rng is not None:
        raise ValueError(f"pass seed or rng, not both: got seed={seed!r} and an rng key")
    mask, bias, keep = (None if a is None else _as_array(a) for a in (mask, bias, dropout_mask))
    shapes = check_call(
        config, query_shape=query.shape, key_shape=key.shape, value_shape=value.shape,
        mask_shape=None if mask is None else mask.shape,
        mask_dtype=None if mask is None else np.dtype(mask.dtype).name,
        bias_shape=None if bias is None else bias.shape,
        bias_dtype=None if bias is None else np.dtype(bias.dtype).name,
        dropout_mask_shape=None if keep is None else keep.shape,
        dropout_mask_dtype=None if keep is None else np.dtype(keep.dtype).name,
        is_causal=is_causal, causal_alignment=causal_alignment, training=training,
        seed=0 if rng is not None else seed,  # an rng key stands in for a seed
        return_weights=return_weights, materializes_scores=materializes_scores,
        scores_itemsize=compute_dtype(dtype).itemsize,
    )
    if bias is not None and is_concrete(bias):
        check_bias_values(np.asarray(bias))
    return shapes, dtype


def _cast(x, dtype):
    """To a jax.Array of `dtype`. NumPy arrays are cast by NumPy (the
    reference's rounding, and no float64 detour when x64 is off)."""
    if isinstance(x, np.ndarray):
        return jnp.asarray(x.astype(dtype, copy=False))
    return jnp.asarray(x).astype(dtype)


def prepare(config, params, query, key, value, *, mask, bias, dropout_mask, is_causal, causal_alignment,
            training, seed, rng, return_weights, dtype, precision, materializes_scores=True):
    """Validate a call (`check`) and cast everything to the storage dtype."""
    shapes, dtype = check(
        config, params, query, key, value, mask=mask, bias=bias, dropout_mask=dropout_mask, is_causal=is_causal,
        causal_alignment=causal_alignment, training=training, seed=seed, rng=rng, return_weights=return_weights,
        dtype=dtype, precision=precision, materializes_scores=materializes_scores,
    )
    if bias is not None:
        bias = _cast(_as_array(bias), compute_dtype(dtype)).reshape(shapes.bias_shape)  # (B|1, N|1, T|1, S|1)
    cast_params = {name: _cast(_as_array(t), dtype) for name, t in params.items()}
    keep = None if dropout_mask is None else jnp.asarray(_as_array(dropout_mask))
    if training and keep is None and config.dropout > 0:
        rng = jax.random.key(seed) if rng is None else rng
        keep = dropout_keep_mask((shapes.B, config.num_heads, shapes.T, shapes.S), config.dropout, rng)
    if not training:
        keep = None
    mask4 = None if mask is None else jnp.asarray(_as_array(mask)).reshape(shapes.mask_shape)  # (B|1, N|1, T|1, S|1)
    query = _as_array(query)
    key = query if key is None else _as_array(key)
    value = key if value is None else _as_array(value)
    cast = [_cast(x, dtype) for x in (query, key, value)]
    return shapes, cast_params, cast, mask4, bias, keep, dtype


def apply(
    config: AttentionConfig,
    params: dict[str, Any],
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
    rng=None,
    return_weights: bool = False,
    precision: str = "highest",
    dtype: str | None = None,
    chunk_size: int | None = None,
    trace: list | None = None,
):
    """The forward pass, pure. Returns output (B, T, O), or (output, weights)
    with weights (B, N, T, S) after softmax and before dropout when
    return_weights.

    params: canonical name -> array ("query.kernel" (D, N, H), ...).
    seed / rng: dropout in training without a dropout_mask: an int seed
    (static under jit) or a jax.random key (traced).
    dtype: compute in this storage dtype (default: the params' dtype).
    chunk_size: exact online softmax over key (and query) blocks of this size;
    never holds a (T, S) array and skips key blocks the causal mask hides
    (see chunked.py; static under jit). Not with return_weights or trace.
    trace: a list that receives a TraceEntry per stage (impl_numpy's STAGES);
    inside jit the entries hold tracers, so return them from the jitted
    function to read them (impl_jax.adapter does).
    """
    shapes, p, (query, key, value), mask4, bias_r4, keep, dtype = prepare(
        config, params, query, key, value, mask=mask, bias=bias, dropout_mask=dropout_mask,
        is_causal=is_causal, causal_alignment=causal_alignment, training=training, seed=seed, rng=rng,
        return_weights=return_weights, dtype=dtype, precision=precision,
        materializes_scores=chunk_size is None or return_weights,
    )
    chunk_size = check_chunk_size(chunk_size, return_weights=return_weights, traced=trace is not None)
    if chunk_size is not None:
        from .chunked import chunked_attention

        return chunked_attention(config, p, query, key, value, mask=mask4, bias=bias_r4, keep=keep, is_causal=is_causal,
                                 causal_alignment=causal_alignment, chunk_size=chunk_size, precision=precision)
    allowed = allowed_mask(mask4, shapes.T, shapes.S, is_causal, causal_alignment)
    pr = precision
    rec = lambda stage, value: _record(trace, stage, value)  # noqa: E731
    q = rec("query.project", project(query, p["query.kernel"], p.get("query.bias"), pr))  # (B, T, N*H)
    k = rec("key.project", project(key, p["key.kernel"], p.get("key.bias"), pr))  # (B, S, K*H)
    v = rec("value.project", project(value, p["value.kernel"], p.get("value.bias"), pr))  # (B, S, K*V)
    q = rec("query.split_heads", split_heads(q, config.num_heads))  # (B, N, T, H)
    k = rec("key.split_heads", split_heads(k, config.num_kv_heads))  # (B, K, S, H)
    v = rec("value.split_heads", split_heads(v, config.num_kv_heads))  # (B, K, S, V)
    if trace is None and not return_weights and keep is None and compute_dtype(dtype) == dtype:
        # nothing asks for the stages between: logits .. attend as one expression (the same
        # contractions; results equal to the stages' within the tolerance policy)
        ctx = fused_attention(q, k, v, allowed, bias_r4, config.effective_scale, config.masked_row, pr)
    else:
        x = rec("logits", logits(q, k, config.effective_scale, pr))  # (B, N, T, S)
        x = rec("mask", mask_stage(x, allowed, bias_r4))
        w = rec("softmax", softmax(x, config.masked_row))  # (B, N, T, S)
        wd = rec("dropout", dropout(w, keep, config.dropout))
        ctx = rec("attend", attend(wd, v, pr))  # (B, N, T, V)
    ctx = rec("merge_heads", merge_heads(ctx))  # (B, T, N*V)
    out = rec("output", output(ctx, p["output.kernel"], p.get("output.bias"), pr))  # (B, T, O)
    return (out, w) if return_weights else out


# The spec's name for the whole call.
multi_head_attention = apply

# `mask` is both a stage and an argument name; the call uses this alias.
mask_stage = mask

STAGES = (
    "query.project", "key.project", "value.project",
    "query.split_heads", "key.split_heads", "value.split_heads",
    "logits", "mask", "softmax", "dropout", "attend", "merge_heads", "output",
)
