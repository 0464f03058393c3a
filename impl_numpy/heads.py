"""The stages a call runs before attention, shared by the dispatch (attention.py) and the fused core
(chunked.py): project -> [clip] -> [norm] -> split_heads -> [rope] -> [norm after rope] -> [query temperature]
-> [cache]. The call's validated arrays come
in as attention.prepare's Call; this module imports neither attention.py nor chunked.py.
"""

from __future__ import annotations

import numpy as np

from weights import AttentionConfig

from . import functional as F


def qkv_heads(config: AttentionConfig, call, rec=lambda stage, value: value, *, append: bool = True):
    """call: attention.prepare's Call. project -> [clip] -> [norm] -> split_heads -> [rope] -> [norm after rope]
    -> [temperature] -> [cache appended]: q (B, N,
    T, H), k (B, K, S_total, H), v (B, K, S_total, V) (k and v: the
    present cache). append=False: k and v are the new keys' alone (B, K, S, .)."""
    if config.kv_shared:
        return shared_heads(config, call, rec, append=append)
    p, N, K = call.params, config.num_heads, config.num_kv_heads
    q = rec("query.project", F.project(call.query, p["query.kernel"], p.get("query.bias")))  # (B, T, N*H)
    k = rec("key.project", F.project(call.key, p["key.kernel"], p.get("key.bias")))  # (B, S, K*H)
    v = rec("value.project", F.project(call.value, p["value.kernel"], p.get("value.bias")))  # (B, S, K*V)
    if config.qkv_clip is not None:
        q = rec("query.clip", F.clip(q, config.qkv_clip))
        k = rec("key.clip", F.clip(k, config.qkv_clip))
        v = rec("value.clip", F.clip(v, config.qkv_clip))
    n = config.qk_norm
    if n is not None and not n.after_rope:
        q = rec("query.norm", F.norm(q, p.get("query.norm.scale"), p.get("query.norm.bias"), n.type, n.eps, N,
                                     n.scope))
        k = rec("key.norm", F.norm(k, p.get("key.norm.scale"), p.get("key.norm.bias"), n.type, n.eps, K, n.scope))
    if config.value_norm is not None:
        vn = config.value_norm
        v = rec("value.norm", F.norm(v, p.get("value.norm.scale"), p.get("value.norm.bias"), vn.type, vn.eps, K,
                                     vn.scope))
    if config.key_multiplier != 1.0:
        k = rec("key.multiplier", F.multiply(k, config.key_multiplier))  # (B, S, K*H)
    if config.value_scale != 1.0:
        v = rec("value.scale", F.multiply(v, config.value_scale))  # (B, S, K*V)
    q = rec("query.split_heads", F.split_heads(q, N))  # (B, N, T, H)
    k = rec("key.split_heads", F.split_heads(k, K))  # (B, K, S, H)
    v = rec("value.split_heads", F.split_heads(v, K))  # (B, K, S, V)
    if config.rope is not None:
        inv_freq, factor = call.rope_tables(config)
        R, interleaved = config.rope.rotary_dim, config.rope.interleaved
        q = rec("query.rope", F.rope(q, F.rope_angles(call.positions, inv_freq, call.dtype), R, interleaved, factor))
        k = rec("key.rope", F.rope(k, F.rope_angles(call.key_positions, inv_freq, call.dtype), R, interleaved, factor))
    if n is not None and n.after_rope:  # Llama 4's rope layers: the (weightless) norm of the turned q and k
        q = rec("query.norm", F.norm_heads(q, p.get("query.norm.scale"), p.get("query.norm.bias"), n.type, n.eps,
                                           n.scope))
        k = rec("key.norm", F.norm_heads(k, p.get("key.norm.scale"), p.get("key.norm.bias"), n.type, n.eps, n.scope))
    if config.query_temperature is not None:
        t = config.query_temperature
        factor = F.temperature_factor(call.temperature_positions(config), t.beta, t.floor, t.offset, call.dtype)
        q = rec("query.temperature", F.temperature(q, factor))
    if call.cache_length is not None:  # in place: the new keys written after the P cached ones, no copy
        P, S = call.cache_length, k.shape[2]
        call.past_key[:, :, P:P + S] = k
        call.past_value[:, :, P:P + S] = v
        return q, call.past_key[:, :, :P + S], call.past_value[:, :, :P + S]  # (B, K, P+S, .) views
    if call.past_key is not None and append:  # the cache holds keys after norm and rope (as HF and ONNX store it)
        k = np.concatenate([call.past_key, k], axis=2)  # (B, K, P+S, H)
        v = np.concatenate([call.past_value, v], axis=2)  # (B, K, P+S, V)
    return q, k, v


def shared_heads(config: AttentionConfig, call, rec=lambda stage, value: value, *, append: bool = True):
    """qkv_heads of a kv_shared layer (issue 42: Gemma 3n's num_kv_shared_layers): the query's stages alone
    (project -> [norm] -> split_heads -> [rope] -> [temperature]); k and v are the given cache, its last S = T
    entries (call.shared_key / shared_value: attention.share_cache) the queries' own, as the layer that made
    them appended them; nothing is projected, normed, turned or written."""
    p, N = call.params, config.num_heads
    q = rec("query.project", F.project(call.query, p["query.kernel"], p.get("query.bias")))  # (B, T, N*H)
    n = config.qk_norm
    if n is not None:  # before RoPE (config: after_rope is refused with kv_shared)
        q = rec("query.norm", F.norm(q, p.get("query.norm.scale"), p.get("query.norm.bias"), n.type, n.eps, N,
                                     n.scope))
    q = rec("query.split_heads", F.split_heads(q, N))  # (B, N, T, H)
    if config.rope is not None:
        inv_freq, factor = call.rope_tables(config)
        R, interleaved = config.rope.rotary_dim, config.rope.interleaved
        q = rec("query.rope", F.rope(q, F.rope_angles(call.positions, inv_freq, call.dtype), R, interleaved, factor))
    if config.query_temperature is not None:
        t = config.query_temperature
        factor = F.temperature_factor(call.temperature_positions(config), t.beta, t.floor, t.offset, call.dtype)
        q = rec("query.temperature", F.temperature(q, factor))
    k, v = call.shared_key, call.shared_value  # (B, K, S, H), (B, K, S, V)
    if call.cache_length is not None:  # in place: the buffers' first P + S positions, as given
        P, S = call.cache_length, k.shape[2]
        return q, call.past_key[:, :, :P + S], call.past_value[:, :, :P + S]  # (B, K, P+S, .) views
    if call.past_key is not None and append:
        k = np.concatenate([call.past_key, k], axis=2)  # (B, K, P+S, H): the cache given, whole
        v = np.concatenate([call.past_value, v], axis=2)  # (B, K, P+S, V)
    return q, k, v
