"""Multi-head latent attention (MLA; weights.config.Latent) in MLX, the stages before attention in both
forms: mirrors impl_numpy/latent.py.

The expanded form (the spec, what transformers computes) runs on the stages: the latent, cache included,
up-projected to each head's keys and values (expand). The absorbed form (DeepSeek's inference code,
FlashMLA) never expands the cache: the key up-projection folded into the query (functional.absorb_query),
one shared head of width C + R over [latent | rotary key] with the latent as values (absorbed), the value
up-projection applied to the attended latent (functional.expand_values); attention.py takes it on the
fused (mx.fast.scaled_dot_product_attention), chunked and in-place paths. A one-token call over a selection
(topk_indices or the indexer's) gathers the selected rows on the fused path (gather_selected, impl_jax's way)
instead of masking the whole cache.
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


# The gather runs where the call has at least this many keys (S_total), as impl_jax's and impl_tf's
# (impl_jax.latent.GATHER_MIN_KEYS says why): the grid's selection cases (7-12 keys) keep the masked kernel.
GATHER_MIN_KEYS = 64


def gathers_selection(config: AttentionConfig, call, is_causal: bool, causal_alignment: str) -> bool:
    """impl_numpy.chunked._selected_columns's conditions in MLX (impl_jax.latent.gathers_selection's): a latent
    layer's one-token call over a selection (topk_indices or the indexer's, shared (B, 1, k) or per kv head
    (B, K, 1, k)) whose keys may be gathered instead of masked, the core's result unchanged to round-off: k
    below S_total (else nothing to drop), S_total at least GATHER_MIN_KEYS, no window, local chunks, ALiBi,
    segments, bias or dropout, causal (if at all) bottom-right, and masked_row "zero" (a fully masked row's
    "uniform" 1/S_total and "nan" fill weigh every key of S_total, and the stages' gradient of either reaches
    every value: the masked kernel keeps them)."""
    idx, S_total = call.topk, call.shapes.S_total
    return (config.latent is not None and idx is not None and call.shapes.T == 1 and idx.shape[-1] < S_total
            and S_total >= GATHER_MIN_KEYS and call.mask4 is not None and call.mask4.shape[-1] == S_total
            and call.bias4 is None and call.keep is None and call.segment_ids is None and not config.alibi
            and config.local_chunk is None and config.window_left < 0 and config.window_right < 0
            and (not is_causal or causal_alignment == "bottom_right") and config.masked_row == "zero")


def kept_slots(idx: mx.array):
    """A selection's slots (B, Ks, k) sorted, and which of them gather_selected keeps: those that select a key
    (not -1), each key once (the first of its slots; equal keys are adjacent once sorted)."""
    idx = mx.sort(idx, axis=-1)  # -1 slots first
    first = mx.concatenate([mx.ones((*idx.shape[:-1], 1), dtype=mx.bool_), idx[..., 1:] != idx[..., :-1]], axis=-1)
    return idx, (idx >= 0) & first


def selection_heads(topk: mx.array) -> mx.array:
    """The one query's selection (B, 1, k) or (B, Ks, 1, k) as (B, Ks, k) int32: Ks 1 (shared by every head), or
    one per kv head, in kv head order (query head n reads n // G)."""
    idx = topk.astype(mx.int32)
    return (idx[:, None] if idx.ndim == 3 else idx)[:, :, 0]


def gather_selected(config: AttentionConfig, call, latent, rotary):
    """The absorbed form's keys over the selected rows alone (gathers_selection; impl_jax.latent.gather_selected's
    way): each batch row's (and selection head's) k selected rows of the latent and the rotary key, by index
    (a width that does not depend on the values, so it holds under mx.compile too), sorted; a slot is kept
    where it selects a key (-1 selects none), where it is the first of its key (a key selected twice is
    selected once: the mask's meaning) and where the call's mask (the selection in it) shows the key to the
    head. The kernel over them computes what it computes over every key with the others masked (a masked
    key's weight is exactly 0). latent (B, 1, S_total, C), rotary (B, 1, S_total, R) -> latent (B, Ks, k, C),
    rotary (B, Ks, k, R), allowed (B, 1|N, 1, k); Ks: 1, or one per kv head (query head n reads n // G)."""
    idx = selection_heads(call.topk)  # (B, Ks, k)
    B, Ks, k = idx.shape
    N, S = config.num_heads, call.shapes.S_total
    idx, keep = kept_slots(idx)  # (B, Ks, k) sorted, and the slots that select a key once
    safe = mx.maximum(idx, 0)  # a dropped slot reads key 0, weight 0 (keep)
    rows = mx.arange(B, dtype=mx.int32)[:, None, None]

    def take(x):  # (B, 1, L, F) at each row's safe slots -> (B, Ks, k, F)
        L, width = x.shape[2], x.shape[3]
        flat = (safe + rows * L).reshape(B * Ks * k)
        return mx.take(x.reshape(B * L, width), flat, axis=0).reshape(B, Ks, k, width)

    M = call.mask4.shape[1]  # the mask's heads: 1, or N
    shown = mx.broadcast_to(call.mask4[:, :, :1], (B, M, 1, S)).reshape(B * M * S)
    if M == 1:  # one mask per batch row: each selection head's slots read it
        keep = keep & mx.take(shown, (safe + rows * S).reshape(B * Ks * k)).reshape(B, Ks, k)
        keep = keep if Ks == 1 else mx.repeat(keep, N // Ks, axis=1)  # (B, 1|N, k)
    else:  # per head: head n reads its kv head's selection n // G and its own mask
        G = N // Ks
        at = mx.repeat(safe, G, axis=1) + mx.arange(B * N, dtype=mx.int32).reshape(B, N, 1) * S  # (B, N, k)
        keep = mx.repeat(keep, G, axis=1) & mx.take(shown, at.reshape(B * N * k)).reshape(B, N, k)
    return take(latent), take(rotary), keep[:, :, None]
