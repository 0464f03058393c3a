"""The stages a call runs before attention: project -> [clip] -> [norm] ->
[value norm] -> split_heads -> [rope] -> [norm after rope] -> [query
temperature] -> [cache] (qkv_heads, mirroring impl_numpy/heads.py), a
latent layer's (latent_heads, expand_latent: impl_numpy/latent.py), and the
write of the new keys into an in-place cache's tf.Variables (write_cache,
compiled by XLA: tf_only.py, TensorFlow only). The call's tensors come in as
call.prepare's Call.
"""

from __future__ import annotations

from weights import AttentionConfig

from . import functional as F
from ._keras import TENSORFLOW, keras
from .call import IN_PLACE_UNSUPPORTED, Call

ops = keras.ops


if TENSORFLOW:
    from .tf_only import write_cache
else:
    def write_cache(past_key, past_value, k, v, start):
        raise NotImplementedError(IN_PLACE_UNSUPPORTED)


def _keep(stage, value):
    return value


def qkv_heads(config: AttentionConfig, call: Call, rec=None, *, query: bool = True, append: bool = True):
    """project -> [clip] -> [norm] -> [value norm] -> split_heads -> [rope] -> [norm after rope] ->
    [temperature] -> [cache appended]: q (B, N, T, H) (None unless `query`), k (B, K, S_total, H), v (B, K,
    S_total, V) (k and v: the present cache). rec(stage, value) records a stage.
    append=False: k and v are the new keys' alone (B, K, S, .)."""
    rec = rec or _keep
    if config.kv_shared:
        return shared_heads(config, call, rec, query=query, append=append)
    p, N, K = call.params, config.num_heads, config.num_kv_heads
    q = rec("query.project", F.project(call.query, p["query.kernel"], p.get("query.bias"))) if query else None
    k = rec("key.project", F.project(call.key, p["key.kernel"], p.get("key.bias")))  # (B, S, K*H)
    v = rec("value.project", F.project(call.value, p["value.kernel"], p.get("value.bias")))  # (B, S, K*V)
    if config.qkv_clip is not None:
        if query:
            q = rec("query.clip", F.clip(q, config.qkv_clip))
        k = rec("key.clip", F.clip(k, config.qkv_clip))
        v = rec("value.clip", F.clip(v, config.qkv_clip))
    n = config.qk_norm
    if n is not None and not n.after_rope:
        if query:
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
    if query:
        q = rec("query.split_heads", F.split_heads(q, N))  # (B, N, T, H)
    k = rec("key.split_heads", F.split_heads(k, K))  # (B, K, S, H)
    v = rec("value.split_heads", F.split_heads(v, K))  # (B, K, S, V)
    if config.rope is not None:
        inv_freq, factor = call.rope_tables(config)
        R, interleaved = config.rope.rotary_dim, config.rope.interleaved
        if query:
            q = rec("query.rope", F.rope(q, F.rope_angles(call.positions, inv_freq, call.dtype), R, interleaved,
                                         factor))
        k = rec("key.rope", F.rope(k, F.rope_angles(call.key_positions, inv_freq, call.dtype), R, interleaved, factor))
    if n is not None and n.after_rope:  # Llama 4's rope layers: the (weightless) norm of the turned q and k
        if query:
            q = rec("query.norm", F.norm_heads(q, p.get("query.norm.scale"), p.get("query.norm.bias"), n.type,
                                               n.eps, n.scope))
        k = rec("key.norm", F.norm_heads(k, p.get("key.norm.scale"), p.get("key.norm.bias"), n.type, n.eps, n.scope))
    if config.query_temperature is not None and query:
        t = config.query_temperature
        factor = F.temperature_factor(call.temperature_positions(config), t.beta, t.floor, t.offset, call.dtype)
        q = rec("query.temperature", F.temperature(q, factor))
    return q, *_cached(call, k, v, append)


def _cached(call: Call, k, v, append: bool):
    """The present cache from the new keys and values (B, heads, S, .): written after the P cached ones in an
    in-place cache (and read back unless append=False), or appended to past_key / past_value (unless
    append=False)."""
    if call.cache_length is not None:  # in place: the new keys written after the P cached ones
        P = call.cache_length
        write_cache(call.past_key, call.past_value, k, v, ops.convert_to_tensor(P, "int32"))
        if not append:
            return k, v
        n = P + k.shape[2]  # read back after the write (one copy of P+S positions: the stages and chunked paths)
        return ops.convert_to_tensor(call.past_key)[:, :, :n], ops.convert_to_tensor(call.past_value)[:, :, :n]
    if call.past_key is not None and append:  # the cache holds keys after norm and rope (as HF and ONNX store it)
        k = ops.concatenate([call.past_key, k], axis=2)  # (B, K, P+S, H)
        v = ops.concatenate([call.past_value, v], axis=2)  # (B, K, P+S, V)
    return k, v


# -- latent attention (MLA): impl_numpy/latent.py --------------------------------------

def latent_query(config: AttentionConfig, params, query, rec=None):
    """A latent layer's query projections: [query.down -> query.down_norm] -> query.project, query (B, L, D)
    -> (B, L, N*H)."""
    rec = rec or _keep
    p, L = params, config.latent
    if L.query_rank is not None:
        qd = rec("query.down", F.project(query, p["query.down.kernel"], p.get("query.down.bias")))  # (B, L, Qr)
        qd = rec("query.down_norm", F.norm(qd, p["query.down.norm.scale"], None, "rms", L.eps, 1, "head"))
        return rec("query.project", F.project(qd, p["query.kernel"], None))  # (B, L, N*H)
    return rec("query.project", F.project(query, p["query.kernel"], p.get("query.bias")))  # (B, L, N*H)


def latent_query_heads(config: AttentionConfig, params, query, positions, tables, dtype: str,
                       temperature_positions=None):
    """A latent layer's queries on rows of their own (the chunked path's query blocks): latent_query ->
    split_heads -> RoPE on each head's last R features -> [temperature]. query (B, L, D), positions (B|1,
    L), tables: Call.rope_tables' (inv_freq, attention_factor) -> (B, N, L, H). temperature_positions
    (B|1, L): what the temperature reads (Call.temperature_positions; default positions)."""
    inv_freq, factor = tables
    q = F.split_heads(latent_query(config, params, query), config.num_heads)  # (B, N, L, H)
    q = F.rope_last(q, F.rope_angles(positions, inv_freq, dtype), config.latent.rope_dim, config.rope.interleaved,
                    factor)
    if config.query_temperature is not None:
        t = config.query_temperature
        at = positions if temperature_positions is None else temperature_positions
        q = F.temperature(q, F.temperature_factor(at, t.beta, t.floor, t.offset, dtype))
    return q


def latent_heads(config: AttentionConfig, call: Call, rec=None, *, query: bool = True, append: bool = True):
    """The expanded and absorbed forms' common stages (impl_numpy.latent.latent_heads): -> q (B, N, T, H)
    after RoPE (and the temperature; None unless `query`), the latent (B, 1, S_total, C) and the rotary key
    (B, 1, S_total, R): the present cache (append=False: the new keys' alone, S)."""
    rec = rec or _keep
    p, N, L = call.params, config.num_heads, config.latent
    C, R = L.kv_rank, L.rope_dim
    q = latent_query(config, p, call.query, rec) if query else None
    both = rec("latent.project", F.project(call.key, p["latent.kernel"], p.get("latent.bias")))  # (B, S, C+R)
    latent = rec("latent.norm", F.norm(both[..., :C], p["latent.norm.scale"], None, "rms", L.eps, 1, "head"))
    inv_freq, factor = call.rope_tables(config)
    interleaved = config.rope.interleaved
    if query:
        q = rec("query.split_heads", F.split_heads(q, N))  # (B, N, T, H)
        q = rec("query.rope", F.rope_last(q, F.rope_angles(call.positions, inv_freq, call.dtype), R, interleaved,
                                          factor))
    rotary = rec("key.rope", F.rope(F.split_heads(both[..., C:], 1),
                                    F.rope_angles(call.key_positions, inv_freq, call.dtype), R, interleaved,
                                    factor))  # (B, 1, S, R): one key for every head
    if query and config.query_temperature is not None:
        t = config.query_temperature
        factor = F.temperature_factor(call.temperature_positions(config), t.beta, t.floor, t.offset, call.dtype)
        q = rec("query.temperature", F.temperature(q, factor))
    latent = F.split_heads(latent, 1)  # (B, 1, S, C)
    return q, *_cached(call, latent, rotary, append)


def expand_latent(config: AttentionConfig, call: Call, latent, rotary, rec=None):
    """The expanded form's keys and values (impl_numpy.latent.expand): the latent (B, 1, S_total, C)
    up-projected per head, the keys joined with the shared rotary key (B, 1, S_total, R).
    -> k (B, K, S_total, H), v (B, K, S_total, V)."""
    rec = rec or _keep
    p, K = call.params, config.num_kv_heads
    k = rec("key.project", F.project(latent[:, 0], p["key.kernel"], None))  # (B, S_total, K*(H-R))
    v = rec("value.project", F.project(latent[:, 0], p["value.kernel"], None))  # (B, S_total, K*V)
    k = rec("key.split_heads", F.split_heads(k, K))  # (B, K, S_total, H-R)
    v = rec("value.split_heads", F.split_heads(v, K))  # (B, K, S_total, V)
    return rec("key.join", F.join_keys(k, rotary)), v


# -- issue 42: a kv_shared layer (mirrors impl_numpy.heads.shared_heads) ----------------------------

def shared_heads(config: AttentionConfig, call: Call, rec=None, *, query: bool = True, append: bool = True):
    """qkv_heads of a kv_shared layer: the query's stages alone (project -> [norm] -> split_heads -> [rope] ->
    [temperature]); k and v the given cache (call.shared_key / shared_value its last S entries: call.share_cache),
    nothing projected, normed, turned or written."""
    rec = rec or _keep
    p, N = call.params, config.num_heads
    q = None
    if query:
        q = rec("query.project", F.project(call.query, p["query.kernel"], p.get("query.bias")))  # (B, T, N*H)
        n = config.qk_norm
        if n is not None:  # before RoPE (config: after_rope is refused with kv_shared)
            q = rec("query.norm", F.norm(q, p.get("query.norm.scale"), p.get("query.norm.bias"), n.type, n.eps, N,
                                         n.scope))
        q = rec("query.split_heads", F.split_heads(q, N))  # (B, N, T, H)
        if config.rope is not None:
            inv_freq, factor = call.rope_tables(config)
            R, interleaved = config.rope.rotary_dim, config.rope.interleaved
            q = rec("query.rope", F.rope(q, F.rope_angles(call.positions, inv_freq, call.dtype), R, interleaved,
                                         factor))
        if config.query_temperature is not None:
            t = config.query_temperature
            factor = F.temperature_factor(call.temperature_positions(config), t.beta, t.floor, t.offset, call.dtype)
            q = rec("query.temperature", F.temperature(q, factor))
    k, v = call.shared_key, call.shared_value  # (B, K, S, H), (B, K, S, V)
    if not append:
        return q, k, v
    if call.cache_length is not None:  # in place: the buffers' first P + S positions, as given
        n = call.cache_length + k.shape[2]
        return q, ops.convert_to_tensor(call.past_key)[:, :, :n], ops.convert_to_tensor(call.past_value)[:, :, :n]
    if call.past_key is not None:
        k = ops.concatenate([call.past_key, k], axis=2)  # (B, K, P+S, H): the cache given, whole
        v = ops.concatenate([call.past_value, v], axis=2)  # (B, K, P+S, V)
    return q, k, v
