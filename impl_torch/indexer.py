"""The lightning indexer in PyTorch: mirrors impl_numpy/indexer.py (same stages, same names, same einsum
strings; torch ops only). Shape letters as there: I index heads, J index head_dim, G selection groups.

The fp8 simulation quantises through torch.float8_e4m3fn (round to nearest even, as ml_dtypes' cast) after
DeepSeek's Hadamard transform; the top-k runs on the scores with the contract's tie rule (a stable sort of
the negated scores: torch.topk's order among equal scores is unspecified, so it finds the k-th score alone,
in select_topk's few-of-many path, never the order).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from weights import AttentionConfig
from weights.rope import rope_tables

from . import functional as F
from .convert import compute_dtype, torch_dtype
from .masks import causal_mask

FP8_MAX = 448.0
FP8_AMAX_FLOOR = 1e-4
FP8_BLOCK = 128
PRECISIONS = (None, "fp8_e4m3")
GATED = "gated"  # Indexer.block_pool of GLM-5.3-Flash's k-pool
# The layer's tensors the indexer reads: its own, and the query latent's (query_source "latent").
READS = ("indexer.", "query.down.")
FP8_SCALE_FORMATS = ("float", "ue8m0")


def _float8():
    """torch's float8 e4m3 type, or a ValueError saying why the simulation cannot run."""
    fp8 = getattr(torch, "float8_e4m3fn", None)
    if fp8 is None:
        raise ValueError(f"precision fp8_e4m3 needs torch.float8_e4m3fn, which torch {torch.__version__} lacks")
    return fp8


# -- stages -----------------------------------------------------------------------------------------------

def index_rope(x, angles, rotary_dim: int, interleaved: bool, attention_factor: float, end: str):
    if end == "first":
        return F.rope(x, angles, rotary_dim, interleaved, attention_factor)
    return F.rope_last(x, angles, rotary_dim, interleaved, attention_factor)


def hadamard(x: torch.Tensor) -> torch.Tensor:
    J = x.shape[-1]
    h = torch.ones((1, 1), dtype=torch.float64)
    while h.shape[0] < J:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    ct = compute_dtype(x.dtype)
    return (x.to(ct) @ (h / math.sqrt(J)).to(ct)).to(x.dtype)


def quantize_fp8(x: torch.Tensor, block: int, scale_format: str) -> tuple[torch.Tensor, torch.Tensor]:
    shape = x.shape
    xb = x.to(torch.float64).reshape(*shape[:-1], shape[-1] // block, block)  # (..., nblk, block)
    amax = torch.clamp(xb.abs().amax(dim=-1, keepdim=True), min=FP8_AMAX_FLOOR).to(torch.float32)
    scale = amax * torch.tensor(1 / FP8_MAX, dtype=torch.float32)  # float32, times the reciprocal
    if scale_format == "ue8m0":  # 2^ceil(log2 scale), exactly
        mantissa, exponent = torch.frexp(scale)
        scale = torch.ldexp(torch.ones_like(scale), torch.where(mantissa == 0.5, exponent - 1, exponent))
    scale = scale.to(torch.float64)
    q = torch.clamp(xb / scale, -FP8_MAX, FP8_MAX).to(_float8()).to(torch.float64)
    return q.reshape(shape), scale[..., 0]


# scores' keys per block where the head weights sum the heads: about this many (I T, block) dots at a time, so the
# intermediate stays in cache instead of four passes over (B, I, T, S) (the dots, their scale, ReLU, the weighted
# sum). Measured (2-core AMD EPYC VM, 2026-11-30, loaded, one thread, process CPU time, min of 7; I 64, J 128, T 1,
# 65537 keys): 30 ms in one piece, 18-20 ms in blocks of 1024-4096 keys, 19-22 at 8192. 2^19: 8192 keys at I 64,
# the whole step 30-32 ms of CPU as at 2^17 (one thread), in 9 blocks instead of 33: on a loaded machine torch's two
# threads wait for each other at every parallel region (4-5 ms each, measured: the step 1.2 s in 2^17's blocks).
SCORE_BLOCK_ELEMENTS = 2**19
SCORE_BLOCK_MIN_KEYS = 256


def scores(q, k, weights, score_scale: float, relu: bool, per_kv_head: bool):
    ct = compute_dtype(q.dtype)
    if weights is not None and not per_kv_head:
        return _weighted_scores(q, k, weights.to(ct), score_scale, relu, ct)
    dots = torch.einsum("BITJ,BSJ->BITS", q.to(ct), k.to(ct)) * score_scale  # (B, I, T, S)
    if relu:
        dots = torch.clamp(dots, min=0)
    if per_kv_head:
        return dots
    if weights is None:
        return dots.sum(dim=1, keepdim=True)  # (B, 1, T, S)
    return torch.einsum("BTI,BITS->BTS", weights.to(ct), dots)[:, None]  # (B, 1, T, S)


def _weighted_scores(q, k, weights, score_scale: float, relu: bool, ct):
    """scores' stage with head weights, einsum("BITJ,BSJ->BITS") scaled, ReLU'd, then einsum("BTI,BITS->BTS"):
    the same products and sums as matmuls, over blocks of keys (SCORE_BLOCK_ELEMENTS), each key's score from its
    own block alone. q (B, I, T, J), k (B, S, J), weights (B, T, I) in ct -> (B, 1, T, S). One query (T 1):
    _decode_scores."""
    B, I, T, J = q.shape
    S = k.shape[1]
    block = max(SCORE_BLOCK_MIN_KEYS, SCORE_BLOCK_ELEMENTS // (I * T))
    if T == 1:
        return _decode_scores(q, k, weights, score_scale, relu, ct, block)
    rows = q.to(ct).reshape(B, I * T, J)  # every head's queries as the rows of one product per batch row
    w = weights[:, :, None, :]  # (B, T, 1, I)
    parts = []
    for start in range(0, S, block):
        keys = k[:, start:start + block].to(ct).transpose(1, 2)  # (B, J, s)
        dots = torch.baddbmm(rows.new_empty(()), rows, keys, beta=0, alpha=score_scale)  # s q.k: (B, I T, s)
        if relu:
            dots = torch.clamp(dots, min=0)
        parts.append(torch.matmul(w, dots.reshape(B, I, T, -1).transpose(1, 2)))  # (B, T, 1, s)
    x = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)  # (B, T, 1, S)
    return x.reshape(B, 1, T, S)


# A decode step's weighted scores (one query) take the keys as the rows, as impl_numpy.indexer._decode_scores:
# (s, J) x (J, I) per block of keys, the scale in the product, ReLU in place, the weighted sum (s, I) x (I, 1).
# Measured (2-core AMD EPYC VM, 2026-11-30, torch 2.13 with MKL, loaded (load average 3-5), process CPU time, min
# of 10; I 64, J 128, 65537 keys): the stage 20.0 ms as (I, J) x (J, s) against 16.1-16.8 ms this way with one
# thread (blocks of 2048 to all 65537 keys alike), 52 against 21 ms with two; with the in-place index cache
# (cache_length: no join of the 34 MB cache) the whole step 29.7-30.9 -> 21.3 ms with one thread.
def _decode_scores(q, k, weights, score_scale: float, relu: bool, ct, block: int):
    """_weighted_scores for one query (T 1): q (B, I, 1, J), k (B, S, J), weights (B, 1, I) -> (B, 1, 1, S), in
    blocks of `block` keys, the keys the rows of each product."""
    B, I, _, J = q.shape
    S = k.shape[1]
    cols = q.to(ct)[:, :, 0, :].transpose(1, 2)  # (B, J, I): each head's query a column
    w = weights.transpose(1, 2)  # (B, I, 1)
    parts = []
    for start in range(0, S, block):
        keys = k[:, start:start + block].to(ct)  # (B, s, J)
        dots = torch.baddbmm(cols.new_empty(()), keys, cols, beta=0, alpha=score_scale)  # s k.q: (B, s, I)
        if relu:
            dots.clamp_(min=0)
        parts.append(torch.bmm(dots, w))  # (B, s, 1)
    x = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)  # (B, S, 1)
    return x.reshape(B, 1, 1, S)


def mask_scores(x, allowed):
    return x.masked_fill(~allowed, -math.inf)


def block_scores(x, block_size: int):
    B, G, T, S = x.shape
    nb = -(-S // block_size)
    padded = torch.full((B, G, T, nb * block_size), -math.inf, dtype=x.dtype, device=x.device)
    padded[..., :S] = x
    return padded.reshape(B, G, T, nb, block_size).amax(dim=-1)  # (B, G, T, nb)


def keep_local_blocks(x, query_slots: torch.Tensor, block_size: int, local_blocks: int):
    own = query_slots // block_size  # (T,)
    local = torch.zeros(x.shape[-2:], dtype=torch.bool, device=x.device)  # (T, nb)
    rows = torch.arange(len(own), device=x.device)
    for back in range(local_blocks):
        b = own - back
        ok = b >= 0
        local[rows[ok], b[ok]] = True
    return torch.where(local & (x > -math.inf), torch.full_like(x, math.inf), x)


def select_topk(x, k: int):
    width = min(k, x.shape[-1])
    if width * 2 < x.shape[-1] and not torch.compiler.is_compiling():  # the few of many: no sort of every score
        return _select_few(x, width)
    order = torch.sort(-x, dim=-1, stable=True).indices[..., :width]  # stable: ties keep ascending index
    chosen = torch.gather(x, -1, order)
    return torch.where(chosen > -math.inf, order, torch.full_like(order, -1))


def _select_few(x, width: int):
    """select_topk's result (the stable sort's first `width`: descending score, ties by ascending index, -1 where
    the score is -inf) without sorting the whole row. torch.topk's `width` keys are the selection itself where no
    score equal to the width-th one is left out (its choice among ties is unspecified; checked by counting that
    score in the row and in the chosen) and no NaN is among them (topk ranks NaN first, the stable sort last);
    then only they are ordered (ascending index, then stably by their negated scores). Otherwise
    _select_ties. A row of many ops over every score costs a loaded machine's two threads a wait at each
    (impl_torch.indexer's SCORE_BLOCK_ELEMENTS): here two ops read the whole row, topk and the count. Measured
    (2-core AMD EPYC VM, 2026-11-30, loaded, one thread, process CPU time): 65537 scores, width 2048: the whole
    sort 5.7 ms, torch.topk 0.8 ms."""
    vals, cols = torch.topk(x, width, dim=-1)  # (.., width), descending
    kth = vals[..., -1:]
    if torch.isnan(vals).any() or ((x == kth).sum(dim=-1, keepdim=True) != (vals == kth).sum(dim=-1, keepdim=True)).any():
        return _select_ties(x, width)
    cols = torch.sort(cols, dim=-1).values  # ascending index
    chosen = torch.gather(x, -1, cols)
    order = torch.sort(-chosen, dim=-1, stable=True).indices
    chosen, cols = torch.gather(chosen, -1, order), torch.gather(cols, -1, order)
    return torch.where(chosen > -math.inf, cols, torch.full_like(cols, -1))


def _select_ties(x, width: int):
    """_select_few where ties straddle the width-th score (or a NaN is among the chosen): every key above the
    width-th score kept and, of the keys equal to it, the first ones by index, as many as the width leaves; the
    width kept keys (ascending, nonzero's order) then sorted stably by their negated scores. A NaN score counts
    as -inf here: the stable sort puts NaN after -inf, and both give -1, so which fill the last slots does not
    show."""
    xs = torch.where(torch.isnan(x), -math.inf, x)
    kth = torch.topk(xs, width, dim=-1, sorted=False).values.amin(dim=-1, keepdim=True)  # (.., 1)
    above = xs > kth
    ties = xs == kth
    keep = above | (ties & (torch.cumsum(ties, dim=-1) <= width - above.sum(dim=-1, keepdim=True)))
    cols = keep.nonzero()[:, -1].reshape(*x.shape[:-1], width)  # each row's width keys, ascending
    chosen = torch.gather(xs, -1, cols)
    order = torch.sort(-chosen, dim=-1, stable=True).indices
    chosen, cols = torch.gather(chosen, -1, order), torch.gather(cols, -1, order)
    return torch.where(chosen > -math.inf, cols, torch.full_like(cols, -1))


def expand_blocks(blocks, block_size: int, allowed, S: int):
    B, G, T, kb = blocks.shape
    keys = (blocks[..., None] * block_size + torch.arange(block_size, device=blocks.device))
    keys = keys.reshape(B, G, T, kb * block_size)
    valid = (blocks[..., None] >= 0).expand(B, G, T, kb, block_size).reshape(keys.shape) & (keys < S)
    seen = allowed.expand(B, G, T, S)
    valid &= torch.gather(seen, -1, keys.clamp(0, S - 1))
    order = torch.sort((~valid).to(torch.int8), dim=-1, stable=True).indices[..., :min(kb * block_size, S)]
    packed = torch.gather(keys, -1, order)
    return torch.where(torch.gather(valid, -1, order), packed, torch.full_like(packed, -1))


def pooled_keys(k, gates, position, block_size: int):
    B, S, J = k.shape
    ct = compute_dtype(k.dtype)
    nb = -(-S // block_size)
    logits = torch.full((B, nb * block_size, J), -math.inf, dtype=ct, device=k.device)
    logits[:, :S] = gates.to(ct)
    logits = logits.reshape(B, nb, block_size, J) + position.to(ct)  # (B, nb, bs, J)
    p = torch.exp(logits - logits.amax(dim=2, keepdim=True))
    p = p / p.sum(dim=2, keepdim=True)  # (B, nb, bs, J): the gate over each block's slots, per feature
    padded = torch.zeros((B, nb * block_size, J), dtype=ct, device=k.device)
    padded[:, :S] = k.to(ct)
    return torch.einsum("BnbJ,BnbJ->BnJ", p, padded.reshape(B, nb, block_size, J))  # (B, nb, J)


def complete_blocks(allowed, block_size: int):
    *lead, S = allowed.shape
    nb = -(-S // block_size)
    padded = torch.zeros((*lead, nb * block_size), dtype=torch.bool, device=allowed.device)
    padded[..., :S] = allowed
    return padded.reshape(*lead, nb, block_size).all(dim=-1)


def open_block_keys(allowed, query_slots, block_size: int):
    *lead, T, S = allowed.shape
    start = (query_slots // block_size) * block_size  # (T,)
    keys = start[:, None] + torch.arange(block_size, device=allowed.device)  # (T, bs)
    seen = torch.gather(allowed, -1, keys.clamp(0, S - 1).expand(*lead, T, block_size)) & (keys < S)
    is_open = ~seen.all(dim=-1, keepdim=True)  # (B|1, 1, T, 1)
    valid = seen & is_open
    order = torch.sort((~valid).to(torch.int8), dim=-1, stable=True).indices[..., :block_size - 1]
    packed = torch.gather(keys.expand(valid.shape), -1, order)
    return torch.where(torch.gather(valid, -1, order), packed, torch.full_like(packed, -1))


def left_pack(keys, width: int):
    order = torch.sort((keys < 0).to(torch.int8), dim=-1, stable=True).indices[..., :width]
    return torch.gather(keys, -1, order)


# -- the call -----------------------------------------------------------------------------------------------

# A present index cache of at least this many bytes, on the CPU and outside autograd, is written into memory NumPy
# allocates (huge pages), as impl_torch.attention._append's present caches: (1, 65537, 128) float32, 34 MB, one
# thread, process CPU time: torch.cat 15-17 ms, the same copy into NumPy's memory 5.2 ms (2-core AMD EPYC VM,
# 2026-11-30, loaded).
HUGE_PAGE_MIN_BYTES = 4 * 2**20
_NUMPY_DTYPES = {torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64}


def _join_cache(past, new):
    """torch.cat([past, new], dim=1): the present index cache (B, P+S, J|2J), a new tensor."""
    size = past.element_size() * past.shape[0] * (past.shape[1] + new.shape[1]) * past.shape[2]
    if (torch.compiler.is_compiling() or past.device.type != "cpu" or past.dtype not in _NUMPY_DTYPES
            or new.dtype != past.dtype or size < HUGE_PAGE_MIN_BYTES
            or (torch.is_grad_enabled() and (past.requires_grad or new.requires_grad))):
        return torch.cat([past, new], dim=1)
    P = past.shape[1]
    joined = torch.from_numpy(np.empty((past.shape[0], P + new.shape[1], past.shape[2]), _NUMPY_DTYPES[past.dtype]))
    joined[:, :P] = past
    joined[:, P:] = new
    return joined


def _allowed(mask, B: int, T: int, S: int, is_causal: bool, device):
    allowed = torch.ones((1, 1, T, S), dtype=torch.bool, device=device)
    if is_causal:
        allowed = causal_mask(T, S, "bottom_right", device=device)[None, None]
    if mask is not None:
        m = torch.as_tensor(np.asarray(mask, dtype=bool), device=device)
        if m.ndim not in (2, 3, 4) or tuple(m.shape[-2:]) != (T, S) or (m.ndim == 4 and m.shape[1] != 1):
            raise ValueError(f"index mask must have shape (T, S), (B, T, S) or (B, 1, T, S) with T={T}, "
                             f"S={S} (every key, the cache's included): got {tuple(m.shape)}")
        allowed = allowed & m.reshape((1, 1, T, S) if m.ndim == 2 else (m.shape[0], 1, T, S))
    return allowed


def index_keys(config: AttentionConfig, tensors, key, key_positions, dtype, rec=lambda stage, value: value):
    ix = config.indexer
    k = rec("indexer.key.project", F.project(key, tensors["indexer.key.kernel"][:, None, :], None))  # (B, S, J)
    if ix.key_norm is not None:
        n = ix.key_norm
        k = rec("indexer.key.norm", F.norm(k, tensors.get("indexer.key.norm.scale"),
                                           tensors.get("indexer.key.norm.bias"), n.type, n.eps, 1, "head"))
    if ix.rope is not None:
        inv_freq, factor = rope_tables(ix.rope, int(key_positions.max()) if key_positions.numel() else None)
        k = index_rope(k[:, None], F.rope_angles(key_positions, inv_freq, dtype), ix.rope.rotary_dim,
                       ix.rope.interleaved, factor, ix.rope_end)[:, 0]
        k = rec("indexer.key.rope", k)
    if ix.block_pool == GATED:  # the gate logits travel with the key in the cache: (B, S, 2J)
        gates = rec("indexer.pool.gates", F.project(key, tensors["indexer.pool.gate.kernel"][:, None, :], None))
        k = torch.cat([k, gates], dim=-1)
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
        inv_freq, factor = rope_tables(ix.rope, int(positions.max()) if positions.numel() else None)
        q = rec("indexer.query.rope", index_rope(q, F.rope_angles(positions, inv_freq, dtype), ix.rope.rotary_dim,
                                                 ix.rope.interleaved, factor, ix.rope_end))
    return q  # (B, I, T, J)


def lightning_indexer(config: AttentionConfig, tensors: dict, query, key=None, *, positions=None,
                      key_positions=None, past_index_keys=None, mask=None, is_causal: bool = True,
                      dtype: str | None = None, precision: str | None = None, fp8_scale_format: str = "float",
                      return_scores: bool = False, cache_length: int | None = None, rec=lambda stage, value: value,
                      device=None) -> dict:
    """impl_numpy.indexer.lightning_indexer in torch: NumPy arrays or tensors in, tensors out.

    cache_length: an in-place index cache, as impl_numpy's: past_index_keys is the caller's buffer (B, C, J|2J),
    a torch tensor of the storage dtype on the call's device, whose first cache_length = P rows are the cache;
    the call writes the new index keys at P..P+S-1 (a slice copy) and scores over the first P+S rows without
    copying; present_index_keys is the buffer, whole. Refused (ValueError naming cache_length) without
    past_index_keys, where P+S exceeds the buffer's rows, and under autograd (a call it would record: the
    write goes into a buffer the caller reuses)."""
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
        _float8()
    if precision is not None and (J & (J - 1) or J > FP8_BLOCK):
        raise ValueError(f"precision fp8_e4m3 needs indexer.head_dim a power of two <= {FP8_BLOCK} (DeepSeek's "
                         f"Hadamard transform and one quantisation block per head): got head_dim={J}")

    def tensor(x, dt):
        return torch.as_tensor(np.asarray(x) if not isinstance(x, torch.Tensor) else x, device=device).to(dt)

    if dtype is None:
        dtype = str(query.dtype).replace("torch.", "") if isinstance(query, torch.Tensor) else np.asarray(query).dtype.name
    dt = torch_dtype(dtype)
    query = tensor(query, dt)
    key = query if key is None else tensor(key, dt)
    B, T, S = query.shape[0], query.shape[1], key.shape[1]
    P = 0
    tensors = {name: tensor(t, dt) for name, t in tensors.items() if name.startswith(READS)}
    buffer = None
    if cache_length is not None:
        buffer = _index_cache_buffer(past_index_keys, cache_length, S, dt, query.device,
                                     {"query": query, "key": key, **tensors})
        past_index_keys = buffer[:, :cache_length]
    if past_index_keys is not None:
        past_index_keys = tensor(past_index_keys, dt)
        if past_index_keys.ndim != 3 or past_index_keys.shape[0] != B or past_index_keys.shape[2] != ix.cache_width:
            raise ValueError(f"past_index_keys must have shape (B, P, {'2J' if ix.block_pool == GATED else 'J'}) = "
                             f"({B}, P, {ix.cache_width}): got {tuple(past_index_keys.shape)}")
        P = past_index_keys.shape[1]
    positions = F.default_positions(None if positions is None else tensor(positions, torch.int64), P, T, query.device)
    key_positions = F.default_positions(None if key_positions is None else tensor(key_positions, torch.int64), P, S,
                                        query.device)

    q = index_queries(config, tensors, query, positions, dt, rec)  # (B, I, T, J)
    k_new = index_keys(config, tensors, key, key_positions, dt, rec)  # (B, S, J)
    if buffer is not None:  # in place: the new rows written, the first P+S rows a view (no copy of the cache)
        _write_rows(buffer, k_new, P)
        k = buffer[:, :P + S]  # (B, P+S, J|2J)
    else:
        k = k_new if past_index_keys is None else _join_cache(past_index_keys, k_new)  # (B, P+S, J|2J)
    present = k if buffer is None else buffer  # the returned index cache: with cache_length the buffer, whole
    if ix.block_pool == GATED:
        result = _gated_selection(config, tensors, query, q, k, B, T, P + S, mask, is_causal, return_scores, rec)
        result["present_index_keys"] = present
        return result
    weights = None
    if ix.head_weights:
        ct = compute_dtype(dt)
        w = F.project(query, tensors["indexer.weights.kernel"][:, :, None], None)  # (B, T, I)
        weights = rec("indexer.weights", (w.to(ct) * ix.effective_weight_scale).to(dt))
    qs, ks = q, k
    if precision == "fp8_e4m3":
        qs, q_scale = quantize_fp8(hadamard(q), J, fp8_scale_format)
        ks, k_scale = quantize_fp8(hadamard(k), J, fp8_scale_format)
        qs = rec("indexer.query.fp8", qs * torch.repeat_interleave(q_scale, J, dim=-1))
        ks = rec("indexer.key.fp8", ks * torch.repeat_interleave(k_scale, J, dim=-1))
    x = rec("indexer.scores", scores(qs, ks, weights, ix.effective_score_scale, ix.relu, ix.per_kv_head))
    allowed = _allowed(mask, B, T, P + S, is_causal, query.device)  # (B|1, 1, T, P+S)
    x = rec("indexer.masked_scores", mask_scores(x, allowed))
    result = {"present_index_keys": present}
    if return_scores:
        result["index_scores"] = x
    if ix.block_size is None:
        selection = select_topk(x, ix.topk)  # (B, G, T, k')
    else:
        bx = block_scores(x, ix.block_size)
        if ix.local_blocks:
            slots = torch.arange(T, device=query.device) + P + S - T
            bx = keep_local_blocks(bx, slots, ix.block_size, ix.local_blocks)
        blocks = rec("indexer.blocks", select_topk(bx, ix.topk))  # (B, G, T, kb')
        result["topk_blocks"] = blocks
        if return_scores:
            result["block_scores"] = bx
        selection = expand_blocks(blocks, ix.block_size, allowed, P + S)
    result["topk_indices"] = rec("indexer.selection", selection if ix.per_kv_head else selection[:, 0])
    return result


def _write_rows(buffer: torch.Tensor, rows: torch.Tensor, start: int) -> None:
    """The in-place index cache's write: rows (B, S, J|2J) into buffer (B, C, J|2J) at start..start+S-1."""
    buffer[:, start:start + rows.shape[1]] = rows


def _index_cache_buffer(buffer, cache_length, S: int, dt: torch.dtype, device, inputs: dict) -> torch.Tensor:
    """lightning_indexer's in-place index cache, checked (impl_numpy.indexer._index_cache_buffer's checks and
    words): a torch tensor of the storage dtype on the call's device (a cast or a transfer would write a copy the
    caller never sees), (B, C, J|2J) with room for the call's S keys after its first cache_length rows, and no
    autograd recording the write (the shape's other checks are lightning_indexer's own)."""
    if buffer is None:
        raise ValueError("cache_length needs past_index_keys, the index cache's buffer: got past_index_keys None")
    if not isinstance(buffer, torch.Tensor) or buffer.dtype != dt or buffer.device != device:
        what = (f"a {type(buffer).__name__}" if not isinstance(buffer, torch.Tensor) else
                f"dtype {str(buffer.dtype).replace('torch.', '')}" if buffer.dtype != dt else f"a tensor on {buffer.device}")
        raise ValueError(f"cache_length needs past_index_keys a torch tensor of the storage dtype "
                         f"{str(dt).replace('torch.', '')} on {device}: got {what}")
    if isinstance(cache_length, (bool, np.bool_)) or not isinstance(cache_length, (int, np.integer)) \
            or buffer.ndim != 3 or not 0 <= cache_length <= buffer.shape[1] - S:
        raise ValueError(f"cache_length must be an int in 0..C-S = 0..{buffer.shape[1] - S if buffer.ndim == 3 else '?'}"
                         f" (the buffer's rows less the call's {S} keys): got {cache_length!r} with past_index_keys "
                         f"{tuple(buffer.shape)}")
    if torch.is_grad_enabled():
        asking = [name for name, t in {"past_index_keys": buffer, **inputs}.items()
                  if isinstance(t, torch.Tensor) and t.requires_grad]
        if asking:
            raise ValueError("cache_length writes past_index_keys in place, for inference only: call it under "
                             "torch.no_grad(), or pass the index cache whole (past_index_keys without cache_length) "
                             f"to differentiate through it: got {', '.join(asking)} requiring grad with gradients "
                             "enabled")
    return buffer


def _gated_selection(config: AttentionConfig, tensors, query, q, cache, B: int, T: int, S: int, mask,
                     is_causal: bool, return_scores: bool, rec) -> dict:
    """impl_numpy.indexer._gated_selection in torch."""
    ix = config.indexer
    J, bs = ix.head_dim, ix.block_size
    k, gates = cache[..., :J], cache[..., J:]
    pooled = rec("indexer.pool.keys", pooled_keys(k, gates, tensors["indexer.pool.position"], bs))  # (B, nb, J)
    weights = None
    if ix.head_weights:
        ct = compute_dtype(query.dtype)
        w = F.project(query, tensors["indexer.weights.kernel"][:, :, None], None)  # (B, T, I)
        weights = rec("indexer.weights", (w.to(ct) * ix.effective_weight_scale).to(query.dtype))
    x = rec("indexer.scores", scores(q, pooled, weights, ix.effective_score_scale, ix.relu, ix.per_kv_head))
    allowed = _allowed(mask, B, T, S, is_causal, query.device)  # (B|1, 1, T, S)
    x = rec("indexer.masked_scores", mask_scores(x, complete_blocks(allowed, bs)))  # (B, G, T, nb)
    result = {"present_index_keys": cache}
    if return_scores:
        result.update(index_scores=x, block_scores=x)
    blocks = rec("indexer.blocks", select_topk(x, ix.topk))  # (B, G, T, kb')
    result["topk_blocks"] = blocks
    selection = expand_blocks(blocks, bs, allowed, S)  # (B, G, T, min(kb' * bs, S))
    if ix.open_block:
        tail = open_block_keys(allowed, torch.arange(T, device=query.device) + S - T, bs)  # (B|1, 1, T, bs - 1)
        tail = tail.expand(*selection.shape[:-1], bs - 1)
        width = min(selection.shape[-1] + bs - 1, S)
        selection = left_pack(torch.cat([selection, tail], dim=-1), width)
    result["topk_indices"] = rec("indexer.selection", selection if ix.per_kv_head else selection[:, 0])
    return result
