"""The stages a call runs before attention: mirrors impl_numpy/heads.py. project -> [clip] -> [norm] ->
split_heads -> [rope] -> [norm after rope] -> [query temperature] -> [cache]. The call's validated arrays
come in as call.prepare's Call; this module imports neither attention.py nor the cores.
"""

from __future__ import annotations

import mlx.core as mx

from weights import AttentionConfig
from weights.call import LATENT_STAGES, STAGES, indexer_stages

from . import functional as F


def qkv_heads(config: AttentionConfig, call, rec=lambda stage, value: value, *, append: bool = True):
    """project -> [clip] -> [norm] -> split_heads -> [rope] -> [norm after rope] -> [temperature] -> [cache
    appended]: q (B, N, T, H), k (B, K, S_total, H), v (B, K, S_total, V) (k and v: the present cache).
    append=False: k and v are the new keys' alone (B, K, S, .)."""
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
    return (q, *present(call, k, v, append=append))


def present(call, k: mx.array, v: mx.array, *, append: bool = True):
    """The new keys k and values v (B, heads, S, .) with the call's cache: the present cache (B, heads,
    S_total, .). append=False: the new ones alone. An in-place cache (call.cache_length): written into the
    caller's buffers at P .. P+S-1 (slice assignment: the caller's mx.arrays see the write), the result
    their first P+S positions."""
    if call.cache_length is not None:
        P, S = call.cache_length, k.shape[2]
        call.past_key[:, :, P:P + S] = k
        call.past_value[:, :, P:P + S] = v
        return call.past_key[:, :, :P + S], call.past_value[:, :, :P + S]  # (B, K, P+S, .)
    if call.past_key is not None and append:  # the cache holds keys after norm and rope (as HF and ONNX store it)
        k = mx.concatenate([call.past_key, k], axis=2)  # (B, K, P+S, H)
        v = mx.concatenate([call.past_value, v], axis=2)  # (B, K, P+S, V)
    return k, v


def trace_stages(config: AttentionConfig) -> tuple[str, ...]:
    """The stage names a trace of this config holds, in order (impl_jax.heads.trace_stages' rule)."""
    off = set()
    if config.qkv_clip is None:
        off |= {"query.clip", "key.clip", "value.clip"}
    if config.qk_norm is None:
        off |= {"query.norm", "key.norm"}
    if config.value_norm is None:
        off.add("value.norm")
    if config.kv_shared:  # issue 42: the query's stages alone before the logits
        off |= {"key.project", "value.project", "key.clip", "value.clip", "key.norm", "value.norm",
                "key.split_heads", "value.split_heads", "key.rope"}
    if config.key_multiplier == 1.0:
        off.add("key.multiplier")
    if config.value_scale == 1.0:
        off.add("value.scale")
    if config.rope is None:
        off |= {"query.rope", "key.rope"}
    if config.query_temperature is None:
        off.add("query.temperature")
    if config.logit_softcap is None:
        off.add("softcap")
    if not config.alibi:
        off.add("alibi")
    if config.output_gate is None:
        off |= {"gate.project", "gate"}
    if config.differential is None:
        off |= {"value.pair", "differential"}
    latent = getattr(config, "latent", None)
    if latent is not None:
        if latent.query_rank is None:
            off |= {"query.down", "query.down_norm"}
        return indexer_stages(config) + tuple(stage for stage in LATENT_STAGES if stage not in off)
    stages = [stage for stage in STAGES if stage not in off]
    if config.qk_norm is not None and config.qk_norm.after_rope:
        stages = [stage for stage in stages if stage not in ("query.norm", "key.norm")]
        last = "key.rope" if config.rope is not None else "value.split_heads"
        at = stages.index(last) + 1
        stages[at:at] = ["query.norm", "key.norm"]
    return indexer_stages(config) + tuple(stages)


# -- issue 42: a kv_shared layer (mirrors impl_numpy.heads.shared_heads) ----------------------------

def shared_heads(config: AttentionConfig, call, rec=lambda stage, value: value, *, append: bool = True):
    """qkv_heads of a kv_shared layer: the query's stages alone (project -> [norm] -> split_heads -> [rope] ->
    [temperature]); k and v the given cache (call.shared_key / shared_value its last S entries: call.share_cache),
    nothing projected, normed, turned or written."""
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
        n = call.cache_length + k.shape[2]
        return q, call.past_key[:, :, :n], call.past_value[:, :, :n]
    if call.past_key is not None and append:
        k = mx.concatenate([call.past_key, k], axis=2)  # (B, K, P+S, H): the cache given, whole
        v = mx.concatenate([call.past_value, v], axis=2)  # (B, K, P+S, V)
    return q, k, v
