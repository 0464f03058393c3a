"""Multi-head attention, one pure function per stage: the executable spec.

Every impl_*/functional.py mirrors this file: same stage functions, same
names, same einsum strings, same order. A disagreement between two backends
therefore names a stage.

Shape letters (used in every comment and einsum string of the project):
  B batch             T query length        S key/value length
  N query heads       K key/value heads     G = N / K query heads per K head
  H head dim (q, k)   V value head dim      D input features    O output features
  F a flattened head axis: N*H, K*H or K*V (N*V after merge_heads)

Stages: project -> split_heads -> logits (scale) -> mask (and bias) ->
softmax -> dropout -> attend -> merge_heads -> output.

Precision rule: each stage's result is stored in the storage dtype; its
arithmetic (matmul accumulation, exp and sums) runs in `compute_dtype`,
float32 for float16/bfloat16 inputs, the dtype itself otherwise.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from weights import AttentionConfig, compute_dtype, dtype_from_name, validate_tensors
from weights.contract import check_bias_values, check_call, check_chunk_size, check_input_values
from weights.dtypes import is_float

from .masks import causal_mask

# The fused fast path's chunk_size: key blocks of 512 (query blocks of chunked.QUERY_ROWS).
FUSED_BLOCK = 512

# The contractions, written once; the mirrors use the same strings.
PROJECT = "BLD,DF->BLF"
LOGITS = "BKGTH,BKSH->BKGTS"
ATTEND = "BKGTS,BKSV->BKGTV"
OUTPUT = "BTF,FO->BTO"


@dataclasses.dataclass
class TraceEntry:
    stage: str
    value: Any  # the stage's output, in the backend's own array type


def _record(trace: list | None, stage: str, value):
    if trace is not None:
        trace.append(TraceEntry(stage, value))
    return value


def _matmul(a: np.ndarray, b: np.ndarray, dtype: np.dtype) -> np.ndarray:
    ct = compute_dtype(dtype)
    return np.matmul(a.astype(ct, copy=False), b.astype(ct, copy=False)).astype(dtype, copy=False)


def _product_plus_bias(y: np.ndarray, bias: np.ndarray | None, dtype: np.dtype) -> np.ndarray:
    """A matmul result y (compute dtype) plus bias, stored in dtype. The product
    is rounded to the storage dtype before the bias is added (the rounding rule);
    in float32/float64 that rounding is the identity, so the add runs in place."""
    if bias is not None:
        if y.dtype != dtype:
            y = y.astype(dtype).astype(y.dtype)
        y += bias
    return y.astype(dtype, copy=False)


def _matmul_2d(x: np.ndarray, kernel2d: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """x (B, L, D) times (D, F) as one (B*L, D) GEMM in compute dtype: one
    large matmul runs near the BLAS roofline, B small ones do not."""
    B, L, D = x.shape
    ct = compute_dtype(x.dtype)
    y = np.matmul(x.reshape(B * L, D).astype(ct, copy=False), kernel2d.astype(ct, copy=False),
                  out=None if out is None else out.reshape(B * L, -1))  # (B*L, F)
    return y.reshape(B, L, -1)


# -- stages --------------------------------------------------------------------

def project(x: np.ndarray, kernel: np.ndarray, bias: np.ndarray | None, out: np.ndarray | None = None) -> np.ndarray:
    """PROJECT: x (B, L, D) times kernel (D, heads, width) flattened -> (B, L, F).
    out: a contiguous (B, L, F) array to compute into (float32/float64 only)."""
    D = kernel.shape[0]
    y = _matmul_2d(x, kernel.reshape(D, -1), out)  # (B, L, F)
    return _product_plus_bias(y, None if bias is None else bias.reshape(-1), x.dtype)


def split_heads(x: np.ndarray, num_heads: int) -> np.ndarray:
    """(B, L, heads*width) -> (B, heads, L, width), as seed 003's split_heads."""
    B, L, F = x.shape
    x = x.reshape(B, L, num_heads, F // num_heads)  # (B, L, heads, width)
    return x.transpose(0, 2, 1, 3)  # (B, heads, L, width)


def logits(q: np.ndarray, k: np.ndarray, scale: float) -> np.ndarray:
    """LOGITS times scale: q (B, N, T, H), k (B, K, S, H) -> (B, N, T, S).
    Query head n reads key head n // G."""
    B, N, T, H = q.shape
    K, S = k.shape[1], k.shape[2]
    qg = q.reshape(B, K, (N // K) * T, H)  # (B, K, G*T, H)
    ct = compute_dtype(q.dtype)
    scores = np.matmul(qg.astype(ct, copy=False), k.astype(ct, copy=False).swapaxes(-1, -2))  # (B, K, G*T, S)
    scores *= ct.type(scale)
    return scores.reshape(B, N, T, S).astype(q.dtype, copy=False)  # (B, N, T, S)


def mask(x: np.ndarray, allowed: np.ndarray | None, bias: np.ndarray | None) -> np.ndarray:
    """Add bias, then set disallowed positions to -inf. allowed and bias are
    rank-4 and broadcast to (B, N, T, S). A -inf in bias is a mask, the same
    as a False in allowed: the position is set to -inf, whatever the logit
    (a NaN logit there, from a NaN key, is hidden as a bool mask hides it)."""
    if bias is not None:
        x = (x.astype(compute_dtype(x.dtype)) + bias).astype(x.dtype)
        finite = bias > -np.inf  # (B|1, N|1, T|1, S|1)
        allowed = finite if allowed is None else allowed & finite
    if allowed is not None:
        x = np.where(allowed, x, x.dtype.type(-np.inf))
    return x


def softmax(x: np.ndarray, masked_row: str) -> np.ndarray:
    """Softmax over S in compute dtype. A row with no finite logit (every key
    masked) becomes: "zero" all 0, "uniform" all 1/S, "nan" all NaN."""
    ct = compute_dtype(x.dtype)
    row_max = x.max(axis=-1, keepdims=True).astype(ct)  # (B, N, T, 1); exact in any dtype
    empty = row_max == -np.inf
    row_max[empty] = 0
    w = np.subtract(x, row_max, dtype=ct)  # a fresh array (x may be a traced stage), then worked on in place
    np.exp(w, out=w)  # masked -> exactly 0
    total = w.sum(axis=-1, keepdims=True)
    total[empty] = 1
    w /= total
    if empty.any():
        fill = {"zero": 0.0, "uniform": 1.0 / x.shape[-1], "nan": np.nan}[masked_row]
        w = np.where(empty, ct.type(fill), w)
    return w.astype(x.dtype, copy=False)


def dropout(w: np.ndarray, keep: np.ndarray | None, rate: float) -> np.ndarray:
    """Inverted dropout with an explicit keep-mask (B, N, T, S)."""
    if keep is None:
        return w
    ct = compute_dtype(w.dtype)
    return np.where(keep, w.astype(ct) / ct.type(1.0 - rate), ct.type(0)).astype(w.dtype)


def attend(w: np.ndarray, v: np.ndarray) -> np.ndarray:
    """ATTEND: weights (B, N, T, S), v (B, K, S, V) -> (B, N, T, V)."""
    B, N, T, S = w.shape
    K = v.shape[1]
    wg = w.reshape(B, K, (N // K) * T, S)  # (B, K, G*T, S)
    return _matmul(wg, v, w.dtype).reshape(B, N, T, v.shape[-1])  # (B, N, T, V)


def merge_heads(x: np.ndarray) -> np.ndarray:
    """(B, N, T, V) -> (B, T, N*V)."""
    B, N, T, V = x.shape
    return x.transpose(0, 2, 1, 3).reshape(B, T, N * V)  # (B, T, N*V)


def output(x: np.ndarray, kernel: np.ndarray, bias: np.ndarray | None, out: np.ndarray | None = None) -> np.ndarray:
    """OUTPUT: (B, T, N*V) times kernel (N, V, O) flattened -> (B, T, O).
    out: a contiguous (B, T, O) array to compute into (float32/float64 only)."""
    y = _matmul_2d(x, kernel.reshape(-1, kernel.shape[-1]), out)  # (B, T, O)
    return _product_plus_bias(y, bias, x.dtype)


# -- helpers shared by the whole call ---------------------------------------------

def dropout_keep_mask(shape: tuple[int, ...], rate: float, seed: int) -> np.ndarray:
    """NumPy's own seeded keep-mask. Seeds are per framework: for the same
    dropout across frameworks pass an explicit dropout_mask instead."""
    return np.random.default_rng(seed).random(shape) >= rate


def allowed_mask(mask4: np.ndarray | None, T: int, S: int, is_causal: bool, causal_alignment: str) -> np.ndarray | None:
    """mask AND causal, rank 4, broadcastable to (B, N, T, S); None if neither."""
    allowed = mask4
    if is_causal:
        causal = causal_mask(T, S, causal_alignment)[None, None]  # (1, 1, T, S)
        allowed = causal if allowed is None else allowed & causal
    return allowed


def prepare(config, tensors, query, key, value, *, mask, bias, dropout_mask, is_causal, causal_alignment,
            training, seed, return_weights, dtype, materializes_scores=True):
    """Validate a call and cast everything to the storage dtype."""
    stored = validate_tensors(config, tensors)
    dtype = stored if dtype is None else dtype_from_name(dtype)
    query = np.asarray(query)
    key = query if key is None else np.asarray(key)
    value = key if value is None else np.asarray(value)
    mask_np = None if mask is None else np.asarray(mask)
    bias_np = None if bias is None else np.asarray(bias)
    keep_np = None if dropout_mask is None else np.asarray(dropout_mask)
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not is_float(x.dtype):
            raise ValueError(f"{name} must be a float array: got dtype {x.dtype}")
    shapes = check_call(
        config, query_shape=query.shape, key_shape=key.shape, value_shape=value.shape,
        mask_shape=None if mask_np is None else mask_np.shape,
        mask_dtype=None if mask_np is None else mask_np.dtype.name,
        bias_shape=None if bias_np is None else bias_np.shape,
        bias_dtype=None if bias_np is None else bias_np.dtype.name,
        dropout_mask_shape=None if keep_np is None else keep_np.shape,
        dropout_mask_dtype=None if keep_np is None else keep_np.dtype.name,
        is_causal=is_causal, causal_alignment=causal_alignment, training=training, seed=seed,
        return_weights=return_weights, materializes_scores=materializes_scores,
        scores_itemsize=compute_dtype(dtype).itemsize,
    )
    check_input_values(query=query, key=None if key is query else key, value=None if value is key else value)
    if bias_np is not None:
        check_bias_values(bias_np)
        bias_np = bias_np.astype(compute_dtype(dtype)).reshape(shapes.bias_shape)
    params = {name: t.astype(dtype, copy=False) for name, t in tensors.items()}
    if training and keep_np is None and config.dropout > 0:
        keep_np = dropout_keep_mask((shapes.B, config.num_heads, shapes.T, shapes.S), config.dropout, seed)
    if not training:
        keep_np = None
    mask4 = None if mask_np is None else mask_np.reshape(shapes.mask_shape)
    cast = [x.astype(dtype, copy=False) for x in (query, key, value)]
    return shapes, params, cast, mask4, bias_np, keep_np, dtype


def multi_head_attention(
    config: AttentionConfig,
    tensors: dict[str, np.ndarray],
    query: np.ndarray,
    key: np.ndarray | None = None,
    value: np.ndarray | None = None,
    *,
    mask: np.ndarray | None = None,
    bias: np.ndarray | None = None,
    is_causal: bool = False,
    causal_alignment: str = "top_left",
    training: bool = False,
    dropout_mask: np.ndarray | None = None,
    seed: int | None = None,
    return_weights: bool = False,
    dtype: str | None = None,
    chunk_size: int | None = None,
    trace: list | None = None,
):
    """The forward pass. Returns output (B, T, O), or (output, weights) with
    weights (B, N, T, S) after softmax and before dropout when return_weights.

    dtype: compute in this storage dtype (default: the tensors' dtype).
    chunk_size: exact online-softmax over key blocks of this size; never
    holds a (T, S) array (see chunked.py). Not with return_weights or trace.

    Fast path: when nothing between the projections is asked for (no trace,
    no weights) and the storage dtype computes in itself (float32, float64),
    logits ... attend run fused, block by block, in chunked.py's core (key
    blocks of FUSED_BLOCK, hidden causal blocks skipped): the same results to
    round-off (but see chunked.py on NaN in a hidden key). The stage functions
    above are the spec; the trace, the weights and 16-bit storage (whose
    every stage result is rounded) take them.
    """
    shapes, p, (query, key, value), mask4, bias_r4, keep, dtype = prepare(
        config, tensors, query, key, value, mask=mask, bias=bias, dropout_mask=dropout_mask,
        is_causal=is_causal, causal_alignment=causal_alignment, training=training, seed=seed,
        return_weights=return_weights, dtype=dtype, materializes_scores=chunk_size is None or return_weights,
    )
    chunk_size = check_chunk_size(chunk_size, return_weights=return_weights, traced=trace is not None)
    ct = compute_dtype(dtype)
    if chunk_size is not None or (trace is None and not return_weights and ct == dtype):
        from .chunked import fused_forward

        return fused_forward(config, p, query, key, value, mask=mask4, bias=bias_r4, keep=keep, is_causal=is_causal,
                             causal_alignment=causal_alignment,
                             chunk_size=FUSED_BLOCK if chunk_size is None else chunk_size)  # (B, T, O)

    allowed = allowed_mask(mask4, shapes.T, shapes.S, is_causal, causal_alignment)
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
