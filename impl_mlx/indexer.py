"""The lightning indexer in MLX: mirrors impl_numpy/indexer.py (same stages, same names, same einsum strings;
mlx.core ops only). Shape letters as there: I index heads, J index head_dim, G selection groups.

Runs eagerly, as the rest of impl_mlx. The fp8 simulation (precision "fp8_e4m3": DeepSeek's Hadamard
transform, then float8 e4m3 blocks) is refused: MLX 0.32 has no float8 type to round through (_float8 says
so), so hadamard and quantize_fp8 are not ported. The top-k is mx.argsort of the negated scores: its order
is stable (equal scores keep ascending key index, the contract's tie rule), as its docstring states from
MLX 0.32 (std::stable_sort on the CPU, a merge sort on Metal: ml-explore/mlx issue 2057).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from weights import AttentionConfig, dtype_from_name
from weights.rope import rope_tables

from . import functional as F
from .convert import ct as compute_of
from .convert import np_dtype, scalar, to_mx, to_mx_dtype
from .masks import causal_mask

PRECISIONS = (None, "fp8_e4m3")
GATED = "gated"  # Indexer.block_pool of GLM-5.3-Flash's k-pool
# The layer's tensors the indexer reads: its own, and the query latent's (query_source "latent").
READS = ("indexer.", "query.down.")
FP8_SCALE_FORMATS = ("float", "ue8m0")


def _float8():
    """MLX's float8 e4m3 type, or a ValueError saying why the simulation cannot run (MLX 0.32 has none)."""
    fp8 = getattr(mx, "float8_e4m3fn", None)
    if fp8 is None:
        raise ValueError(f"precision fp8_e4m3 needs a float8 e4m3 type (mx.float8_e4m3fn), which MLX "
                         f"{mx.__version__} lacks")
    return fp8


# -- stages -----------------------------------------------------------------------------------------------

def index_rope(x, angles, rotary_dim: int, interleaved: bool, attention_factor: float, end: str):
    if end == "first":
        return F.rope(x, angles, rotary_dim, interleaved, attention_factor)
    return F.rope_last(x, angles, rotary_dim, interleaved, attention_factor)


def scores(q, k, weights, score_scale: float, relu: bool, per_kv_head: bool):
    c = compute_of(q.dtype)
    dots = mx.einsum("bitj,bsj->bits", q.astype(c), k.astype(c)) * scalar(score_scale, c)  # (B, I, T, S)
    if relu:
        dots = mx.maximum(dots, scalar(0, c))
    if per_kv_head:
        return dots
    if weights is None:
        return dots.sum(axis=1, keepdims=True)  # (B, 1, T, S)
    return mx.einsum("bti,bits->bts", weights.astype(c), dots)[:, None]  # (B, 1, T, S)


def mask_scores(x, allowed):
    return mx.where(allowed, x, scalar(-np.inf, x.dtype))


def block_scores(x, block_size: int):
    B, G, T, S = x.shape
    nb = -(-S // block_size)
    padded = mx.pad(x, [(0, 0), (0, 0), (0, 0), (0, nb * block_size - S)], constant_values=-np.inf)
    return padded.reshape(B, G, T, nb, block_size).max(axis=-1)  # (B, G, T, nb)


def keep_local_blocks(x, query_slots: np.ndarray, block_size: int, local_blocks: int):
    own = np.asarray(query_slots) // block_size  # (T,)
    local = np.zeros(x.shape[-2:], dtype=bool)  # (T, nb)
    for back in range(local_blocks):
        b = own - back
        ok = b >= 0
        local[np.arange(len(own))[ok], b[ok]] = True
    return mx.where(mx.array(local) & (x > -np.inf), scalar(np.inf, x.dtype), x)


def select_topk(x, k: int):
    width = min(k, x.shape[-1])
    order = mx.argsort(-x, axis=-1)[..., :width]  # stable: ties keep ascending index
    chosen = mx.take_along_axis(x, order, axis=-1)
    return mx.where(chosen > -np.inf, order.astype(mx.int64), -1)


def expand_blocks(blocks, block_size: int, allowed, S: int):
    B, G, T, kb = blocks.shape
    keys = (blocks[..., None] * block_size + mx.arange(block_size, dtype=mx.int64)).reshape(B, G, T, kb * block_size)
    valid = mx.broadcast_to(blocks[..., None] >= 0, (B, G, T, kb, block_size)).reshape(keys.shape) & (keys < S)
    seen = mx.broadcast_to(allowed, (B, G, T, S))
    valid = valid & mx.take_along_axis(seen, mx.clip(keys, 0, S - 1), axis=-1)
    order = mx.argsort((~valid).astype(mx.int32), axis=-1)[..., :min(kb * block_size, S)]  # stable
    packed = mx.take_along_axis(keys, order, axis=-1)
    return mx.where(mx.take_along_axis(valid, order, axis=-1), packed, -1)


def pooled_keys(k, gates, position, block_size: int):
    B, S, J = k.shape
    c = compute_of(k.dtype)
    nb = -(-S // block_size)
    pad = [(0, 0), (0, nb * block_size - S), (0, 0)]
    logits = mx.pad(gates.astype(c), pad, constant_values=-np.inf)  # (B, nb * bs, J)
    logits = logits.reshape(B, nb, block_size, J) + position.astype(c)  # (B, nb, bs, J)
    p = mx.exp(logits - logits.max(axis=2, keepdims=True))
    p = p / p.sum(axis=2, keepdims=True)  # (B, nb, bs, J): the gate over each block's slots, per feature
    padded = mx.pad(k.astype(c), pad)
    return mx.einsum("bnsj,bnsj->bnj", p, padded.reshape(B, nb, block_size, J))  # (B, nb, J)


def complete_blocks(allowed, block_size: int):
    *lead, S = allowed.shape
    nb = -(-S // block_size)
    padded = mx.pad(allowed.astype(mx.int32), [(0, 0)] * len(lead) + [(0, nb * block_size - S)])
    return padded.reshape(*lead, nb, block_size).min(axis=-1) > 0


def open_block_keys(allowed, query_slots: np.ndarray, block_size: int):
    *lead, T, S = allowed.shape
    start = (np.asarray(query_slots) // block_size) * block_size  # (T,)
    keys = mx.array(start[:, None] + np.arange(block_size), dtype=mx.int64)  # (T, bs)
    seen = mx.take_along_axis(allowed, mx.broadcast_to(mx.clip(keys, 0, S - 1), (*lead, T, block_size)),
                              axis=-1) & (keys < S)
    is_open = seen.astype(mx.int32).min(axis=-1, keepdims=True) == 0  # (B|1, 1, T, 1)
    valid = seen & is_open
    order = mx.argsort((~valid).astype(mx.int32), axis=-1)[..., :block_size - 1]  # stable: visible first, in order
    packed = mx.take_along_axis(mx.broadcast_to(keys, valid.shape), order, axis=-1)
    return mx.where(mx.take_along_axis(valid, order, axis=-1), packed, -1)


def left_pack(keys, width: int):
    order = mx.argsort((keys < 0).astype(mx.int32), axis=-1)[..., :width]  # stable
    return mx.take_along_axis(keys, order, axis=-1)


# -- the call -----------------------------------------------------------------------------------------------

def _allowed(mask, B: int, T: int, S: int, is_causal: bool):
    allowed = mx.ones((1, 1, T, S), dtype=mx.bool_)
    if is_causal:
        allowed = causal_mask(T, S, "bottom_right")[None, None]
    if mask is not None:
        m = to_mx(mask).astype(mx.bool_)
        if m.ndim not in (2, 3, 4) or tuple(m.shape[-2:]) != (T, S) or (m.ndim == 4 and m.shape[1] != 1):
            raise ValueError(f"index mask must have shape (T, S), (B, T, S) or (B, 1, T, S) with T={T}, "
                             f"S={S} (every key, the cache's included): got {tuple(m.shape)}")
        allowed = allowed & (m.reshape((1, 1, T, S) if m.ndim == 2 else (m.shape[0], 1, T, S)))
    return allowed


def _largest(positions) -> int | None:
    """The largest position (longrope's choice of table), or None where there is none."""
    return None if positions.size == 0 else int(positions.max().item())


def index_keys(config: AttentionConfig, tensors, key, key_positions, dtype, rec=lambda stage, value: value):
    ix = config.indexer
    k = rec("indexer.key.project", F.project(key, tensors["indexer.key.kernel"][:, None, :], None))  # (B, S, J)
    if ix.key_norm is not None:
        n = ix.key_norm
        k = rec("indexer.key.norm", F.norm(k, tensors.get("indexer.key.norm.scale"),
                                           tensors.get("indexer.key.norm.bias"), n.type, n.eps, 1, "head"))
    if ix.rope is not None:
        inv_freq, factor = rope_tables(ix.rope, _largest(key_positions))
        k = index_rope(k[:, None], F.rope_angles(key_positions, inv_freq, dtype), ix.rope.rotary_dim,
                       ix.rope.interleaved, factor, ix.rope_end)[:, 0]
        k = rec("indexer.key.rope", k)
    if ix.block_pool == GATED:  # the gate logits travel with the key in the cache: (B, S, 2J)
        gates = rec("indexer.pool.gates", F.project(key, tensors["indexer.pool.gate.kernel"][:, None, :], None))
        k = mx.concatenate([k, gates], axis=-1)
    return k  # (B, S, J), or (B, S, 2J) with block_pool gated


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
        inv_freq, factor = rope_tables(ix.rope, _largest(positions))
        q = rec("indexer.query.rope", index_rope(q, F.rope_angles(positions, inv_freq, dtype), ix.rope.rotary_dim,
                                                 ix.rope.interleaved, factor, ix.rope_end))
    return q  # (B, I, T, J)


def lightning_indexer(config: AttentionConfig, tensors: dict, query, key=None, *, positions=None,
                      key_positions=None, past_index_keys=None, mask=None, is_causal: bool = True,
                      dtype: str | None = None, precision: str | None = None, fp8_scale_format: str = "float",
                      return_scores: bool = False, rec=lambda stage, value: value) -> dict:
    """impl_numpy.indexer.lightning_indexer in MLX: NumPy arrays or mx.arrays in, mx.arrays out."""
    ix = config.indexer
    if ix is None:
        raise ValueError("config.indexer is null: this layer has no indexer")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(map(str, PRECISIONS))}: got {precision!r}")
    if fp8_scale_format not in FP8_SCALE_FORMATS:
        raise ValueError(f"fp8_scale_format must be one of {', '.join(FP8_SCALE_FORMATS)}: got {fp8_scale_format!r}")
    if precision is not None and ix.block_pool == GATED:
        raise ValueError("precision fp8_e4m3 needs indexer.block_pool max (DeepSeek's fp8 scoring is of token keys; "
                         "glm5_next scores its pooled keys in float32): got block_pool gated")
    if precision is not None:
        _float8()
    query = query if isinstance(query, mx.array) else np.asarray(query)
    if dtype is None:
        dtype = np_dtype(query.dtype).name if isinstance(query, mx.array) else np.dtype(query.dtype).name
    dt = dtype_from_name(dtype)
    mdt = to_mx_dtype(dt)
    query = to_mx(query, dt)
    key = query if key is None else to_mx(key, dt)
    B, T, S = query.shape[0], query.shape[1], key.shape[1]
    P = 0
    if past_index_keys is not None:
        past_index_keys = to_mx(past_index_keys, dt)
        if past_index_keys.ndim != 3 or past_index_keys.shape[0] != B or past_index_keys.shape[2] != ix.cache_width:
            raise ValueError(f"past_index_keys must have shape (B, P, {'2J' if ix.block_pool == GATED else 'J'}) = "
                             f"({B}, P, {ix.cache_width}): got {tuple(past_index_keys.shape)}")
        P = past_index_keys.shape[1]
    tensors = {name: to_mx(t, dt) for name, t in tensors.items() if name.startswith(READS)}
    positions = F.default_positions(None if positions is None else to_mx(positions), P, T)
    key_positions = F.default_positions(None if key_positions is None else to_mx(key_positions), P, S)

    q = index_queries(config, tensors, query, positions, mdt, rec)  # (B, I, T, J)
    k_new = index_keys(config, tensors, key, key_positions, mdt, rec)  # (B, S, J)
    k = k_new if past_index_keys is None else mx.concatenate([past_index_keys, k_new], axis=1)  # (B, P+S, J|2J)
    if ix.block_pool == GATED:
        return _gated_selection(config, tensors, query, q, k, B, T, P + S, mask, is_causal, return_scores, rec)
    weights = None
    if ix.head_weights:
        c = compute_of(mdt)
        w = F.project(query, tensors["indexer.weights.kernel"][:, :, None], None)  # (B, T, I)
        weights = rec("indexer.weights", (w.astype(c) * scalar(ix.effective_weight_scale, c)).astype(mdt))
    x = rec("indexer.scores", scores(q, k, weights, ix.effective_score_scale, ix.relu, ix.per_kv_head))
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


def _gated_selection(config: AttentionConfig, tensors, query, q, cache, B: int, T: int, S: int, mask,
                     is_causal: bool, return_scores: bool, rec) -> dict:
    """impl_numpy.indexer._gated_selection in MLX."""
    ix = config.indexer
    J, bs = ix.head_dim, ix.block_size
    k, gates = cache[..., :J], cache[..., J:]
    pooled = rec("indexer.pool.keys", pooled_keys(k, gates, tensors["indexer.pool.position"], bs))  # (B, nb, J)
    weights = None
    if ix.head_weights:
        c = compute_of(query.dtype)
        w = F.project(query, tensors["indexer.weights.kernel"][:, :, None], None)  # (B, T, I)
        weights = rec("indexer.weights", (w.astype(c) * scalar(ix.effective_weight_scale, c)).astype(query.dtype))
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
        tail = mx.broadcast_to(tail, (*selection.shape[:-1], bs - 1))
        width = min(selection.shape[-1] + bs - 1, S)
        selection = left_pack(mx.concatenate([selection, tail], axis=-1), width)
    result["topk_indices"] = rec("indexer.selection", selection if ix.per_kv_head else selection[:, 0])
    return result
