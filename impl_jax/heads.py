"""The stages a call runs before attention, shared by the dispatch
(attention.py) and the sharded mirror (sharded.py): project -> [clip] ->
[norm] -> split_heads -> [rope] -> [norm after rope] -> [query temperature]
-> [cache] (qkv_heads, mirroring impl_numpy/heads.py; the cache: present,
which latent.py shares), and the stage names a trace of a config holds
(trace_stages). The call's arrays come in as call.prepare's Call.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from weights import AttentionConfig
from weights.call import LATENT_STAGES, STAGES, indexer_stages
from weights.rope import rope_tables

from . import functional as F
from .call import Call


def qkv_heads(config: AttentionConfig, call: Call, precision: str = "highest", rec=lambda stage, value: value, *,
              append: bool = True, whole: bool = False):
    """project -> [clip] -> [norm] -> split_heads -> [rope] -> [norm after rope] -> [temperature] -> [cache
    appended]: q (B, N, T, H), k (B, K, S_total, H), v (B, K, S_total, V) (k and v: the present cache).
    append=False: k and v are the new keys' alone (B, K, S, .). An in-place cache (call.cache_length):
    see present (whole: the buffers whole)."""
    if config.kv_shared:
        return shared_heads(config, call, precision, rec, append=append, whole=whole)
    p, N, K, pr = call.params, config.num_heads, config.num_kv_heads, precision
    q = rec("query.project", F.project(call.query, p["query.kernel"], p.get("query.bias"), pr))  # (B, T, N*H)
    k = rec("key.project", F.project(call.key, p["key.kernel"], p.get("key.bias"), pr))  # (B, S, K*H)
    v = rec("value.project", F.project(call.value, p["value.kernel"], p.get("value.bias"), pr))  # (B, S, K*V)
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
        _, factor = rope_tables(config.rope)
        R, interleaved = config.rope.rotary_dim, config.rope.interleaved
        q = rec("query.rope", F.rope(q, call.rope_angles(config, call.positions), R, interleaved, factor))
        k = rec("key.rope", F.rope(k, call.rope_angles(config, call.key_positions), R, interleaved, factor))
    if n is not None and n.after_rope:  # Llama 4's rope layers: the (weightless) norm of the turned q and k
        q = rec("query.norm", F.norm_heads(q, p.get("query.norm.scale"), p.get("query.norm.bias"), n.type, n.eps,
                                           n.scope))
        k = rec("key.norm", F.norm_heads(k, p.get("key.norm.scale"), p.get("key.norm.bias"), n.type, n.eps, n.scope))
    if config.query_temperature is not None:
        t = config.query_temperature
        factor = F.temperature_factor(call.temperature_positions(config), t.beta, t.floor, t.offset, call.dtype)
        q = rec("query.temperature", F.temperature(q, factor))
    return (q, *present(call, k, v, append=append, whole=whole))


def present(call: Call, k, v, *, append: bool = True, whole: bool = False):
    """The new keys k and values v (B, heads, S, .) with the call's cache: the present cache (B, heads,
    S_total, .), as qkv_heads returns it (a latent layer's: its latent and rotary key, latent.latent_heads).
    append=False: the new ones alone. An in-place cache (call.cache_length): written into the buffers at
    P .. P+S-1, call.past_key / past_value become the written buffers, and the result is the buffers whole
    (whole=True, or a traced P: call.allowed then hides the positions past P+S) or their first P+S
    positions."""
    if call.cache_length is not None:
        # dynamic_update_slice: written in place under jax.jit when the caller donates the buffers (a new
        # buffer otherwise, eager calls included); a traced P past C - S is clamped by XLA, not refused
        P, S = call.cache_length, k.shape[2]
        start = (0, 0, P, 0) if isinstance(P, int) else (jnp.int32(0), jnp.int32(0), P, jnp.int32(0))  # one type
        call.past_key = lax.dynamic_update_slice(call.past_key, k.astype(call.past_key.dtype), start)
        call.past_value = lax.dynamic_update_slice(call.past_value, v.astype(call.past_value.dtype), start)
        if whole or call.traced_length:
            return call.past_key, call.past_value  # (B, K, C, .): call.allowed hides the positions past P+S
        # the paths that need exactly P+S keys (the trace's and the weights' shapes, chunked.py's causal
        # offsets): a slice, which XLA CPU writes out (a copy of the cache)
        return call.past_key[:, :, :P + S], call.past_value[:, :, :P + S]  # (B, K, P+S, .)
    if call.past_key is not None and append:  # the cache holds keys after norm and rope (as HF and ONNX store it)
        k = jnp.concatenate([call.past_key, k], axis=2)  # (B, K, P+S, H)
        v = jnp.concatenate([call.past_value, v], axis=2)  # (B, K, P+S, V)
    return k, v


def trace_stages(config: AttentionConfig) -> tuple[str, ...]:
    """The stage names a trace of this config holds, in order (STAGES less
    the clip, norm, rope, temperature, softcap, alibi and gate stages the
    config does not turn on; a norm after RoPE moved after the rope stages,
    as qkv_heads records it; a latent layer's LATENT_STAGES, less the query's
    down-projection without a query rank)."""
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
    if config.qk_norm is not None and config.qk_norm.after_rope:  # after the rope stages, or split_heads
        stages = [stage for stage in stages if stage not in ("query.norm", "key.norm")]
        last = "key.rope" if config.rope is not None else "value.split_heads"
        at = stages.index(last) + 1
        stages[at:at] = ["query.norm", "key.norm"]
    return indexer_stages(config) + tuple(stages)


# -- issue 42: a kv_shared layer (mirrors impl_numpy.heads.shared_heads) ----------------------------

def shared_heads(config: AttentionConfig, call: Call, precision: str = "highest", rec=lambda stage, value: value, *,
                 append: bool = True, whole: bool = False):
    """qkv_heads of a kv_shared layer: the query's stages alone (project -> [norm] -> split_heads -> [rope] ->
    [temperature]); k and v the given cache (call.shared_key / shared_value its last S entries: call.share_cache),
    nothing projected, normed, turned or written."""
    p, N, pr = call.params, config.num_heads, precision
    q = rec("query.project", F.project(call.query, p["query.kernel"], p.get("query.bias"), pr))  # (B, T, N*H)
    n = config.qk_norm
    if n is not None:  # before RoPE (config: after_rope is refused with kv_shared)
        q = rec("query.norm", F.norm(q, p.get("query.norm.scale"), p.get("query.norm.bias"), n.type, n.eps, N,
                                     n.scope))
    q = rec("query.split_heads", F.split_heads(q, N))  # (B, N, T, H)
    if config.rope is not None:
        _, factor = rope_tables(config.rope)
        R, interleaved = config.rope.rotary_dim, config.rope.interleaved
        q = rec("query.rope", F.rope(q, call.rope_angles(config, call.positions), R, interleaved, factor))
    if config.query_temperature is not None:
        t = config.query_temperature
        factor = F.temperature_factor(call.temperature_positions(config), t.beta, t.floor, t.offset, call.dtype)
        q = rec("query.temperature", F.temperature(q, factor))
    k, v = call.shared_key, call.shared_value  # (B, K, S, H), (B, K, S, V)
    if call.cache_length is not None:  # in place: the buffers as given (whole), or their first P + S positions
        if whole:
            return q, call.past_key, call.past_value
        n = call.cache_length + k.shape[2]
        return q, call.past_key[:, :, :n], call.past_value[:, :, :n]
    if call.past_key is not None and append:
        k = jnp.concatenate([call.past_key, k], axis=2)  # (B, K, P+S, H): the cache given, whole
        v = jnp.concatenate([call.past_value, v], axis=2)  # (B, K, P+S, V)
    return q, k, v
