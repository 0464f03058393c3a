"""Multi-head latent attention (MLA; weights.config.Latent) in MLX, the stages before attention in both
forms: mirrors impl_numpy/latent.py.

The expanded form (the spec, what transformers computes) runs on the stages: the latent, cache included,
up-projected to each head's keys and values (expand). The absorbed form (DeepSeek's inference code,
FlashMLA) never expands the cache: the key up-projection folded into the query (functional.absorb_query),
one shared head of width C + R over [latent | rotary key] with the latent as values (absorbed), the value
up-projection applied to the attended latent (functional.expand_values); attention.py takes it on the
fused (mx.fast.scaled_dot_product_attention), chunked and in-place paths.
"""

from __future__ import annotations

import mlx.core as mx

from weights import AttentionConfig

from . import functional as F
from .heads import present


def latent_heads(config: AttentionConfig, call, rec=lambda stage, value: value, *, append: bool = True):
    """-> q (B, N, T, H) after RoPE (and the temperature), latent (B, 1, S_total, C) and rotary key (B, 1,
    S_total, R): the present cache (append=False: the new keys' alone, S)."""
    p, N, L = call.params, config.num_heads, config.latent
    C, R = L.kv_rank, L.rope_dim
    if L.query_rank is not None:
        qd = rec("query.down", F.project(call.query, p["query.down.kernel"], p.get("query.down.bias")))  # (B, T, Qr)
        qd = rec("query.down_norm", F.norm(qd, p["query.down.norm.scale"], None, "rms", L.eps, 1, "head"))
        q = rec("query.project", F.project(qd, p["query.kernel"], None))  # (B, T, N*H)
    else:
        q = rec("query.project", F.project(call.query, p["query.kernel"], p.get("query.bias")))  # (B, T, N*H)
    both = rec("latent.project", F.project(call.key, p["latent.kernel"], p.get("latent.bias")))  # (B, S, C+R)
    latent = rec("latent.norm", F.norm(both[..., :C], p["latent.norm.scale"], None, "rms", L.eps, 1, "head"))
    q = rec("query.split_heads", F.split_heads(q, N))  # (B, N, T, H)
    inv_freq, factor = call.rope_tables(config)
    interleaved = config.rope.interleaved
    q = rec("query.rope", F.rope_last(q, F.rope_angles(call.positions, inv_freq, call.dtype), R, interleaved,
                                      factor))
    rotary = rec("key.rope", F.rope(F.split_heads(both[..., C:], 1),
                                    F.rope_angles(call.key_positions, inv_freq, call.dtype), R, interleaved,
                                    factor))  # (B, 1, S, R): one key for every head
    if config.query_temperature is not None:
        t = config.query_temperature
        factor = F.temperature_factor(call.temperature_positions(config), t.beta, t.floor, t.offset, call.dtype)
        q = rec("query.temperature", F.temperature(q, factor))
    latent = F.split_heads(latent, 1)  # (B, 1, S, C)
    return (q, *present(call, latent, rotary, append=append))


def expand(config: AttentionConfig, call, latent, rotary, rec=lambda stage, value: value):
    """The expanded form's keys and values: the latent (B, 1, S_total, C) up-projected per head, the keys
    joined with the shared rotary key (B, 1, S_total, R). -> k (B, K, S_total, H), v (B, K, S_total, V)."""
    p, K = call.params, config.num_kv_heads
    k = rec("key.project", F.project(latent[:, 0], p["key.kernel"], None))  # (B, S_total, K*(H-R))
    v = rec("value.project", F.project(latent[:, 0], p["value.kernel"], None))  # (B, S_total, K*V)
    k = rec("key.split_heads", F.split_heads(k, K))  # (B, K, S_total, H-R)
    v = rec("value.split_heads", F.split_heads(v, K))  # (B, K, S_total, V)
    return rec("key.join", F.join_keys(k, rotary)), v


def absorbed(config: AttentionConfig, call, q, latent, rotary):
    """The absorbed form's heads: q (B, N, T, C + R) through the key up-projection, one shared key head
    [latent | rotary key] (B, 1, S_total, C + R) and the latent as its values (B, 1, S_total, C); the
    attended latent then goes through functional.expand_values."""
    q = F.absorb_query(q, call.params["key.kernel"], config.latent.rope_dim)
    return q, mx.concatenate([latent, rotary], axis=-1), latent
