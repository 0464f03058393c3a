"""The lightning indexer in TensorFlow: mirrors impl_numpy/indexer.py (same stages, same names, same einsum
strings; tf and keras.ops calls through impl_tf.functional's stages). Shape letters as there: I index heads,
J index head_dim, G selection groups.

Runs eagerly. The fp8 simulation rounds through tf.dtypes.experimental.float8_e4m3fn (round to nearest even,
as ml_dtypes); the top-k is a stable argsort of the negated scores (tf.math.top_k's order among equal
scores is not the contract's).
"""

from __future__ import annotations

import math

import numpy as np

from weights import AttentionConfig, dtype_from_name
from weights.rope import rope_tables

from . import functional as F
from ._keras import tf
from .masks import causal_mask

FP8_MAX = 448.0
FP8_AMAX_FLOOR = 1e-4
FP8_BLOCK = 128
PRECISIONS = (None, "fp8_e4m3")
# The layer's tensors the indexer reads: its own, and the query latent's (query_source "latent").
READS = ("indexer.", "query.down.")
FP8_SCALE_FORMATS = ("float", "ue8m0")


def _float8():
    """TensorFlow's float8 e4m3 type, or a ValueError saying why the simulation cannot run."""
    fp8 = getattr(tf.dtypes.experimental, "float8_e4m3fn", None)
    if fp8 is None:
        raise ValueError(f"precision fp8_e4m3 needs tf.dtypes.experimental.float8_e4m3fn, which TensorFlow "
                         f"{tf.__version__} lacks")
    return fp8


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
    return tf.cast(tf.matmul(tf.cast(x, ct), tf.constant((h / math.sqrt(J)).astype(ct))), x.dtype)


def quantize_fp8(x, block: int, scale_format: str):
    fp8 = _float8()
    shape = list(x.shape)
    xb = tf.reshape(tf.cast(x, tf.float64), [*shape[:-1], shape[-1] // block, block])  # (..., nblk, block)
    amax = tf.cast(tf.maximum(tf.reduce_max(tf.abs(xb), axis=-1, keepdims=True), FP8_AMAX_FLOOR), tf.float32)
    scale = amax * tf.constant(1 / FP8_MAX, tf.float32)  # float32, times the reciprocal
    if scale_format == "ue8m0":  # 2^ceil(log2 scale), exactly: the float32 exponent, plus one unless a power of two
        bits = tf.bitcast(scale, tf.int32)
        exponent = tf.bitwise.right_shift(bits, 23) - 127 + tf.cast(tf.bitwise.bitwise_and(bits, (1 << 23) - 1) != 0,
                                                                    tf.int32)
        scale = tf.bitcast(tf.bitwise.left_shift(exponent + 127, 23), tf.float32)
    scale = tf.cast(scale, tf.float64)
    q = tf.cast(tf.cast(tf.clip_by_value(xb / scale, -FP8_MAX, FP8_MAX), fp8), tf.float64)
    return tf.reshape(q, shape), scale[..., 0]


def scores(q, k, weights, score_scale: float, relu: bool, per_kv_head: bool):
    ct = F.compute_dtype(q.dtype)
    dots = tf.einsum("BITJ,BSJ->BITS", tf.cast(q, ct), tf.cast(k, ct)) * tf.constant(score_scale, ct)  # (B, I, T, S)
    if relu:
        dots = tf.maximum(dots, tf.zeros((), ct))
    if per_kv_head:
        return dots
    if weights is None:
        return tf.reduce_sum(dots, axis=1, keepdims=True)  # (B, 1, T, S)
    return tf.einsum("BTI,BITS->BTS", tf.cast(weights, ct), dots)[:, None]  # (B, 1, T, S)


def mask_scores(x, allowed):
    return tf.where(allowed, x, tf.constant(-math.inf, x.dtype))


def block_scores(x, block_size: int):
    B, G, T, S = x.shape
    nb = -(-S // block_size)
    padded = tf.pad(x, [[0, 0], [0, 0], [0, 0], [0, nb * block_size - S]], constant_values=-math.inf)
    return tf.reduce_max(tf.reshape(padded, [B, G, T, nb, block_size]), axis=-1)  # (B, G, T, nb)


def keep_local_blocks(x, query_slots: np.ndarray, block_size: int, local_blocks: int):
    own = np.asarray(query_slots) // block_size  # (T,)
    local = np.zeros(x.shape[-2:], dtype=bool)  # (T, nb)
    for back in range(local_blocks):
        b = own - back
        ok = b >= 0
        local[np.arange(len(own))[ok], b[ok]] = True
    return tf.where(tf.constant(local) & (x > -math.inf), tf.constant(math.inf, x.dtype), x)


def select_topk(x, k: int):
    width = min(k, x.shape[-1])
    order = tf.argsort(-x, axis=-1, stable=True)[..., :width]  # stable: ties keep ascending index
    chosen = tf.gather(x, order, batch_dims=len(x.shape) - 1)
    return tf.where(chosen > -math.inf, tf.cast(order, tf.int64), tf.constant(-1, tf.int64))


def expand_blocks(blocks, block_size: int, allowed, S: int):
    B, G, T, kb = blocks.shape
    keys = tf.reshape(blocks[..., None] * block_size + tf.range(block_size, dtype=blocks.dtype), [B, G, T, -1])
    valid = tf.reshape(tf.broadcast_to(blocks[..., None] >= 0, [B, G, T, kb, block_size]), keys.shape) & (keys < S)
    seen = tf.broadcast_to(allowed, [B, G, T, S])
    valid = valid & tf.gather(seen, tf.clip_by_value(keys, 0, S - 1), batch_dims=3)
    order = tf.argsort(tf.cast(~valid, tf.int32), axis=-1, stable=True)[..., :min(kb * block_size, S)]
    packed = tf.gather(keys, order, batch_dims=3)
    return tf.where(tf.gather(valid, order, batch_dims=3), packed, tf.constant(-1, keys.dtype))


# -- the call -----------------------------------------------------------------------------------------------

def _allowed(mask, B: int, T: int, S: int, is_causal: bool):
    allowed = tf.ones((1, 1, T, S), dtype=tf.bool)
    if is_causal:
        allowed = causal_mask(T, S, "bottom_right")[None, None]
    if mask is not None:
        m = np.asarray(mask, dtype=bool)
        if m.ndim not in (2, 3, 4) or m.shape[-2:] != (T, S) or (m.ndim == 4 and m.shape[1] != 1):
            raise ValueError(f"index mask must have shape (T, S), (B, T, S) or (B, 1, T, S) with T={T}, "
                             f"S={S} (every key, the cache's included): got {m.shape}")
        allowed = allowed & tf.constant(m.reshape((1, 1, T, S) if m.ndim == 2 else (m.shape[0], 1, T, S)))
    return allowed


def index_keys(config: AttentionConfig, tensors, key, key_positions, dtype, rec=lambda stage, value: value):
    ix = config.indexer
    k = rec("indexer.key.project", F.project(key, tensors["indexer.key.kernel"][:, None, :], None))  # (B, S, J)
    if ix.key_norm is not None:
        n = ix.key_norm
        k = rec("indexer.key.norm", F.norm(k, tensors.get("indexer.key.norm.scale"),
                                           tensors.get("indexer.key.norm.bias"), n.type, n.eps, 1, "head"))
    if ix.rope is not None:
        inv_freq, factor = rope_tables(ix.rope, int(np.max(key_positions)) if key_positions.size else None)
        k = index_rope(k[:, None], F.rope_angles(tf.constant(key_positions), inv_freq, dtype), ix.rope.rotary_dim,
                       ix.rope.interleaved, factor, ix.rope_end)[:, 0]
        k = rec("indexer.key.rope", k)
    return k  # (B, S, J)


def index_queries(config: AttentionConfig, tensors, query, positions, dtype, rec=lambda stage, value: value):
    ix = config.indexer
    source = query
    if ix.query_source == "latent":
        L = config.latent
        source = F.project(query, tensors["query.down.kernel"], tensors.get("query.down.bias"))  # (B, T, Qr)
        source = rec("indexer.query.latent", F.norm(source, tensors["query.down.norm.scale"], None, "rms", L.eps,
                                                    1, "head"))
    q = rec("indexer.query.project", F.project(source, tensors["indexer.query.kernel"], None))  # (B, T, I*J)
    if ix.query_norm is not None:
        n = ix.query_norm
        q = rec("indexer.query.norm", F.norm(q, tensors.get("indexer.query.norm.scale"),
                                             tensors.get("indexer.query.norm.bias"), n.type, n.eps, ix.heads, "head"))
    q = F.split_heads(q, ix.heads)  # (B, I, T, J)
    if ix.rope is not None:
        inv_freq, factor = rope_tables(ix.rope, int(np.max(positions)) if positions.size else None)
        q = rec("indexer.query.rope", index_rope(q, F.rope_angles(tf.constant(positions), inv_freq, dtype),
                                                 ix.rope.rotary_dim, ix.rope.interleaved, factor, ix.rope_end))
    return q  # (B, I, T, J)


def lightning_indexer(config: AttentionConfig, tensors: dict, query, key=None, *, positions=None,
                      key_positions=None, past_index_keys=None, mask=None, is_causal: bool = True,
                      dtype: str | None = None, precision: str | None = None, fp8_scale_format: str = "float",
                      return_scores: bool = False, rec=lambda stage, value: value) -> dict:
    """impl_numpy.indexer.lightning_indexer in TensorFlow: NumPy arrays in, tf tensors out."""
    ix = config.indexer
    if ix is None:
        raise ValueError("config.indexer is null: this layer has no indexer")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(map(str, PRECISIONS))}: got {precision!r}")
    if fp8_scale_format not in FP8_SCALE_FORMATS:
        raise ValueError(f"fp8_scale_format must be one of {', '.join(FP8_SCALE_FORMATS)}: got {fp8_scale_format!r}")
    J = ix.head_dim
    if precision is not None:
        _float8()
        if J & (J - 1) or J > FP8_BLOCK:
            raise ValueError(f"precision fp8_e4m3 needs indexer.head_dim a power of two <= {FP8_BLOCK} (DeepSeek's "
                             f"Hadamard transform and one quantisation block per head): got head_dim={J}")
    query = np.asarray(query)
    dt = dtype_from_name(dtype or query.dtype.name).name

    def tensor(x):
        return tf.cast(tf.constant(np.asarray(x, dtype=np.float64)), dt)

    query = tensor(query)
    key = query if key is None else tensor(key)
    B, T, S = query.shape[0], query.shape[1], key.shape[1]
    P = 0
    if past_index_keys is not None:
        past_index_keys = tensor(past_index_keys)
        if len(past_index_keys.shape) != 3 or past_index_keys.shape[0] != B or past_index_keys.shape[2] != J:
            raise ValueError(f"past_index_keys must have shape (B, P, J) = ({B}, P, {J}): "
                             f"got {tuple(past_index_keys.shape)}")
        P = past_index_keys.shape[1]
    tensors = {name: tensor(t) for name, t in tensors.items() if name.startswith(READS)}
    positions = np.asarray(F.default_positions(positions, P, T))
    key_positions = np.asarray(F.default_positions(key_positions, P, S))

    q = index_queries(config, tensors, query, positions, dt, rec)  # (B, I, T, J)
    k_new = index_keys(config, tensors, key, key_positions, dt, rec)  # (B, S, J)
    k = k_new if past_index_keys is None else tf.concat([past_index_keys, k_new], axis=1)  # (B, P+S, J)
    weights = None
    if ix.head_weights:
        ct = F.compute_dtype(dt)
        w = F.project(query, tensors["indexer.weights.kernel"][:, :, None], None)  # (B, T, I)
        weights = rec("indexer.weights", tf.cast(tf.cast(w, ct) * tf.constant(ix.effective_weight_scale, ct), dt))
    qs, ks = q, k
    if precision == "fp8_e4m3":
        qs, q_scale = quantize_fp8(hadamard(q), J, fp8_scale_format)
        ks, k_scale = quantize_fp8(hadamard(k), J, fp8_scale_format)
        qs = rec("indexer.query.fp8", qs * tf.repeat(q_scale, J, axis=-1))
        ks = rec("indexer.key.fp8", ks * tf.repeat(k_scale, J, axis=-1))
    x = rec("indexer.scores", scores(qs, ks, weights, ix.effective_score_scale, ix.relu, ix.per_kv_head))
    allowed = _allowed(mask, B, T, P + S, is_causal)  # (B|1, 1, T, P+S)
    x = rec("indexer.masked_scores", mask_scores(x, allowed))
    result = {"present_index_keys": k}
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
        selection = expand_blocks(blocks, ix.block_size, allowed, P + S)
    result["topk_indices"] = rec("indexer.selection", selection if ix.per_kv_head else selection[:, 0])
    return result
