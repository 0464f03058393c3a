"""The lightning indexer in keras.ops: mirrors impl_numpy/indexer.py (same stages, same names, same einsum
strings; keras.ops and impl_tf.backend's primitives through impl_tf.functional's stages), so that it runs on
Keras's tensorflow, jax and torch backends. Shape letters as there: I index heads, J index head_dim, G
selection groups.

Traceable (jax.jit, tf.function with static shapes): nothing is read to the host but a LongRoPE table's
choice, eagerly (functional.rope_tables_of; traced, a where), and, eagerly from TOPK_FEW_MIN_KEYS keys, whether
the top-k's fast form holds (_select_few). The top-k is a stable argsort of the negated scores
(backend.argsort_stable: keras.ops.argsort is unstable on TensorFlow and no framework's top_k promises an
order among equal scores; the contract's is higher score first, then lower key index); a decode step's few of
many keys take keras.ops.top_k where no tie straddles the k-th score. One query over DECODE_SCORES_MIN_KEYS keys
or more takes the decode forms below (_decode_scores, _decode_prelude). The fp8 simulation rounds through
TensorFlow's float8_e4m3fn (round to nearest even, as ml_dtypes) and builds UE8M0 scales from float32 bits
(tf_only.round_fp8, tf_only.ue8m0): keras.ops has no float8 cast every backend honours and no bitcast, so
precision "fp8_e4m3" runs on Keras's TensorFlow backend alone (FP8_UNSUPPORTED on the others).
"""

from __future__ import annotations

import functools
import math

import numpy as np

from weights import AttentionConfig, dtype_from_name

from . import backend as bk
from . import functional as F
from ._keras import BACKEND, TENSORFLOW, keras

if TENSORFLOW:
    from ._keras import tf
from .backend import check_dtype
from .masks import causal_mask

ops = keras.ops

FP8_MAX = 448.0
FP8_AMAX_FLOOR = 1e-4
FP8_BLOCK = 128
PRECISIONS = (None, "fp8_e4m3")
GATED = "gated"  # Indexer.block_pool of GLM-5.3-Flash's k-pool
# The layer's tensors the indexer reads: its own, and the query latent's (query_source "latent").
READS = ("indexer.", "query.down.")
FP8_SCALE_FORMATS = ("float", "ue8m0")

# Why the fp8 simulation (precision "fp8_e4m3") is TensorFlow's alone.
FP8_UNSUPPORTED = (f"precision fp8_e4m3 needs Keras's TensorFlow backend (keras runs on {BACKEND}): impl_tf's "
                   "fp8 simulation rounds through TensorFlow's float8_e4m3fn and reads float32 bits (tf.bitcast); "
                   "keras.ops has neither")


def _fp8():
    """The TensorFlow-only module holding the fp8 rounding (a NotImplementedError elsewhere; a ValueError where
    TensorFlow lacks float8_e4m3fn)."""
    if not TENSORFLOW:
        raise NotImplementedError(FP8_UNSUPPORTED)
    from . import tf_only

    tf_only.float8_e4m3fn()
    return tf_only


# -- stages -----------------------------------------------------------------------------------------------

def index_rope(x, angles, rotary_dim: int, interleaved: bool, attention_factor: float, end: str):
    if end == "first":
        return F.rope(x, angles, rotary_dim, interleaved, attention_factor)
    return F.rope_last(x, angles, rotary_dim, interleaved, attention_factor)


def hadamard(x):
    J = x.shape[-1]
    h = np.ones((1, 1))
    while h.shape[0] < J:
        h = np.block([[h, h], [h, -h]])
    ct = F.compute_dtype(x.dtype)
    return F._cast(bk.matmul(F._cast(x, ct), ops.convert_to_tensor((h / math.sqrt(J)).astype(ct))), F.dtype_name(x))


def quantize_fp8(x, block: int, scale_format: str):
    fp8 = _fp8()
    shape = tuple(x.shape)
    xb = ops.reshape(F._cast(x, "float64"), (*shape[:-1], shape[-1] // block, block))  # (..., nblk, block)
    amax = ops.cast(ops.maximum(ops.max(ops.abs(xb), axis=-1, keepdims=True), FP8_AMAX_FLOOR), "float32")
    scale = amax * bk.constant(1 / FP8_MAX, "float32")  # float32, times the reciprocal
    if scale_format == "ue8m0":  # 2^ceil(log2 scale), exactly: the float32 exponent, plus one unless a power of two
        scale = fp8.ue8m0(scale)
    scale = ops.cast(scale, "float64")
    q = fp8.round_fp8(ops.clip(xb / scale, -FP8_MAX, FP8_MAX))
    return ops.reshape(q, shape), scale[..., 0]


def scores(q, k, weights, score_scale: float, relu: bool, per_kv_head: bool):
    ct = F.compute_dtype(q.dtype)
    S = k.shape[1]
    if q.shape[2] == 1 and not per_kv_head and S is not None and S >= DECODE_SCORES_MIN_KEYS:
        return _decode_scores(q, k, weights, score_scale, relu)
    dots = bk.einsum("BITJ,BSJ->BITS", F._cast(q, ct), F._cast(k, ct)) * bk.constant(score_scale, ct)  # (B, I, T, S)
    if relu:
        dots = bk.maximum(dots, ops.zeros_like(dots))  # bk.maximum: ops.maximum rounds float64 on torch
    if per_kv_head:
        return dots
    if weights is None:
        return ops.sum(dots, axis=1, keepdims=True)  # (B, 1, T, S)
    return bk.einsum("BTI,BITS->BTS", F._cast(weights, ct), dots)[:, None]  # (B, 1, T, S)


# A decode step's scores (one query, one selection) are taken with the keys as the rows, as
# impl_numpy.indexer._decode_scores: one (S, J) x (J, I) product per batch row (the scale folded into the (I, J)
# queries first: s (q.k) and (s q).k are equal to round-off, and the (S, I) dots are not passed over once more for
# it), ReLU, then the weighted sum a (S, I) x (I, 1) product. Measured (2-core AMD EPYC VM, 2026-11-30, loaded,
# process CPU time, min of 7-9; I 64, J 128, 65537 keys, float32, TensorFlow eager): the stage 27-28 ms as the
# einsums' (I, J) x (J, S) and (1, I) x (I, S), 15.1 ms this way. Compiled by XLA (tf.function(jit_compile=True))
# it was no faster (15.0-15.4 ms), and XLA compiles once per shape where a decode step's key count grows by one
# each step: left eager. Under DECODE_SCORES_MIN_KEYS keys (every grid case) the stage keeps its first form.
DECODE_SCORES_MIN_KEYS = 4096


def _decode_scores(q, k, weights, score_scale: float, relu: bool):
    """scores() for one query (T 1), one selection (not per kv head): q (B, I, 1, J), k (B, S, J), weights (B, 1, I)
    or None -> (B, 1, 1, S), in compute dtype; the keys as the rows of the products (one batch row: 2-D products,
    which TensorFlow runs faster than its batched ones, 15.1 against 16.7-19.2 ms the stage, the VM above)."""
    ct = F.compute_dtype(q.dtype)
    B, S, J = k.shape
    qs = F._cast(q[:, :, 0, :], ct) * bk.constant(score_scale, ct)  # (B, I, J), scaled
    w = None if weights is None else F._cast(weights, ct)[:, 0, :, None]  # (B, I, 1)
    if B == 1:
        qs, w = ops.transpose(qs[0]), None if w is None else w[0]  # (J, I), (I, 1)
        dots = bk.matmul(bk.reshape(F._cast(k, ct), (S, J)), qs)  # (S, I)
    else:
        dots = bk.matmul_nt(F._cast(k, ct), qs)  # (B, S, I)
    if relu:
        dots = ops.relu(dots)
    x = ops.sum(dots, axis=-1) if w is None else bk.matmul(dots, w)  # (B|, S[, 1])
    return bk.reshape(x, (-1, 1, 1, S))


def mask_scores(x, allowed):
    return ops.where(allowed, x, ops.full_like(x, -math.inf))


def block_scores(x, block_size: int):
    B, G, T, S = x.shape
    nb = -(-S // block_size)
    padded = ops.pad(x, [[0, 0], [0, 0], [0, 0], [0, nb * block_size - S]], constant_values=-math.inf)
    return ops.max(ops.reshape(padded, (B, G, T, nb, block_size)), axis=-1)  # (B, G, T, nb)


def keep_local_blocks(x, query_slots: np.ndarray, block_size: int, local_blocks: int):
    own = np.asarray(query_slots) // block_size  # (T,)
    local = np.zeros(tuple(x.shape[-2:]), dtype=bool)  # (T, nb)
    for back in range(local_blocks):
        b = own - back
        ok = b >= 0
        local[np.arange(len(own))[ok], b[ok]] = True
    keep = ops.logical_and(ops.convert_to_tensor(local), x > -math.inf)
    return ops.where(keep, ops.full_like(x, math.inf), x)


def select_topk(x, k: int):
    width = min(k, x.shape[-1])
    n = x.shape[-1]
    if width and n >= TOPK_FEW_MIN_KEYS and width * 2 < n and not bk.is_symbolic(x):
        few = _select_few(x, width)
        if few is not None:
            return few
    order = ops.cast(bk.argsort_stable(-x)[..., :width], "int64")  # stable: ties keep ascending index
    chosen = ops.take_along_axis(x, order, axis=-1)
    return ops.where(chosen > -math.inf, order, ops.full_like(order, -1))


# select_topk takes the few of many (a decode step's k 2048 of 65537 keys) without sorting every score, as
# impl_torch.indexer._select_few: keras.ops.top_k, then only the chosen sorted. Measured (2-core AMD EPYC VM,
# 2026-11-30, loaded, process CPU time, TensorFlow eager): 65537 scores, width 2048: the stable argsort of the row
# 6.1-6.2 ms, top_k 1.0 ms, the whole of _select_few 1.8 ms. Eager calls alone (it reads a flag to the host), and
# from TOPK_FEW_MIN_KEYS keys: the grid's cases keep the sort.
TOPK_FEW_MIN_KEYS = 4096


def _select_few(x, width: int):
    """select_topk's result (the stable sort's first `width`: descending score, ties by ascending index, -1 where
    the score is -inf) from ops.top_k's `width` keys, which are the selection itself where no score equal to the
    width-th one is left out (top_k's choice among ties is unspecified: that score counted in the row and among
    the chosen) and the row holds no NaN (ranked differently by top_k and the sort); then only they are ordered
    (ascending index, then stably by their negated scores). None where those do not hold (the caller sorts). On
    TensorFlow one graph (_few_graph), its flag read to the host."""
    selection, wrong = (_few_graph() if TENSORFLOW else _few)(x, width)
    return None if bool(ops.convert_to_numpy(wrong)) else selection


def _few(x, width: int):
    """(_select_few's selection, whether a tie straddles the width-th score or a NaN is in a row)."""
    vals, cols = ops.top_k(x, width, sorted=True)  # (..., width), descending
    kth = vals[..., -1:]
    in_row = ops.sum(ops.cast(x == kth, "int32"), axis=-1)
    in_chosen = ops.sum(ops.cast(vals == kth, "int32"), axis=-1)
    wrong = ops.logical_or(ops.any(ops.isnan(x)), ops.any(in_row != in_chosen))
    by_index = ops.argsort(cols, axis=-1)  # the chosen in ascending index (no two equal: any sort is the stable one)
    vals, cols = _take_last(vals, by_index), _take_last(cols, by_index)
    order = bk.argsort_stable(-vals)
    vals, cols = _take_last(vals, order), ops.cast(_take_last(cols, order), "int64")
    return ops.where(vals > -math.inf, cols, ops.full_like(cols, -1)), wrong


@functools.cache
def _few_graph():
    """_few as a TensorFlow graph (not XLA), its key count left unknown after a second length (reduce_retracing: a
    decode step's grows by one), the width a constant: 1.8 ms against 3.3 eagerly (65537 scores, width 2048, the
    VM above, process CPU time)."""
    return tf.function(_few, autograph=False, reduce_retracing=True)


def _take_last(x, index):
    """ops.take_along_axis(x, index, axis=-1), index of x's leading shape: on TensorFlow tf.gather with batch_dims
    (Keras 3.15.1's take_along_axis broadcasts and builds index grids: 0.94 against 0.06 ms for 2048 of 65537
    scores, eagerly, the VM above)."""
    if TENSORFLOW:
        return tf.gather(x, index, batch_dims=len(x.shape) - 1)
    return ops.take_along_axis(x, index, axis=-1)


def expand_blocks(blocks, block_size: int, allowed, S: int):
    B, G, T, kb = blocks.shape
    keys = ops.reshape(blocks[..., None] * block_size + ops.arange(block_size, dtype=F.dtype_name(blocks)),
                       (B, G, T, kb * block_size))
    valid = ops.logical_and(ops.reshape(ops.broadcast_to(blocks[..., None] >= 0, (B, G, T, kb, block_size)),
                                        (B, G, T, kb * block_size)), keys < S)
    seen = ops.broadcast_to(allowed, (B, G, T, S))
    valid = ops.logical_and(valid, ops.take_along_axis(seen, ops.clip(keys, 0, S - 1), axis=-1))
    order = ops.cast(bk.argsort_stable(ops.cast(ops.logical_not(valid), "int32"))[..., :min(kb * block_size, S)],
                     "int64")
    packed = ops.take_along_axis(keys, order, axis=-1)
    return ops.where(ops.take_along_axis(valid, order, axis=-1), packed, ops.full_like(packed, -1))


def pooled_keys(k, gates, position, block_size: int):
    B, S, J = k.shape
    ct = F.compute_dtype(k.dtype)
    nb = -(-S // block_size)
    pad = [[0, 0], [0, nb * block_size - S], [0, 0]]
    logits = ops.pad(F._cast(gates, ct), pad, constant_values=-math.inf)  # (B, nb * bs, J)
    logits = ops.reshape(logits, (B, nb, block_size, J)) + F._cast(position, ct)  # (B, nb, bs, J)
    p = ops.exp(logits - ops.max(logits, axis=2, keepdims=True))
    p = p / ops.sum(p, axis=2, keepdims=True)  # (B, nb, bs, J): the gate over each block's slots, per feature
    padded = ops.pad(F._cast(k, ct), pad)
    return bk.einsum("BnbJ,BnbJ->BnJ", p, ops.reshape(padded, (B, nb, block_size, J)))  # (B, nb, J)


def complete_blocks(allowed, block_size: int):
    *lead, S = allowed.shape
    nb = -(-S // block_size)
    padded = ops.pad(ops.cast(allowed, "int32"), [[0, 0]] * len(lead) + [[0, nb * block_size - S]])
    return ops.min(ops.reshape(padded, (*lead, nb, block_size)), axis=-1) > 0


def open_block_keys(allowed, query_slots: np.ndarray, block_size: int):
    *lead, T, S = allowed.shape
    start = (np.asarray(query_slots) // block_size) * block_size  # (T,)
    keys_np = start[:, None] + np.arange(block_size)  # (T, bs)
    keys = ops.convert_to_tensor(keys_np.astype(np.int64))
    index = ops.convert_to_tensor(np.broadcast_to(np.clip(keys_np, 0, S - 1), (*lead, T, block_size)).astype(np.int64))
    seen = ops.logical_and(ops.take_along_axis(allowed, index, axis=-1), ops.convert_to_tensor(keys_np < S))
    is_open = ops.min(ops.cast(seen, "int32"), axis=-1, keepdims=True) == 0  # (B|1, 1, T, 1)
    valid = ops.logical_and(seen, is_open)
    order = ops.cast(bk.argsort_stable(ops.cast(ops.logical_not(valid), "int32"))[..., :block_size - 1], "int64")
    packed = ops.take_along_axis(ops.broadcast_to(keys, tuple(valid.shape)), order, axis=-1)
    return ops.where(ops.take_along_axis(valid, order, axis=-1), packed, ops.full_like(packed, -1))


def left_pack(keys, width: int):
    order = ops.cast(bk.argsort_stable(ops.cast(keys < 0, "int32"))[..., :width], "int64")
    return ops.take_along_axis(keys, order, axis=-1)


def project(x, kernel, bias):
    """F.project (PROJECT: x (B, L, D) times kernel (D, heads, width) flattened -> (B, L, F)); on TensorFlow,
    without a bias, as one 2-D product (B L, D) x (D, F), the same contraction: tf.einsum runs "BLD,DF->BLF" as a
    batched matmul that took 7.3-7.7 ms against 3.7 ms for a decode step's index query projection (one row, D
    2048, F 8192, float32, eager; 2-core AMD EPYC VM, 2026-11-30, loaded, process CPU time), and 25 against 22 ms
    for 64 rows."""
    if not TENSORFLOW or bias is not None or keras.backend.is_keras_tensor(x):
        return F.project(x, kernel, bias)
    D = kernel.shape[0]
    B, L = bk.shape(x)[0], bk.shape(x)[1]
    dt = F.dtype_name(x)
    ct = F.compute_dtype(dt)
    y = bk.matmul(bk.reshape(F._cast(x, ct), (-1, D)), bk.reshape(F._cast(kernel, ct), (D, -1)))  # (B L, F)
    return F._cast(bk.reshape(y, (B, L, -1)), dt)


# -- the call -----------------------------------------------------------------------------------------------

def _allowed(mask, B: int, T: int, S: int, is_causal: bool):
    allowed = ops.ones((1, 1, T, S), dtype="bool")
    if is_causal:
        allowed = causal_mask(T, S, "bottom_right")[None, None]
    if mask is not None:
        m = ops.cast(mask if ops.is_tensor(mask) else ops.convert_to_tensor(np.asarray(mask, dtype=bool)), "bool")
        shape = tuple(m.shape)
        if len(shape) not in (2, 3, 4) or shape[-2:] != (T, S) or (len(shape) == 4 and shape[1] != 1):
            raise ValueError(f"index mask must have shape (T, S), (B, T, S) or (B, 1, T, S) with T={T}, "
                             f"S={S} (every key, the cache's included): got {shape}")
        allowed = ops.logical_and(allowed, ops.reshape(m, (1, 1, T, S) if len(shape) == 2 else (shape[0], 1, T, S)))
    return allowed


def _rope_tables(rope, positions):
    return F.rope_tables_of(rope, positions)


def index_keys(config: AttentionConfig, tensors, key, key_positions, dtype, rec=lambda stage, value: value):
    ix = config.indexer
    k = rec("indexer.key.project", project(key, tensors["indexer.key.kernel"][:, None, :], None))  # (B, S, J)
    if ix.key_norm is not None:
        n = ix.key_norm
        k = rec("indexer.key.norm", F.norm(k, tensors.get("indexer.key.norm.scale"),
                                           tensors.get("indexer.key.norm.bias"), n.type, n.eps, 1, "head"))
    if ix.rope is not None:
        inv_freq, factor = _rope_tables(ix.rope, key_positions)
        k = index_rope(k[:, None], F.rope_angles(key_positions, inv_freq, dtype), ix.rope.rotary_dim,
                       ix.rope.interleaved, factor, ix.rope_end)[:, 0]
        k = rec("indexer.key.rope", k)
    if ix.block_pool == GATED:  # the gate logits travel with the key in the cache: (B, S, 2J)
        gates = rec("indexer.pool.gates", project(key, tensors["indexer.pool.gate.kernel"][:, None, :], None))
        k = ops.concatenate([k, gates], axis=-1)
    return k  # (B, S, J), or (B, S, 2J) with block_pool gated


def index_queries(config: AttentionConfig, tensors, query, positions, dtype, rec=lambda stage, value: value):
    ix = config.indexer
    source = query
    if ix.query_source == "latent":
        L = config.latent
        source = F.project(query, tensors["query.down.kernel"], tensors.get("query.down.bias"))  # (B, T, Qr)
        source = rec("indexer.query.latent", F.norm(source, tensors["query.down.norm.scale"], None, "rms", L.eps,
                                                    1, "head"))
    q = rec("indexer.query.project", project(source, tensors["indexer.query.kernel"], None))  # (B, T, I*J)
    if ix.query_norm is not None:
        n = ix.query_norm
        q = rec("indexer.query.norm", F.norm(q, tensors.get("indexer.query.norm.scale"),
                                             tensors.get("indexer.query.norm.bias"), n.type, n.eps, ix.heads, "head"))
    q = F.split_heads(q, ix.heads)  # (B, I, T, J)
    if ix.rope is not None:
        inv_freq, factor = _rope_tables(ix.rope, positions)
        q = rec("indexer.query.rope", index_rope(q, F.rope_angles(positions, inv_freq, dtype), ix.rope.rotary_dim,
                                                 ix.rope.interleaved, factor, ix.rope_end))
    return q  # (B, I, T, J)


def _unrecorded(stage: str, value):
    return value


def _prelude(config: AttentionConfig, tensors, query, key, positions, key_positions, dt: str, rec):
    """The index queries (B, I, T, J), the new index keys (B, S, J|2J) and the head weights (B, T, I) (None without
    them, or with block_pool gated, whose selection takes its own)."""
    ix = config.indexer
    q = index_queries(config, tensors, query, positions, dt, rec)  # (B, I, T, J)
    k_new = index_keys(config, tensors, key, key_positions, dt, rec)  # (B, S, J)
    weights = None
    if ix.head_weights and ix.block_pool != GATED:
        ct = F.compute_dtype(dt)
        w = project(query, tensors["indexer.weights.kernel"][:, :, None], None)  # (B, T, I)
        weights = rec("indexer.weights", F._cast(F._cast(w, ct) * bk.constant(ix.effective_weight_scale, ct), dt))
    return q, k_new, weights


# A decode step's prelude (the index query, key and weights of one new token: shapes that do not grow with the
# cache) runs as one TensorFlow graph (tf.function, not XLA) from DECODE_SCORES_MIN_KEYS keys on, traced once per
# config, dtype and shapes: its small ops (RoPE, the norm, casts) and projections cost 8.0 ms eagerly against 4.1
# ms as a graph (DeepSeek V3.2's sizes, float32; 2-core AMD EPYC VM, 2026-11-30, loaded, process CPU time).
# Compiled by XLA it took 120 ms (its matrix-vector products). Not where the stages are recorded (rec), nor traced, nor for the grid's small calls.
@functools.lru_cache(maxsize=32)
def _decode_prelude(config: AttentionConfig, dt: str):
    def prelude(tensors, query, key, positions, key_positions):
        return _prelude(config, tensors, query, key, positions, key_positions, dt, _unrecorded)

    return tf.function(prelude, autograph=False)


def lightning_indexer(config: AttentionConfig, tensors: dict, query, key=None, *, positions=None,
                      key_positions=None, past_index_keys=None, mask=None, is_causal: bool = True,
                      dtype: str | None = None, precision: str | None = None, fp8_scale_format: str = "float",
                      return_scores: bool = False, cache_length: int | None = None,
                      rec=_unrecorded) -> dict:
    """impl_numpy.indexer.lightning_indexer in keras.ops: NumPy arrays or tensors of the backend in (traced
    ones included), tensors of the backend out. cache_length (Keras's TensorFlow backend alone): an
    in-place index cache, as the attention call's: past_index_keys a tf.Variable (B, C, J|2J) of the storage dtype
    whose first cache_length = P rows are the cache; the new index keys are written at P..P+S-1 by XLA in the
    variable's own buffer (tf_only.write_rows) and scored over its first P+S rows without a join (where P+S is C,
    the variable's value itself, no copy); present_index_keys is the variable, whole."""
    ix = config.indexer
    if ix is None:
        raise ValueError("config.indexer is null: this layer has no indexer")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(map(str, PRECISIONS))}: got {precision!r}")
    if fp8_scale_format not in FP8_SCALE_FORMATS:
        raise ValueError(f"fp8_scale_format must be one of {', '.join(FP8_SCALE_FORMATS)}: got {fp8_scale_format!r}")
    J = ix.head_dim
    if precision is not None and ix.block_pool == GATED:
        raise ValueError("precision fp8_e4m3 needs indexer.block_pool max (DeepSeek's fp8 scoring is of token keys; "
                         "glm5_next scores its pooled keys in float32): got block_pool gated")
    if precision is not None:
        _fp8()
        if J & (J - 1) or J > FP8_BLOCK:
            raise ValueError(f"precision fp8_e4m3 needs indexer.head_dim a power of two <= {FP8_BLOCK} (DeepSeek's "
                             f"Hadamard transform and one quantisation block per head): got head_dim={J}")
    dt = check_dtype(dtype_from_name(dtype or F.dtype_name(query)).name)

    def tensor(x):  # a tensor of the backend in dtype dt; NumPy arrays (bfloat16 included) through float64
        if ops.is_tensor(x):
            return F._cast(x, dt)
        return ops.cast(ops.convert_to_tensor(np.asarray(x, dtype=np.float64)), dt)

    query = tensor(query)
    key = query if key is None else tensor(key)
    B, T, S = query.shape[0], query.shape[1], key.shape[1]
    P = 0
    buffer = None
    if cache_length is not None:
        buffer = _index_cache_buffer(past_index_keys, cache_length, S, dt)
        past_index_keys = None
        if buffer.shape[0] != B or buffer.shape[2] != ix.cache_width:
            raise ValueError(f"past_index_keys must have shape (B, C, {'2J' if ix.block_pool == GATED else 'J'}) = "
                             f"({B}, C, {ix.cache_width}) with cache_length: got {tuple(buffer.shape)}")
        P = int(cache_length)
    if past_index_keys is not None:
        past_index_keys = tensor(past_index_keys)
        if (len(past_index_keys.shape) != 3 or past_index_keys.shape[0] != B
                or past_index_keys.shape[2] != ix.cache_width):
            raise ValueError(f"past_index_keys must have shape (B, P, {'2J' if ix.block_pool == GATED else 'J'}) = "
                             f"({B}, P, {ix.cache_width}): got {tuple(past_index_keys.shape)}")
        P = past_index_keys.shape[1]
    tensors = {name: tensor(t) for name, t in tensors.items() if name.startswith(READS)}
    positions = F.default_positions(positions, P, T)  # (B|1, T)
    key_positions = F.default_positions(key_positions, P, S)  # (B|1, S)

    if TENSORFLOW and rec is _unrecorded and T == S == 1 and P + S >= DECODE_SCORES_MIN_KEYS \
            and not bk.is_symbolic(query):
        q, k_new, weights = _decode_prelude(config, dt)(tensors, query, key, positions, key_positions)
    else:
        q, k_new, weights = _prelude(config, tensors, query, key, positions, key_positions, dt, rec)
    if buffer is not None:  # in place: the new rows written, the first P+S rows read (no join)
        from .tf_only import write_rows

        write_rows(buffer, F._cast(k_new, dt), P, 1)
        k = buffer.value() if buffer.shape[1] == P + S else buffer[:, :P + S]  # (B, P+S, J|2J)
    else:
        k = k_new if past_index_keys is None else ops.concatenate([past_index_keys, k_new], axis=1)  # (B, P+S, J|2J)
    present = k if buffer is None else buffer  # the returned index cache: with cache_length the buffer, whole
    if ix.block_pool == GATED:
        result = _gated_selection(config, tensors, query, q, k, B, T, P + S, mask, is_causal, return_scores, rec)
        result["present_index_keys"] = present
        return result
    qs, ks = q, k
    if precision == "fp8_e4m3":
        qs, q_scale = quantize_fp8(hadamard(q), J, fp8_scale_format)
        ks, k_scale = quantize_fp8(hadamard(k), J, fp8_scale_format)
        qs = rec("indexer.query.fp8", qs * ops.repeat(q_scale, J, axis=-1))
        ks = rec("indexer.key.fp8", ks * ops.repeat(k_scale, J, axis=-1))
    x = rec("indexer.scores", scores(qs, ks, weights, ix.effective_score_scale, ix.relu, ix.per_kv_head))
    # every key visible (no mask; one query, or not causal): the mask would leave x as it is (1.5 ms of a decode
    # step's 65537 keys, eagerly, for the mask and the select)
    allowed = None if mask is None and (T == 1 or not is_causal) else _allowed(mask, B, T, P + S, is_causal)
    x = rec("indexer.masked_scores", x if allowed is None else mask_scores(x, allowed))  # (B|1, 1, T, P+S)
    result = {"present_index_keys": present}
    if return_scores:
        result["index_scores"] = x
    if ix.block_size is None:
        selection = select_topk(x, ix.topk)  # (B, G, T, k')
    else:
        bx = block_scores(x, ix.block_size)
        if ix.local_blocks:
            bx = keep_local_blocks(bx, np.arange(T) + P + S - T, ix.block_size, ix.local_blocks)
        blocks = rec("indexer.blocks", select_topk(bx, ix.topk))  # (B, G, T, kb')
        result["topk_blocks"] = blocks
        if return_scores:
            result["block_scores"] = bx
        if allowed is None:
            allowed = _allowed(mask, B, T, P + S, is_causal)
        selection = expand_blocks(blocks, ix.block_size, allowed, P + S)
    result["topk_indices"] = rec("indexer.selection", selection if ix.per_kv_head else selection[:, 0])
    return result


def _index_cache_buffer(buffer, cache_length, S: int, dt: str):
    """lightning_indexer's in-place index cache, checked as impl_numpy.indexer._index_cache_buffer: a tf.Variable of
    the storage dtype (a tensor cannot be written; a cast would write a copy the caller never sees), (B, C, J|2J)
    with room for the call's S keys after its first cache_length rows."""
    if not TENSORFLOW:
        raise ValueError(f"cache_length needs Keras's TensorFlow backend (an in-place index cache is a tf.Variable "
                         f"written by XLA; keras runs on {BACKEND}): got cache_length={cache_length!r}")
    if buffer is None:
        raise ValueError("cache_length needs past_index_keys, the index cache's buffer: got past_index_keys None")
    if not isinstance(buffer, tf.Variable) or F.dtype_name(buffer) != dt:
        raise ValueError(f"cache_length needs past_index_keys a tf.Variable of the storage dtype {dt}: got "
                         f"{type(buffer).__name__} {F.dtype_name(buffer) if hasattr(buffer, 'dtype') else ''}".rstrip())
    shape = tuple(buffer.shape)
    if isinstance(cache_length, bool) or not isinstance(cache_length, (int, np.integer)) or len(shape) != 3 \
            or not 0 <= cache_length <= shape[1] - S:
        raise ValueError(f"cache_length must be an int in 0..C-S = 0..{shape[1] - S if len(shape) == 3 else '?'} "
                         f"(the buffer's rows less the call's {S} keys): got {cache_length!r} with past_index_keys "
                         f"{shape}")
    return buffer


def _gated_selection(config: AttentionConfig, tensors, query, q, cache, B: int, T: int, S: int, mask,
                     is_causal: bool, return_scores: bool, rec) -> dict:
    """impl_numpy.indexer._gated_selection in keras.ops."""
    ix = config.indexer
    J, bs = ix.head_dim, ix.block_size
    k, gates = cache[..., :J], cache[..., J:]
    pooled = rec("indexer.pool.keys", pooled_keys(k, gates, tensors["indexer.pool.position"], bs))  # (B, nb, J)
    weights = None
    if ix.head_weights:
        dt = F.dtype_name(query)
        ct = F.compute_dtype(dt)
        w = project(query, tensors["indexer.weights.kernel"][:, :, None], None)  # (B, T, I)
        weights = rec("indexer.weights", F._cast(F._cast(w, ct) * bk.constant(ix.effective_weight_scale, ct), dt))
    x = rec("indexer.scores", scores(q, pooled, weights, ix.effective_score_scale, ix.relu, ix.per_kv_head))
    allowed = _allowed(mask, B, T, S, is_causal)  # (B|1, 1, T, S)
    x = rec("indexer.masked_scores", mask_scores(x, complete_blocks(allowed, bs)))  # (B, G, T, nb)
    result = {"present_index_keys": cache}
    if return_scores:
        result.update(index_scores=x, block_scores=x)
    blocks = rec("indexer.blocks", select_topk(x, ix.topk))  # (B, G, T, kb')
    result["topk_blocks"] = blocks
    selection = expand_blocks(blocks, bs, allowed, S)  # (B, G, T, min(kb' * bs, S))
    if ix.open_block:
        tail = open_block_keys(allowed, np.arange(T) + S - T, bs)  # (B|1, 1, T, bs - 1)
        tail = ops.broadcast_to(tail, (*tuple(selection.shape[:-1]), bs - 1))
        width = min(selection.shape[-1] + bs - 1, S)
        selection = left_pack(ops.concatenate([selection, tail], axis=-1), width)
    result["topk_indices"] = rec("indexer.selection", selection if ix.per_kv_head else selection[:, 0])
    return result
