"""A hand-written float32 port of the lightning indexer (as a port of transformers' Indexer classes would
write it), and the bugs a real port makes in it. `port(config, tensors, x, bug=None)` -> {"topk_indices",
"index_scores"[, "topk_blocks"]}; with bug=None it agrees with the spec under the selection policy
(tests/test_indexer_mutants.py), so a caught mutant is caught because of its bug.

Written independently of impl_numpy/indexer.py: RoPE through complex numbers (interleaved) or
rotate_half (half-split), the top-k through np.argsort's default (unstable) sort of the negated scores,
blocks through a per-block loop."""

from __future__ import annotations

import numpy as np

MUTANTS = {
    "pairing_swapped": "the indexer's RoPE pairing swapped (GLM-5's interleaved read as V3.2's half-split)",
    "rope_end_swapped": "RoPE on the last rotary_dim features instead of the first (MLA's order, not the indexer's)",
    "relu_dropped": "no ReLU on each head's q.k before the weighted sum",
    "causal_after_topk": "the causal mask applied after the top-k, not before: future keys take slots",
    "blocks_summed_over_heads": "MiniMax M3's blocks chosen once for every head instead of per kv head",
    "local_block_dropped": "MiniMax M3's own block not kept (local blocks ignored)",
    "weights_unscaled": "head weights without I**-0.5: every score of a query times one constant",
}
# Differences the contract admits (each passes): transformers' spare slots (masked future keys where a query
# sees fewer than k), ties broken by the higher key index.
ADMISSIBLE = {
    "spare_slots_masked": "a query's spare slots filled with masked future keys (transformers' ports)",
    "ties_to_higher_index": "equal scores broken by the higher key index",
}


def _norm(x, scale, bias, kind, eps):
    x = x.astype(np.float32)
    if kind == "layer":
        x = x - x.mean(-1, keepdims=True)
    y = x / np.sqrt((x * x).mean(-1, keepdims=True) + np.float32(eps))
    y = y * scale.astype(np.float32)
    return y if bias is None else y + bias.astype(np.float32)


def _rope(x, positions, R, interleaved, theta, first, bug):
    """x (..., L, J); RoPE on R features at the first (or last) end."""
    J = x.shape[-1]
    if bug == "rope_end_swapped":
        first = not first
    if bug == "pairing_swapped":
        interleaved = not interleaved
    part = x[..., :R] if first else x[..., J - R:]
    angle = positions[:, None].astype(np.float32) * (np.float32(theta) ** (-np.arange(0, R, 2, dtype=np.float32) / R))
    if interleaved:
        z = (part[..., 0::2] + 1j * part[..., 1::2]) * np.exp(1j * angle)
        turned = np.stack([z.real, z.imag], axis=-1).reshape(part.shape).astype(np.float32)
    else:
        cos = np.concatenate([np.cos(angle)] * 2, -1)
        sin = np.concatenate([np.sin(angle)] * 2, -1)
        half = np.concatenate([-part[..., R // 2:], part[..., :R // 2]], -1)
        turned = part * cos + half * sin
    return np.concatenate([turned, x[..., R:]] if first else [x[..., :J - R], turned], -1)


def _topk(x, k, bug):
    order = np.argsort(-x, axis=-1)[..., :k]  # unstable: ties in any order
    if bug == "ties_to_higher_index":
        order = (x.shape[-1] - 1 - np.argsort(-x[..., ::-1], axis=-1, kind="stable"))[..., :k]
    chosen = np.take_along_axis(x, order, -1)
    if bug == "spare_slots_masked":
        return order
    return np.where(chosen > -np.inf, order, -1)


def port(config, tensors, x, bug=None, *, key=None, past_index_keys=None):
    """config: AttentionConfig with an indexer; x (B, T, D) the query input; key (B, S, Dk) the new keys' input
    (default x: self-attention); past_index_keys (B, P, J) the cache's index keys (default none). The queries
    are the last T of the P + S tokens (positions P + S - T ..., bottom-right), the new keys at P .. P+S-1.
    Also returns "present_index_keys" (B, P+S, J)."""
    ix = config.indexer
    t = {k: np.asarray(v, dtype=np.float32) for k, v in tensors.items()}
    x = np.asarray(x, dtype=np.float32)
    key = x if key is None else np.asarray(key, dtype=np.float32)
    B, T, _ = x.shape
    P = 0 if past_index_keys is None else np.shape(past_index_keys)[1]
    n = P + key.shape[1]  # every key
    I, J = ix.heads, ix.head_dim
    src = x
    if ix.query_source == "latent":
        src = _norm(x @ t["query.down.kernel"] + t.get("query.down.bias", 0), t["query.down.norm.scale"], None,
                    "rms", config.latent.eps)
    q = (src @ t["indexer.query.kernel"].reshape(src.shape[-1], I * J)).reshape(B, T, I, J).transpose(0, 2, 1, 3)
    if ix.query_norm is not None:
        q = _norm(q, t["indexer.query.norm.scale"], t.get("indexer.query.norm.bias"), ix.query_norm.type,
                  ix.query_norm.eps)
    k = key @ t["indexer.key.kernel"]  # (B, S, J)
    k = _norm(k, t["indexer.key.norm.scale"], t.get("indexer.key.norm.bias"), ix.key_norm.type, ix.key_norm.eps)
    pos = np.arange(n - T, n)  # the queries: the last T tokens
    r = ix.rope
    if r is not None:  # (an indexer without RoPE: the grid's near-tie case)
        q = _rope(q, pos, r.rotary_dim, r.interleaved, r.theta, ix.rope_end == "first", bug)
        k = _rope(k, np.arange(P, n), r.rotary_dim, r.interleaved, r.theta, ix.rope_end == "first", bug)
    if past_index_keys is not None:
        k = np.concatenate([np.asarray(past_index_keys, dtype=np.float32), k], axis=1)  # (B, P+S, J)
    dots = np.einsum("bitj,bsj->bits", q, k) * np.float32(ix.effective_score_scale)
    if ix.relu and bug != "relu_dropped":
        dots = np.maximum(dots, 0)
    if ix.head_weights:
        w = x @ t["indexer.weights.kernel"]
        if bug != "weights_unscaled":
            w = w * np.float32(ix.effective_weight_scale)
        scores = np.einsum("bti,bits->bts", w, dots)[:, None]  # (B, 1, T, S)
    elif ix.per_kv_head and bug != "blocks_summed_over_heads":
        scores = dots
    else:
        scores = np.broadcast_to(dots.sum(1, keepdims=True), dots.shape) if ix.per_kv_head else dots.sum(1, keepdims=True)
    future = np.arange(n)[None, :] > np.arange(n - T, n)[:, None]
    masked = np.where(future, -np.inf, scores)
    out = {"index_scores": masked, "present_index_keys": k}
    if ix.block_size is None:
        if bug == "causal_after_topk":
            sel = _topk(scores, min(ix.topk, n), bug)
            sel = np.where(np.take_along_axis(np.broadcast_to(future, scores.shape), sel, -1), -1, sel)
        else:
            sel = _topk(masked, min(ix.topk, n), bug)
        out["topk_indices"] = sel if ix.per_kv_head else sel[:, 0]
        return out
    bs = ix.block_size
    nb = -(-n // bs)
    pooled = scores if bug == "causal_after_topk" else masked
    blocks = np.stack([pooled[..., j * bs:(j + 1) * bs].max(-1) for j in range(nb)], -1)  # (B, G, T, nb)
    if bug != "local_block_dropped":
        for t_ in range(T):
            for back in range(ix.local_blocks):
                blocks[..., t_, max((n - T + t_) // bs - back, 0)] = np.inf
    out["topk_blocks"] = _topk(blocks, min(ix.topk, nb), bug)
    out["block_scores"] = blocks
    return out
