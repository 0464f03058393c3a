"""The lightning indexer in JAX: mirrors impl_numpy/indexer.py (same stages, same names, same einsum strings;
jax.numpy ops only). Shape letters as there: I index heads, J index head_dim, G selection groups.

Runs op by op (the indexer's shapes change with every decode step, and its top-k is a sort, not a kernel to
fuse), except an eager call over JIT_MIN_KEYS keys or more, which runs as one jitted program (a program per
shape: op by op, such a call was mostly dispatch); float64 needs JAX's x64 mode (impl_jax.call's check says
so). The fp8 simulation rounds through jnp.float8_e4m3fn (round to nearest even, as ml_dtypes: JAX's float8
types are ml_dtypes'); the top-k is a stable sort of the negated scores (jax.lax.top_k's order among equal
scores is not the contract's; a long row's takes only its k-th largest value from it:
_select_topk_partitioned).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from weights import AttentionConfig, compute_dtype, dtype_from_name
from weights.rope import rope_tables

from . import functional as F
from .masks import causal_mask

FP8_MAX = 448.0
FP8_AMAX_FLOOR = 1e-4
FP8_BLOCK = 128
PRECISIONS = (None, "fp8_e4m3")
GATED = "gated"  # Indexer.block_pool of GLM-5.3-Flash's k-pool
# The layer's tensors the indexer reads: its own, and the query latent's (query_source "latent").
READS = ("indexer.", "query.down.")
FP8_SCALE_FORMATS = ("float", "ue8m0")

# An eager call over at least this many keys (P + S) runs as one jitted program (_jitted): op by op, the step
# is mostly dispatch and the eager reshapes' copies of the weights. DeepSeek V3.2's sizes (I 64, J 128, D 2048,
# one query, float32), CPU time per call, 2-core AMD EPYC VM, 2026-11-30, loaded: 83 ms at P 8192 and 133-152
# at P 65536 op by op; at P 65536 jitted 40-43 ms (the keys-as-rows scores and the candidates' top-k included:
# _one_query_scores, _select_topk_partitioned), 21-24 ms with the in-place index cache (cache_length), of which
# the scores are about 17. Below it (the grid's and the tests' small calls, each shape a program of its own to
# compile) it stays op by op.
JIT_MIN_KEYS = 1024


def _float8():
    """JAX's float8 e4m3 type, or a ValueError saying why the simulation cannot run."""
    fp8 = getattr(jnp, "float8_e4m3fn", None)
    if fp8 is None:
        import jax

        raise ValueError(f"precision fp8_e4m3 needs jnp.float8_e4m3fn, which JAX {jax.__version__} lacks")
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
    ct = compute_dtype(x.dtype)
    return (x.astype(ct) @ jnp.asarray((h / math.sqrt(J)).astype(ct))).astype(x.dtype)


def quantize_fp8(x, block: int, scale_format: str):
    shape = x.shape
    xb = x.astype(jnp.float64).reshape(*shape[:-1], shape[-1] // block, block)  # (..., nblk, block)
    amax = jnp.maximum(jnp.abs(xb).max(axis=-1, keepdims=True), FP8_AMAX_FLOOR).astype(jnp.float32)
    scale = amax * jnp.float32(1 / FP8_MAX)  # float32, times the reciprocal
    if scale_format == "ue8m0":  # 2^ceil(log2 scale), exactly
        mantissa, exponent = jnp.frexp(scale)
        scale = jnp.ldexp(jnp.ones_like(scale), jnp.where(mantissa == 0.5, exponent - 1, exponent))
    scale = scale.astype(jnp.float64)
    q = jnp.clip(xb / scale, -FP8_MAX, FP8_MAX).astype(_float8()).astype(jnp.float64)
    return q.reshape(shape), scale[..., 0]


def scores(q, k, weights, score_scale: float, relu: bool, per_kv_head: bool):
    ct = compute_dtype(q.dtype)
    if q.shape[2] == 1 and k.shape[1] >= JIT_MIN_KEYS and not per_kv_head:  # a decode step's long row
        return _one_query_scores(q.astype(ct), k.astype(ct), weights, ct.type(score_scale), relu)
    dots = jnp.einsum("BITJ,BSJ->BITS", q.astype(ct), k.astype(ct), precision="highest") * ct.type(score_scale)
    if relu:
        dots = jnp.maximum(dots, 0)
    if per_kv_head:
        return dots
    if weights is None:
        return dots.sum(axis=1, keepdims=True)  # (B, 1, T, S)
    return jnp.einsum("BTI,BITS->BTS", weights.astype(ct), dots, precision="highest")[:, None]  # (B, 1, T, S)


def _one_query_scores(q, k, weights, scale, relu: bool):
    """scores() for one query (T 1) with the keys as rows: (S, J) x (J, I), then (S, I) x (I,) -> (B, 1, 1,
    S). The same products and sums as the einsums above, in another order: XLA CPU runs the keys-as-rows
    product about 3x faster than the 64-row one (P 65536, I 64, J 128, float32, under jax.jit: 17 vs 49 ms
    of CPU for the scores, 2-core AMD EPYC VM, 2026-11-30, loaded)."""
    dots = jnp.einsum("BSJ,BIJ->BSI", k, q[:, :, 0], precision="highest") * scale  # (B, S, I)
    if relu:
        dots = jnp.maximum(dots, 0)
    if weights is None:
        return dots.sum(axis=-1)[:, None, None]  # (B, 1, 1, S)
    return jnp.einsum("BSI,BI->BS", dots, weights[:, 0].astype(dots.dtype), precision="highest")[:, None, None]


def mask_scores(x, allowed):
    return jnp.where(allowed, x, -jnp.inf)


def block_scores(x, block_size: int):
    B, G, T, S = x.shape
    nb = -(-S // block_size)
    padded = jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, nb * block_size - S)), constant_values=-jnp.inf)
    return padded.reshape(B, G, T, nb, block_size).max(axis=-1)  # (B, G, T, nb)


def keep_local_blocks(x, query_slots: np.ndarray, block_size: int, local_blocks: int):
    own = np.asarray(query_slots) // block_size  # (T,)
    local = np.zeros(x.shape[-2:], dtype=bool)  # (T, nb)
    for back in range(local_blocks):
        b = own - back
        ok = b >= 0
        local[np.arange(len(own))[ok], b[ok]] = True
    return jnp.where(jnp.asarray(local) & (x > -jnp.inf), jnp.inf, x)


def select_topk(x, k: int):
    width = min(k, x.shape[-1])
    if width and x.shape[-1] >= max(JIT_MIN_KEYS, TOPK_PARTITION_MIN * width):
        return _select_topk_partitioned(x, width)
    order = jnp.argsort(-x, axis=-1, stable=True)[..., :width]  # stable: ties keep ascending index
    chosen = jnp.take_along_axis(x, order, axis=-1)
    return jnp.where(chosen > -jnp.inf, order, -1)


# select_topk sorts only the candidates where the rows are long (as impl_numpy's): a decode step's k 2048 of
# 65537 keys under jax.jit, 15 ms of CPU for the full stable argsort (XLA CPU's comparator sort) against
# under 2 ms (lax.top_k, a cumulative sum and a sort of the k candidates), the VM above.
TOPK_PARTITION_MIN = 4


def _select_topk_partitioned(x, width: int):
    """select_topk's result from the candidates alone: the k-th largest score t (lax.top_k's values; its
    order among equal scores is not used), then every score above t and the lowest-index ties at t, in
    ascending index (jnp.nonzero), stably sorted by -x: exactly the stable full sort's first `width`. A NaN
    score (last in the full sort, as -x sorts NaN last) counts as -inf here: either is -1 in the result,
    and it is picked only once every finite score is."""
    x = jnp.where(jnp.isnan(x), -jnp.inf, x)
    # (..., 1): the k-th largest, as the min of the k values: a slice of the last one would let XLA merge the
    # slices and fall back from its TopK kernel to a full sort (11 ms more at 65537 keys)
    t = jax.lax.top_k(x, width)[0].min(axis=-1, keepdims=True)
    above = x > t
    ties = (x == t) & (jnp.cumsum(x == t, axis=-1) <= width - above.sum(axis=-1, keepdims=True))
    taken = (above | ties).reshape(-1, x.shape[-1])  # exactly `width` per row
    candidates = jax.vmap(lambda row: jnp.nonzero(row, size=width)[0])(taken).reshape(*x.shape[:-1], width)
    values = jnp.take_along_axis(x, candidates, axis=-1)
    order = jnp.argsort(-values, axis=-1, stable=True)  # ties keep ascending index
    chosen = jnp.take_along_axis(values, order, axis=-1)
    return jnp.where(chosen > -jnp.inf, jnp.take_along_axis(candidates, order, axis=-1), -1)


def expand_blocks(blocks, block_size: int, allowed, S: int):
    B, G, T, kb = blocks.shape
    keys = (blocks[..., None] * block_size + jnp.arange(block_size)).reshape(B, G, T, kb * block_size)
    valid = jnp.broadcast_to(blocks[..., None] >= 0, (B, G, T, kb, block_size)).reshape(keys.shape) & (keys < S)
    seen = jnp.broadcast_to(allowed, (B, G, T, S))
    valid = valid & jnp.take_along_axis(seen, jnp.clip(keys, 0, S - 1), axis=-1)
    order = jnp.argsort(~valid, axis=-1, stable=True)[..., :min(kb * block_size, S)]
    packed = jnp.take_along_axis(keys, order, axis=-1)
    return jnp.where(jnp.take_along_axis(valid, order, axis=-1), packed, -1)


def pooled_keys(k, gates, position, block_size: int):
    B, S, J = k.shape
    ct = compute_dtype(k.dtype)
    nb = -(-S // block_size)
    pad = ((0, 0), (0, nb * block_size - S), (0, 0))
    logits = jnp.pad(gates.astype(ct), pad, constant_values=-jnp.inf)  # (B, nb * bs, J)
    logits = logits.reshape(B, nb, block_size, J) + position.astype(ct)  # (B, nb, bs, J)
    p = jnp.exp(logits - logits.max(axis=2, keepdims=True))
    p = p / p.sum(axis=2, keepdims=True)  # (B, nb, bs, J): the gate over each block's slots, per feature
    padded = jnp.pad(k.astype(ct), pad)
    return jnp.einsum("BnbJ,BnbJ->BnJ", p, padded.reshape(B, nb, block_size, J), precision="highest")  # (B, nb, J)


def complete_blocks(allowed, block_size: int):
    *lead, S = allowed.shape
    nb = -(-S // block_size)
    padded = jnp.pad(allowed, [(0, 0)] * len(lead) + [(0, nb * block_size - S)])
    return padded.reshape(*lead, nb, block_size).all(axis=-1)


def open_block_keys(allowed, query_slots: np.ndarray, block_size: int):
    *lead, T, S = allowed.shape
    start = (np.asarray(query_slots) // block_size) * block_size  # (T,)
    keys = jnp.asarray(start[:, None] + np.arange(block_size))  # (T, bs)
    seen = jnp.take_along_axis(allowed, jnp.broadcast_to(jnp.clip(keys, 0, S - 1), (*lead, T, block_size)),
                               axis=-1) & (keys < S)
    is_open = ~seen.all(axis=-1, keepdims=True)  # (B|1, 1, T, 1)
    valid = seen & is_open
    order = jnp.argsort(~valid, axis=-1, stable=True)[..., :block_size - 1]  # visible first, in order
    packed = jnp.take_along_axis(jnp.broadcast_to(keys, valid.shape), order, axis=-1)
    return jnp.where(jnp.take_along_axis(valid, order, axis=-1), packed, -1)


def left_pack(keys, width: int):
    order = jnp.argsort(keys < 0, axis=-1, stable=True)[..., :width]
    return jnp.take_along_axis(keys, order, axis=-1)


# -- the call -----------------------------------------------------------------------------------------------

def _allowed(mask, B: int, T: int, S: int, is_causal: bool):
    allowed = jnp.ones((1, 1, T, S), dtype=bool)
    if is_causal:
        allowed = causal_mask(T, S, "bottom_right")[None, None]
    if mask is not None:
        m = jnp.asarray(mask).astype(bool)
        if m.ndim not in (2, 3, 4) or m.shape[-2:] != (T, S) or (m.ndim == 4 and m.shape[1] != 1):
            raise ValueError(f"index mask must have shape (T, S), (B, T, S) or (B, 1, T, S) with T={T}, "
                             f"S={S} (every key, the cache's included): got {m.shape}")
        allowed = allowed & (m.reshape((1, 1, T, S) if m.ndim == 2 else (m.shape[0], 1, T, S)))
    return allowed


def _largest(positions) -> int | None:
    """The largest position (longrope's choice of table), or None where it is traced (under jax.jit: the
    short table, as rope_tables without a position; a traced call with longrope scaling reads no further)."""
    if positions.size == 0 or isinstance(positions, jax.core.Tracer):
        return None
    return int(np.max(np.asarray(positions)))


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
        k = jnp.concatenate([k, gates], axis=-1)
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


def _no_record(stage: str, value):
    return value




def _jits(config: AttentionConfig, query, key, positions, key_positions, past_index_keys, cache_length, rec) -> bool:
    """Whether an eager call runs as _jitted: no trace asked, not already traced, at least JIT_MIN_KEYS keys,
    and no longrope table chosen by the positions' values (_largest reads them eagerly, not under jit)."""
    if rec is not _no_record or isinstance(query, jax.core.Tracer):
        return False
    rope = config.indexer.rope
    if rope is not None and rope.scaling is not None and rope.scaling.type == "longrope":
        return False
    S = np.shape(query if key is None else key)[1]
    P = cache_length if cache_length is not None else 0 if past_index_keys is None else np.shape(past_index_keys)[1]
    return P + S >= JIT_MIN_KEYS


def lightning_indexer(config: AttentionConfig, tensors: dict, query, key=None, *, positions=None,
                      key_positions=None, past_index_keys=None, mask=None, is_causal: bool = True,
                      dtype: str | None = None, precision: str | None = None, fp8_scale_format: str = "float",
                      return_scores: bool = False, cache_length: int | None = None, rec=_no_record) -> dict:
    """impl_numpy.indexer.lightning_indexer in JAX: NumPy arrays in, jax arrays out.

    cache_length: an in-place index cache, as impl_numpy's, written the JAX way: past_index_keys is the buffer
    (B, C, J|2J) whose first cache_length = P rows are the cache (a Python int); the call's S new keys are
    written at P .. P+S-1 (lax.dynamic_update_slice) and present_index_keys is the written buffer, whole: the
    caller keeps it for the next step (a jax array is immutable; an eager call from JIT_MIN_KEYS keys on runs
    jitted with the buffer donated, so the write is in place and the given buffer is consumed). A long decode
    row's scores then read the buffer where it lies (_scores_in_blocks), not a joined copy of it."""
    ix = config.indexer
    if ix is None:
        raise ValueError("config.indexer is null: this layer has no indexer")
    if cache_length is not None:
        _check_index_cache(past_index_keys, cache_length, np.shape(query if key is None else key)[1])
    if _jits(config, query, key, positions, key_positions, past_index_keys, cache_length, rec):
        jitted = _jitted if cache_length is None else _jitted_in_place
        return jitted(config, {n: t for n, t in tensors.items() if n.startswith(READS)}, query, key,
                      positions=positions, key_positions=key_positions, past_index_keys=past_index_keys, mask=mask,
                      is_causal=is_causal, dtype=dtype or np.dtype(query.dtype).name, precision=precision,
                      fp8_scale_format=fp8_scale_format, return_scores=return_scores, cache_length=cache_length)
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(map(str, PRECISIONS))}: got {precision!r}")
    if fp8_scale_format not in FP8_SCALE_FORMATS:
        raise ValueError(f"fp8_scale_format must be one of {', '.join(FP8_SCALE_FORMATS)}: got {fp8_scale_format!r}")
    J = ix.head_dim
    if precision is not None and ix.block_pool == GATED:
        raise ValueError("precision fp8_e4m3 needs indexer.block_pool max (DeepSeek's fp8 scoring is of token keys; "
                         "glm5_next scores its pooled keys in float32): got block_pool gated")
    if precision is not None:
        _float8()
    if precision is not None and (J & (J - 1) or J > FP8_BLOCK):
        raise ValueError(f"precision fp8_e4m3 needs indexer.head_dim a power of two <= {FP8_BLOCK} (DeepSeek's "
                         f"Hadamard transform and one quantisation block per head): got head_dim={J}")
    query = query if isinstance(query, jax.Array) else np.asarray(query)  # a traced query under jit stays one
    dt = dtype_from_name(dtype or np.dtype(query.dtype).name)
    if dt == np.float64 or precision is not None:
        if not jax.config.jax_enable_x64:  # impl_jax.call.x64_enabled (not imported: call imports this module)
            raise ValueError("float64 (and the fp8 simulation's float64 products) needs JAX's x64 mode, which is "
                             "off: call jax.config.update('jax_enable_x64', True) first")
    query = jnp.asarray(query).astype(dt)
    key = query if key is None else jnp.asarray(key).astype(dt)
    B, T, S = query.shape[0], query.shape[1], key.shape[1]
    P = 0
    if past_index_keys is not None:
        past_index_keys = jnp.asarray(past_index_keys).astype(dt)
        if past_index_keys.ndim != 3 or past_index_keys.shape[0] != B or past_index_keys.shape[2] != ix.cache_width:
            raise ValueError(f"past_index_keys must have shape (B, P, {'2J' if ix.block_pool == GATED else 'J'}) = "
                             f"({B}, P, {ix.cache_width}): got {past_index_keys.shape}")
        P = past_index_keys.shape[1] if cache_length is None else cache_length
    tensors = {name: jnp.asarray(t).astype(dt) for name, t in tensors.items() if name.startswith(READS)}
    positions = F.default_positions(positions, P, T)
    key_positions = F.default_positions(key_positions, P, S)

    q = index_queries(config, tensors, query, positions, dt, rec)  # (B, I, T, J)
    k_new = index_keys(config, tensors, key, key_positions, dt, rec)  # (B, S, J)
    buffer = None
    if cache_length is not None:  # in place: the new rows written into the buffer (B, C, J|2J)
        buffer = jax.lax.dynamic_update_slice(past_index_keys, k_new, (0, P, 0))
        k = buffer[:, :P + S]  # (B, P+S, J|2J): a slice (the long decode row reads the buffer whole instead)
    else:
        k = k_new if past_index_keys is None else jnp.concatenate([past_index_keys, k_new], axis=1)  # (B, P+S, J|2J)
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
        qs, q_scale = quantize_fp8(hadamard(q), J, fp8_scale_format)
        ks, k_scale = quantize_fp8(hadamard(k), J, fp8_scale_format)
        qs = rec("indexer.query.fp8", qs * jnp.repeat(q_scale, J, axis=-1))
        ks = rec("indexer.key.fp8", ks * jnp.repeat(k_scale, J, axis=-1))
    score = lambda keys: scores(qs, keys, weights, ix.effective_score_scale, ix.relu, ix.per_kv_head)  # noqa: E731
    long_row = precision is None and P >= JIT_MIN_KEYS and T == 1 and not ix.per_kv_head
    if long_row and buffer is not None:  # the written buffer read whole, in blocks; its first P+S scores
        ct = compute_dtype(dt)
        x = _scores_in_blocks(qs.astype(ct), buffer.astype(ct), weights, ct.type(ix.effective_score_scale), ix.relu)
        x = rec("indexer.scores", x[..., :P + S])
    elif long_row:
        # the cache's scores and the new keys', joined: the product reads the cache where it lies (under
        # jax.jit XLA CPU otherwise writes the joined cache out once more as the product's operand)
        x = rec("indexer.scores", jnp.concatenate([score(past_index_keys), score(k_new)], axis=-1))
    else:
        x = rec("indexer.scores", score(ks))
    allowed = _allowed(mask, B, T, P + S, is_causal)  # (B|1, 1, T, P+S)
    x = rec("indexer.masked_scores", mask_scores(x, allowed))
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
        selection = expand_blocks(blocks, ix.block_size, allowed, P + S)
    result["topk_indices"] = rec("indexer.selection", selection if ix.per_kv_head else selection[:, 0])
    return result


_STATIC = ("config", "is_causal", "dtype", "precision", "fp8_scale_format", "return_scores", "cache_length")
_jitted = jax.jit(lightning_indexer, static_argnames=_STATIC)
# the in-place call: the buffer donated, so that the write lands in it (a program per P: cache_length is static,
# as the selection's width min(k, P+S) is)
_jitted_in_place = jax.jit(lightning_indexer, static_argnames=_STATIC, donate_argnames=("past_index_keys",))


def _check_index_cache(buffer, cache_length, S: int):
    """lightning_indexer's in-place index cache, checked (as impl_numpy's _index_cache_buffer): a buffer (B, C,
    J|2J) with room for the call's S keys after its first cache_length rows, cache_length a Python int (the
    shape's other checks are lightning_indexer's own)."""
    if buffer is None:
        raise ValueError("cache_length needs past_index_keys, the index cache's buffer: got past_index_keys None")
    shape = np.shape(buffer)
    if isinstance(cache_length, (bool, np.bool_)) or not isinstance(cache_length, (int, np.integer)) \
            or len(shape) != 3 or not 0 <= cache_length <= shape[1] - S:
        raise ValueError(f"cache_length must be an int in 0..C-S = 0..{shape[1] - S if len(shape) == 3 else '?'}"
                         f" (the buffer's rows less the call's {S} keys): got {cache_length!r} with past_index_keys "
                         f"{shape}")


# A long decode row over an in-place index cache reads the buffer in blocks of this many rows (_scores_in_blocks).
INDEX_BLOCK = 8192


def _scores_in_blocks(q, buffer, weights, scale, relu: bool):
    """_one_query_scores over the written buffer (B, C, J) whole -> (B, 1, 1, C), INDEX_BLOCK rows per turn of
    a fori_loop (the last block clamped back to end at C: its overlap scored twice, the same values). Why a
    loop: XLA CPU fuses the in-place write into a product that reads the whole buffer and then copies the
    buffer two or three times (compiled HLO, jax 0.10.2, P 65536, J 128: 57-64 ms of CPU for the write, the
    scores and the top-k); as a loop operand it is read where it lies: 16-19 ms, the VM above."""
    B, C, _ = buffer.shape
    block = min(INDEX_BLOCK, C)

    def body(i, out):
        start = jnp.minimum(i * block, C - block)
        rows = jax.lax.dynamic_slice_in_dim(buffer, start, block, axis=1)  # (B, block, J)
        return jax.lax.dynamic_update_slice_in_dim(out, _one_query_scores(q, rows, weights, scale, relu), start, axis=3)

    return jax.lax.fori_loop(0, -(-C // block), body, jnp.zeros((B, 1, 1, C), q.dtype))


def _gated_selection(config: AttentionConfig, tensors, query, q, cache, B: int, T: int, S: int, mask,
                     is_causal: bool, return_scores: bool, rec) -> dict:
    """impl_numpy.indexer._gated_selection in JAX."""
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
        result.update(index_scores=x, block_scores=x)
    blocks = rec("indexer.blocks", select_topk(x, ix.topk))  # (B, G, T, kb')
    result["topk_blocks"] = blocks
    selection = expand_blocks(blocks, bs, allowed, S)  # (B, G, T, min(kb' * bs, S))
    if ix.open_block:
        tail = open_block_keys(allowed, np.arange(T) + S - T, bs)  # (B|1, 1, T, bs - 1)
        tail = jnp.broadcast_to(tail, (*selection.shape[:-1], bs - 1))
        width = min(selection.shape[-1] + bs - 1, S)
        selection = left_pack(jnp.concatenate([selection, tail], axis=-1), width)
    result["topk_indices"] = rec("indexer.selection", selection if ix.per_kv_head else selection[:, 0])
    return result
