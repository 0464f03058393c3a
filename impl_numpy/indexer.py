"""The lightning indexer (weights.config.Indexer): which keys each query may see. The executable spec of
DeepSeek V3.2's DSA indexer, GLM-5's (glm_moe_dsa) and MiniMax M3's; docs/sparse-attention.md states each
stage with its sources.

Shape letters as functional.py's, plus I index heads, J index head_dim, G selection groups (1: one
selection per query; K: one per kv head), nb key blocks, k the selection's width.

Stages (the bracketed ones where the config turns them on):
index query: project (from the query latent or the query input) -> split heads -> [norm] -> [rope]
index key: project -> [norm] -> [rope] -> [cache appended]
[fp8: Hadamard, block e4m3 quantisation of q and k (DeepSeek's inference scoring)]
-> scores: s * q.k per head -> [relu] -> [head weights w_i(x) * weight_scale, summed] (or per kv head)
-> masked (causal AND the call's mask: -inf) -> [block max-pool, local blocks kept] -> top-k (the tie
rule) -> -1 where fewer are visible -> [blocks expanded to their visible keys].
With block_pool "gated" (GLM-5.3-Flash's k-pool, glm5_next) the blocks are scored by pooled keys instead:
index key and gate logits (project: key input -> J) -> [cache appended] -> pooled keys (per block, per feature
a softmax over its slots of gate logit + slot position, the keys weighted by it) -> scores against the pooled
keys -> masked (a block is a candidate only when every one of its keys is visible) -> top-k -> expanded to
their keys -> [the query's open block (its own, not all visible) appended: open_block].

The selection is returned in the attention's `topk_indices` format: (B, T, k) or per kv head (B, K, T, k),
int64, indexed over the cache's keys then the new ones, sorted by score (highest first, ties to the lower
key index), -1 padding every unused slot at the end. The index scores stay in the compute dtype (float32
for 16-bit inputs: transformers' `.float()`, DeepSeek's float32 logits).
"""

from __future__ import annotations

import math

import numpy as np

from weights import AttentionConfig, compute_dtype, dtype_from_name
from weights.rope import rope_tables

from . import functional as F
from .masks import causal_mask

# DeepSeek's float8 e4m3 range (inference/kernel.py act_quant_kernel: fp8_max 448) and its amax floor (1e-4).
FP8_MAX = 448.0
FP8_AMAX_FLOOR = 1e-4
# DeepSeek's quantisation block along the features (inference/model.py block_size = 128).
FP8_BLOCK = 128
PRECISIONS = (None, "fp8_e4m3")
GATED = "gated"  # Indexer.block_pool of GLM-5.3-Flash's k-pool
# The layer's tensors the indexer reads: its own, and the query latent's (query_source "latent").
READS = ("indexer.", "query.down.")
FP8_SCALE_FORMATS = ("float", "ue8m0")


# -- stages -----------------------------------------------------------------------------------------------

def index_rope(x: np.ndarray, angles: np.ndarray, rotary_dim: int, interleaved: bool, attention_factor: float,
               end: str) -> np.ndarray:
    """RoPE on the first (end "first": DeepSeek V3.2, GLM-5, MiniMax M3) or last rotary_dim of x's J features,
    x (B, heads, L, J); the pairs turn in place (interleaved: 2i with 2i+1, without the reordering
    transformers' GLM-5 port applies to both q and k)."""
    if end == "first":
        return F.rope(x, angles, rotary_dim, interleaved, attention_factor)
    return F.rope_last(x, angles, rotary_dim, interleaved, attention_factor)


def hadamard(x: np.ndarray) -> np.ndarray:
    """x (..., J) times the orthonormal Sylvester Hadamard matrix H_J / sqrt(J) (J a power of two): DeepSeek's
    rotate_activation (fast_hadamard_transform with scale J**-0.5), in compute dtype. Dot products are
    unchanged in exact arithmetic; it matters only to the fp8 quantisation that follows it."""
    J = x.shape[-1]
    h = np.ones((1, 1))
    while h.shape[0] < J:
        h = np.block([[h, h], [h, -h]])
    ct = compute_dtype(x.dtype)
    return (x.astype(ct) @ (h / math.sqrt(J)).astype(ct)).astype(x.dtype)


def quantize_fp8(x: np.ndarray, block: int, scale_format: str) -> tuple[np.ndarray, np.ndarray]:
    """DeepSeek's act_quant, simulated: per block of `block` features, amax = max(|x|, 1e-4) in float32, the
    scale amax * (1/448) in float32 ("float") or the power of two at or above it ("ue8m0", DeepSeek's scale_fmt in
    config_671B_v3.2.json), x / scale rounded to float8 e4m3 (ml_dtypes.float8_e4m3fn, round to nearest even,
    clamped to +-448). -> (the quantised values as float64, (..., J // block) scales)."""
    import ml_dtypes

    shape = x.shape
    xb = x.astype(np.float64).reshape(*shape[:-1], shape[-1] // block, block)  # (..., nblk, block)
    amax = np.maximum(np.abs(xb).max(axis=-1, keepdims=True), FP8_AMAX_FLOOR).astype(np.float32)
    scale = amax * np.float32(1 / FP8_MAX)  # float32, times the reciprocal, as the kernel's fp8_max_inv
    if scale_format == "ue8m0":  # 2^ceil(log2 scale), exactly: frexp's mantissa is 0.5 on a power of two
        mantissa, exponent = np.frexp(scale)
        scale = np.ldexp(np.float32(1), np.where(mantissa == 0.5, exponent - 1, exponent)).astype(np.float32)
    scale = scale.astype(np.float64)
    q = np.clip(xb / scale, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    return q.reshape(shape), scale[..., 0]


def scores(q: np.ndarray, k: np.ndarray, weights: np.ndarray | None, score_scale: float, relu: bool,
           per_kv_head: bool) -> np.ndarray:
    """INDEX SCORES: q (B, I, T, J), k (B, S, J) (every key, the cache's included), weights (B, T, I) (head
    weights times their scale) or None. Per head s * q.k, then ReLU; weighted and summed over the heads ->
    (B, 1, T, S); per_kv_head: each head on its own -> (B, I, T, S); no weights: summed -> (B, 1, T, S).
    In compute dtype, kept there."""
    ct = compute_dtype(q.dtype)
    # The stage is einsum("BITJ,BSJ->BITS", q, k) then einsum("BTI,BITS->BTS", weights, dots): written as the
    # same contractions in matmul form, the index heads and queries as the rows of one (I T, J) x (J, S)
    # product per batch row, and the weighted sum as (1, I) x (I, S) per query, so that they run as BLAS
    # matmuls (np.einsum sums these in its own loops: 131 of the 149 ms of CPU an indexer step took at P
    # 65536, docs/performance.md). The same products and sums, in another order: equal to round-off.
    B, I, T, J = q.shape
    if T == 1 and not per_kv_head and k.shape[1] >= DECODE_SCORES_MIN_KEYS:
        return _decode_scores(q, k, weights, score_scale, relu)
    dots = np.matmul(q.astype(ct, copy=False).reshape(B, I * T, J), k.astype(ct, copy=False).swapaxes(1, 2))  # (B, I*T, S)
    dots = dots.reshape(B, I, T, -1)  # (B, I, T, S)
    dots *= ct.type(score_scale)
    if relu:
        np.maximum(dots, ct.type(0), out=dots)
    if per_kv_head:
        return dots
    if weights is None:
        return dots.sum(axis=1, keepdims=True)  # (B, 1, T, S)
    w = weights.astype(ct)[:, :, None, :]  # (B, T, 1, I)
    return np.matmul(w, dots.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)  # (B, T, 1, S) -> (B, 1, T, S)


# A decode step's scores (one query, one selection) are taken with the keys as the rows: one (S, J) x (J, I)
# product per batch row, then the scale and ReLU in place and the weighted sum a (S, I) x (I,) product, where the
# (I, J) x (J, S) form ran at 54 GFLOP/s of CPU and its (1, I) x (I, S) sum read the (I, S) intermediate once more.
# Measured (2-core AMD EPYC VM, 2026-11-30, loaded, CPU time, min of 5): I 64, J 128, 65537 keys, the stage
# 22.1 ms as (I, J) x (J, S), 17.8-18.1 ms this way with one BLAS thread (28-31 ms with two). Taken in blocks
# of keys that keep the (block, I) dots in cache it was 17.2 ms with one thread but 60-122 ms with two under
# the load of other jobs (each BLAS call waking, and waiting on, the second thread): one call per batch row.
# Under DECODE_SCORES_MIN_KEYS keys (every grid case) the stage keeps its first form.
DECODE_SCORES_MIN_KEYS = 4096


def _decode_scores(q, k, weights, score_scale, relu):
    """scores() for one query (T 1), one selection (not per kv head): the same products, scale, ReLU and sum
    over the heads, with the keys as the rows, (S, J) x (J, I), and the weighted sum a (S, I) x (I,) product.
    -> (B, 1, 1, S), in compute dtype."""
    ct = compute_dtype(q.dtype)
    B, I, _, J = q.shape
    S = k.shape[1]
    qt = q.astype(ct, copy=False)[:, :, 0, :].swapaxes(1, 2)  # (B, J, I)
    kk = k.astype(ct, copy=False)
    w = None if weights is None else weights.astype(ct)[:, 0, :]  # (B, I)
    out = np.empty((B, 1, 1, S), dtype=ct)
    for b in range(B):
        dots = kk[b] @ qt[b]  # (S, I)
        dots *= ct.type(score_scale)
        if relu:
            np.maximum(dots, ct.type(0), out=dots)
        out[b, 0, 0] = dots.sum(axis=1) if w is None else dots @ w[b]
    return out


def mask_scores(x: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """-inf where a key is not visible (allowed (B|1, 1, T, S) bool): the masks act BEFORE the selection."""
    return np.where(allowed, x, -np.inf)


def block_scores(x: np.ndarray, block_size: int) -> np.ndarray:
    """(B, G, T, S) -> (B, G, T, nb = ceil(S / block_size)): each block's largest visible score (-inf for a
    block with none; the last block padded with -inf)."""
    B, G, T, S = x.shape
    nb = -(-S // block_size)
    padded = np.full((B, G, T, nb * block_size), -np.inf, dtype=x.dtype)
    padded[..., :S] = x
    return padded.reshape(B, G, T, nb, block_size).max(axis=-1)  # (B, G, T, nb)


def keep_local_blocks(x: np.ndarray, query_slots: np.ndarray, block_size: int, local_blocks: int) -> np.ndarray:
    """+inf on the query's own block and the local_blocks - 1 before it (query_slots (T,): each query's index
    among the keys), where that block has a visible key: they always win a slot (MiniMax M3's local blocks,
    its own block included)."""
    own = query_slots // block_size  # (T,)
    local = np.zeros(x.shape[-2:], dtype=bool)  # (T, nb)
    for back in range(local_blocks):
        b = own - back
        ok = b >= 0
        local[np.arange(len(own))[ok], b[ok]] = True
    return np.where(local & (x > -np.inf), np.inf, x)


def select_topk(x: np.ndarray, k: int) -> np.ndarray:
    """TOP-K with the contract's tie rule: x (..., n) scores -> (..., min(k, n)) int64 indices, highest score
    first, equal scores in ascending index; a slot whose score is -inf (nothing visible left) is -1."""
    width = min(k, x.shape[-1])
    if width and x.shape[-1] >= TOPK_PARTITION_MIN * width and x.size <= TOPK_PARTITION_MAX_ROWS * x.shape[-1]:
        return _select_topk_partitioned(x, width)
    order = np.argsort(-x, axis=-1, kind="stable")[..., :width]  # stable: ties keep ascending index
    chosen = np.take_along_axis(x, order, axis=-1)
    return np.where(chosen > -np.inf, order, -1).astype(np.int64)


# select_topk sorts only the candidates (every score at or above the k-th largest, np.partition) where the
# rows are few and long (a decode step's: k 2048 of 65537 keys, 5.6 ms for the full stable argsort against
# under 1 ms, one BLAS thread, the VM above, 2026-11-30); the same selection, ties included.
TOPK_PARTITION_MIN = 4
TOPK_PARTITION_MAX_ROWS = 64


def _select_topk_partitioned(x: np.ndarray, width: int) -> np.ndarray:
    """select_topk's result, row by row: the k-th largest score t (np.partition), the candidates x >= t in
    ascending index, stably sorted by -x: the stable full sort's first `width`, as every score above t and the
    lowest-index ties at t are exactly its first `width`. A row holding NaN takes the full sort (where it
    puts NaN last)."""
    rows = x.reshape(-1, x.shape[-1])
    out = np.empty((rows.shape[0], width), dtype=np.int64)
    n = rows.shape[1]
    for r, row in enumerate(rows):
        if np.isnan(row).any():
            order = np.argsort(-row, kind="stable")[:width]
        else:
            t = np.partition(row, n - width)[n - width]
            candidates = np.flatnonzero(row >= t)
            order = candidates[np.argsort(-row[candidates], kind="stable")[:width]]
        out[r] = np.where(row[order] > -np.inf, order, -1)
    return out.reshape(*x.shape[:-1], width)


def expand_blocks(blocks: np.ndarray, block_size: int, allowed: np.ndarray, S: int) -> np.ndarray:
    """Selected blocks (B, G, T, kb) (-1: none) -> their visible keys (B, G, T, min(kb * block_size, S)) in
    block order, ascending within a block, left-packed, -1 after them. allowed (B|1, 1, T, S)."""
    B, G, T, kb = blocks.shape
    keys = blocks[..., None] * block_size + np.arange(block_size)  # (B, G, T, kb, bs)
    keys = keys.reshape(B, G, T, kb * block_size)
    valid = (blocks[..., None] >= 0).repeat(block_size, axis=-1).reshape(keys.shape) & (keys < S)
    seen = np.broadcast_to(allowed, (B, G, T, S))
    valid &= np.take_along_axis(seen, np.clip(keys, 0, S - 1), axis=-1)
    order = np.argsort(~valid, axis=-1, kind="stable")[..., :min(kb * block_size, S)]  # valid first, in order
    packed = np.take_along_axis(keys, order, axis=-1)
    return np.where(np.take_along_axis(valid, order, axis=-1), packed, -1).astype(np.int64)


def pooled_keys(k: np.ndarray, gates: np.ndarray, position: np.ndarray, block_size: int) -> np.ndarray:
    """POOLED KEYS (block_pool "gated"): k and gates (B, S, J) (every token's index key and gate logits, the
    cache's included), position (block_size, J) -> (B, nb = ceil(S / block_size), J): per block and feature,
    softmax over its slots of gates + position (the slots past S left out), the keys weighted by it and summed.
    In compute dtype (float32 for 16-bit inputs: glm5_next's `.float()` logits)."""
    B, S, J = k.shape
    ct = compute_dtype(k.dtype)
    nb = -(-S // block_size)
    logits = np.full((B, nb * block_size, J), -np.inf, dtype=ct)
    logits[:, :S] = gates.astype(ct)
    logits = logits.reshape(B, nb, block_size, J) + position.astype(ct)  # (B, nb, bs, J)
    p = np.exp(logits - logits.max(axis=2, keepdims=True))
    p = p / p.sum(axis=2, keepdims=True)  # (B, nb, bs, J): the gate over each block's slots, per feature
    padded = np.zeros((B, nb * block_size, J), dtype=ct)
    padded[:, :S] = k.astype(ct)
    return np.einsum("BnbJ,BnbJ->BnJ", p, padded.reshape(B, nb, block_size, J))  # (B, nb, J)


def complete_blocks(allowed: np.ndarray, block_size: int) -> np.ndarray:
    """allowed (B|1, 1, T, S) -> (B|1, 1, T, nb): True where every one of a block's block_size keys exists
    and is visible (block_pool "gated": only such a block is a candidate; glm5_next's pool_valid and its
    last token visible)."""
    *lead, S = allowed.shape
    nb = -(-S // block_size)
    padded = np.zeros((*lead, nb * block_size), dtype=bool)
    padded[..., :S] = allowed
    return padded.reshape(*lead, nb, block_size).all(axis=-1)


def open_block_keys(allowed: np.ndarray, query_slots: np.ndarray, block_size: int) -> np.ndarray:
    """The query's open block (open_block): allowed (B|1, 1, T, S), query_slots (T,) (each query's index
    among the keys) -> (B|1, 1, T, block_size - 1) int64: the visible keys of the query's own block when
    not all of its keys are visible (else none), ascending, left-packed, -1 after them (glm5_next's tail:
    the visible tokens after the last complete pool)."""
    *lead, T, S = allowed.shape
    start = (query_slots // block_size) * block_size  # (T,)
    keys = start[:, None] + np.arange(block_size)  # (T, bs)
    seen = np.take_along_axis(allowed, np.broadcast_to(np.clip(keys, 0, S - 1), (*lead, T, block_size)), axis=-1)
    seen &= keys < S
    is_open = ~seen.all(axis=-1, keepdims=True)  # (B|1, 1, T, 1)
    valid = seen & is_open
    order = np.argsort(~valid, axis=-1, kind="stable")[..., :block_size - 1]  # visible first, in order
    packed = np.take_along_axis(np.broadcast_to(keys, valid.shape), order, axis=-1)
    return np.where(np.take_along_axis(valid, order, axis=-1), packed, -1).astype(np.int64)


def left_pack(keys: np.ndarray, width: int) -> np.ndarray:
    """(..., n) key indices with -1 holes -> (..., width): the keys in their order, -1 after them."""
    order = np.argsort(keys < 0, axis=-1, kind="stable")[..., :width]
    return np.take_along_axis(keys, order, axis=-1)


# -- the call -----------------------------------------------------------------------------------------------

def _allowed(mask, B: int, T: int, S: int, is_causal: bool) -> np.ndarray:
    """The call's mask ((T, S), (B, T, S) or (B, 1, T, S), True = visible) AND causal (bottom-right: query t
    sees keys j <= t + S - T, the cache's included) -> (B|1, 1, T, S)."""
    allowed = np.ones((1, 1, T, S), dtype=bool)
    if is_causal:
        allowed = causal_mask(T, S, "bottom_right")[None, None]
    if mask is not None:
        m = np.asarray(mask, dtype=bool)
        if m.ndim not in (2, 3, 4) or m.shape[-2:] != (T, S) or (m.ndim == 4 and m.shape[1] != 1):
            raise ValueError(f"index mask must have shape (T, S), (B, T, S) or (B, 1, T, S) with T={T}, "
                             f"S={S} (every key, the cache's included): got {m.shape}")
        m = m.reshape((1, 1, T, S) if m.ndim == 2 else (m.shape[0], 1, T, S))
        allowed = allowed & m
    return allowed


def index_keys(config: AttentionConfig, tensors, key: np.ndarray, key_positions: np.ndarray, dtype,
               rec=lambda stage, value: value) -> np.ndarray:
    """The new tokens' index keys (B, S, J): projected, normed, rotated (what the indexer's cache holds); with
    block_pool gated each token's gate logits after its key, (B, S, 2J)."""
    ix = config.indexer
    k = rec("indexer.key.project", F.project(key, tensors["indexer.key.kernel"][:, None, :], None))  # (B, S, J)
    if ix.key_norm is not None:
        n = ix.key_norm
        k = rec("indexer.key.norm", F.norm(k, tensors.get("indexer.key.norm.scale"),
                                           tensors.get("indexer.key.norm.bias"), n.type, n.eps, 1, "head"))
    if ix.rope is not None:
        inv_freq, factor = rope_tables(ix.rope, int(key_positions.max()) if key_positions.size else None)
        k = index_rope(k[:, None], F.rope_angles(key_positions, inv_freq, dtype), ix.rope.rotary_dim,
                       ix.rope.interleaved, factor, ix.rope_end)[:, 0]
        k = rec("indexer.key.rope", k)
    if ix.block_pool == GATED:  # the gate logits travel with the key in the cache: (B, S, 2J)
        gates = rec("indexer.pool.gates", F.project(key, tensors["indexer.pool.gate.kernel"][:, None, :], None))
        k = np.concatenate([k, gates], axis=-1)
    return k  # (B, S, J), or (B, S, 2J) with block_pool gated


def index_queries(config: AttentionConfig, tensors, query: np.ndarray, positions: np.ndarray, dtype,
                  rec=lambda stage, value: value) -> np.ndarray:
    """The index queries (B, I, T, J): from the layer's normed query latent (query_source "latent": the
    query's down-projection and RMS norm, DeepSeek's `qr`) or from the query input."""
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
        inv_freq, factor = rope_tables(ix.rope, int(positions.max()) if positions.size else None)
        q = rec("indexer.query.rope", index_rope(q, F.rope_angles(positions, inv_freq, dtype), ix.rope.rotary_dim,
                                                 ix.rope.interleaved, factor, ix.rope_end))
    return q  # (B, I, T, J)


def _check_fp8(config: AttentionConfig, precision, scale_format: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(map(str, PRECISIONS))}: got {precision!r}")
    if scale_format not in FP8_SCALE_FORMATS:
        raise ValueError(f"fp8_scale_format must be one of {', '.join(FP8_SCALE_FORMATS)}: got {scale_format!r}")
    if precision is None:
        return
    if config.indexer.block_pool == GATED:
        raise ValueError("precision fp8_e4m3 needs indexer.block_pool max (DeepSeek's fp8 scoring is of token keys; "
                         "glm5_next scores its pooled keys in float32): got block_pool gated")
    J = config.indexer.head_dim
    if J & (J - 1) or J > FP8_BLOCK:
        raise ValueError(f"precision fp8_e4m3 needs indexer.head_dim a power of two <= {FP8_BLOCK} (DeepSeek's "
                         f"Hadamard transform and one quantisation block per head): got head_dim={J}")


def lightning_indexer(config: AttentionConfig, tensors: dict, query, key=None, *, positions=None,
                      key_positions=None, past_index_keys=None, mask=None, is_causal: bool = True,
                      dtype: str | None = None, precision: str | None = None, fp8_scale_format: str = "float",
                      return_scores: bool = False, cache_length: int | None = None,
                      rec=lambda stage, value: value) -> dict:
    """Run the indexer of `config.indexer` on one call.

    query (B, T, Dq), key (B, S, Dk) (default: query, self-attention); positions (T,) or (B, T) and
    key_positions (S,) or (B, S) (default P + arange: the cache's length P offsets them); past_index_keys
    (B, P, J): the index keys of the P cached tokens (present_index_keys of the previous call); mask: True
    where a key is visible (padding), (T, P+S), (B, T, P+S) or (B, 1, T, P+S), ANDed with the causal mask
    (bottom-right) when is_causal. dtype: the storage dtype (default: the query's). precision "fp8_e4m3":
    DeepSeek's scoring precision (Hadamard, e4m3 with one scale per head vector, fp8_scale_format "float" or
    "ue8m0"), simulated through ml_dtypes. cache_length: an in-place index cache, as the attention call's:
    past_index_keys is the caller's buffer (B, C, J|2J) whose first cache_length = P rows are the cache; the
    call writes the new index keys at P..P+S-1 and scores over the first P+S rows without copying;
    present_index_keys is the buffer, whole. Refused (ValueError naming cache_length) without
    past_index_keys, or where P+S exceeds the buffer's rows.

    -> {"topk_indices": (B, T, k') or, per kv head, (B, K, T, k') int64 (k' = min(topk, P+S), or with blocks
    min(topk * block_size, P+S)), "present_index_keys": (B, P+S, J)}; with blocks also "topk_blocks" (B, G,
    T, min(topk, nb)); with return_scores "index_scores" (B, G, T, P+S) (-inf where masked) and
    "index_score_magnitudes" (the same stages on |q|, |k|, |w|: the size of what each score sums, float64).
    """
    ix = config.indexer
    if ix is None:
        raise ValueError("config.indexer is null: this layer has no indexer")
    _check_fp8(config, precision, fp8_scale_format)
    query = np.asarray(query)
    dt = dtype_from_name(dtype or query.dtype.name)
    query = query.astype(dt, copy=False)  # (no copy where the dtype is already dt: a step reads, never writes them)
    key = query if key is None else np.asarray(key).astype(dt, copy=False)
    if query.ndim != 3 or key.ndim != 3 or key.shape[0] != query.shape[0]:
        raise ValueError(f"query must be (B, T, Dq) and key (B, S, Dk) with one B: got query {query.shape}, "
                         f"key {key.shape}")
    B, T, S = query.shape[0], query.shape[1], key.shape[1]
    P = 0
    buffer = None
    if cache_length is not None:
        buffer = _index_cache_buffer(past_index_keys, cache_length, S, dt)
        past_index_keys = buffer[:, :cache_length]
    if past_index_keys is not None:
        past_index_keys = np.asarray(past_index_keys).astype(dt, copy=False)  # (a copy of the index cache: only to cast)
        if past_index_keys.ndim != 3 or past_index_keys.shape[0] != B or past_index_keys.shape[2] != ix.cache_width:
            raise ValueError(f"past_index_keys must have shape (B, P, {'2J' if ix.block_pool == GATED else 'J'}) = "
                             f"({B}, P, {ix.cache_width}): got {past_index_keys.shape}")
        P = past_index_keys.shape[1]
    tensors = {name: np.asarray(t).astype(dt, copy=False) for name, t in tensors.items() if name.startswith(READS)}
    positions = F.default_positions(positions, P, T)
    key_positions = F.default_positions(key_positions, P, S)

    q = index_queries(config, tensors, query, positions, dt, rec)  # (B, I, T, J)
    k_new = index_keys(config, tensors, key, key_positions, dt, rec)  # (B, S, J)
    if buffer is not None:  # in place: the new rows written, the first P+S rows a view (no copy of the cache)
        buffer[:, P:P + S] = k_new
        k = buffer[:, :P + S]
    else:
        k = k_new if past_index_keys is None else np.concatenate([past_index_keys, k_new], axis=1)  # (B, P+S, J|2J)
    present = k if buffer is None else buffer  # the returned index cache: with cache_length the buffer, whole
    if ix.block_pool == GATED:
        result = _gated_selection(config, tensors, query, q, k, B, T, P + S, mask, is_causal, return_scores, rec)
        result["present_index_keys"] = present
        return result
    weights = None
    if ix.head_weights:
        ct = compute_dtype(dt)
        w = F.project(query, tensors["indexer.weights.kernel"][:, :, None], None)  # (B, T, I)
        weights = rec("indexer.weights", (w.astype(ct) * ct.type(ix.effective_weight_scale)).astype(dt))
    qs, ks = q, k
    if precision == "fp8_e4m3":
        qs, q_scale = quantize_fp8(hadamard(q), ix.head_dim, fp8_scale_format)
        ks, k_scale = quantize_fp8(hadamard(k), ix.head_dim, fp8_scale_format)
        # the values the fp8 kernel multiplies: each quantised feature times its block's scale
        qs = rec("indexer.query.fp8", qs * np.repeat(q_scale, ix.head_dim, axis=-1))
        ks = rec("indexer.key.fp8", ks * np.repeat(k_scale, ix.head_dim, axis=-1))
        qs, ks = qs.astype(np.float64), ks.astype(np.float64)
    x = rec("indexer.scores", scores(qs, ks, weights, ix.effective_score_scale, ix.relu, ix.per_kv_head))
    allowed = _allowed(mask, B, T, P + S, is_causal)  # (B|1, 1, T, P+S)
    x = rec("indexer.masked_scores", mask_scores(x, allowed))
    result = {"present_index_keys": present}
    if return_scores:
        result["index_scores"] = x
        aw = None if weights is None else np.abs(weights.astype(np.float64))
        mag = scores(np.abs(qs.astype(np.float64)), np.abs(ks.astype(np.float64)), aw, ix.effective_score_scale,
                     False, ix.per_kv_head)
        result["index_score_magnitudes"] = mask_scores(mag, allowed)
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


def _index_cache_buffer(buffer, cache_length, S: int, dt: np.dtype) -> np.ndarray:
    """lightning_indexer's in-place index cache, checked: a writeable NumPy array of the storage dtype (a cast or
    a read-only array would write a copy the caller never sees), (B, C, J|2J) with room for the call's S keys
    after its first cache_length rows (the shape's other checks are lightning_indexer's own)."""
    if buffer is None:
        raise ValueError("cache_length needs past_index_keys, the index cache's buffer: got past_index_keys None")
    if not isinstance(buffer, np.ndarray) or buffer.dtype != dt or not buffer.flags.writeable:
        raise ValueError(f"cache_length needs past_index_keys a writeable numpy array of the storage dtype {dt.name}: "
                         f"got {type(buffer).__name__} {getattr(buffer, 'dtype', '')}".rstrip())
    if isinstance(cache_length, bool) or not isinstance(cache_length, (int, np.integer)) or buffer.ndim != 3 \
            or not 0 <= cache_length <= buffer.shape[1] - S:
        raise ValueError(f"cache_length must be an int in 0..C-S = 0..{buffer.shape[1] - S if buffer.ndim == 3 else '?'}"
                         f" (the buffer's rows less the call's {S} keys): got {cache_length!r} with past_index_keys "
                         f"{buffer.shape}")
    return buffer


def _gated_selection(config: AttentionConfig, tensors, query, q, cache, B: int, T: int, S: int, mask,
                     is_causal: bool, return_scores: bool, rec) -> dict:
    """lightning_indexer's stages after the index keys for block_pool "gated" (GLM-5.3-Flash's k-pool): q (B,
    I, T, J), cache (B, S, 2J) (keys | gate logits, every key's). -> lightning_indexer's result; index_scores
    and index_score_magnitudes per block (B, G, T, nb)."""
    ix = config.indexer
    J, bs = ix.head_dim, ix.block_size
    k, gates = cache[..., :J], cache[..., J:]
    pooled = rec("indexer.pool.keys", pooled_keys(k, gates, tensors["indexer.pool.position"], bs))  # (B, nb, J)
    weights = None
    if ix.head_weights:
        ct = compute_dtype(query.dtype)
        w = F.project(query, tensors["indexer.weights.kernel"][:, :, None], None)  # (B, T, I)
        weights = rec("indexer.weights", (w.astype(ct) * ct.type(ix.effective_weight_scale)).astype(query.dtype))
    x = rec("indexer.scores", scores(q, pooled, weights, ix.effective_score_scale, ix.relu, ix.per_kv_head))
    allowed = _allowed(mask, B, T, S, is_causal)  # (B|1, 1, T, S)
    x = rec("indexer.masked_scores", mask_scores(x, complete_blocks(allowed, bs)))  # (B, G, T, nb)
    result = {"present_index_keys": cache}
    if return_scores:
        # the size of what each score sums: the gate's weights are in [0, 1], so |pooled| <= pool of |k|
        aw = None if weights is None else np.abs(weights.astype(np.float64))
        mag = scores(np.abs(q.astype(np.float64)), pooled_keys(np.abs(k.astype(np.float64)), gates.astype(np.float64),
                                                                tensors["indexer.pool.position"].astype(np.float64), bs),
                     aw, ix.effective_score_scale, False, ix.per_kv_head)
        result.update(index_scores=x, block_scores=x,
                      index_score_magnitudes=mask_scores(mag, complete_blocks(allowed, bs)))
    blocks = rec("indexer.blocks", select_topk(x, ix.topk))  # (B, G, T, kb')
    result["topk_blocks"] = blocks
    selection = expand_blocks(blocks, bs, allowed, S)  # (B, G, T, min(kb' * bs, S))
    if ix.open_block:
        tail = open_block_keys(allowed, np.arange(T) + S - T, bs)  # (B|1, 1, T, bs - 1)
        tail = np.broadcast_to(tail, (*selection.shape[:-1], bs - 1))
        width = min(selection.shape[-1] + bs - 1, S)
        selection = left_pack(np.concatenate([selection, tail], axis=-1), width)
    result["topk_indices"] = rec("indexer.selection", selection if ix.per_kv_head else selection[:, 0])
    return result
