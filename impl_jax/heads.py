"""The stages a call runs before attention, shared by the dispatch
(attention.py) and the sharded mirror (sharded.py): project -> [norm] ->
split_heads -> [rope] -> [cache] (qkv_heads, mirroring impl_numpy/heads.py),
and the stage names a trace of a config holds (trace_stages). The call's
arrays come in as call.prepare's Call.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from weights import AttentionConfig
from weights.call import STAGES
from weights.rope import rope_tables

from . import functional as F
from .call import Call


def qkv_heads(config: AttentionConfig, call: Call, precision: str = "highest", rec=lambda stage, value: value, *,
              append: bool = True, whole: bool = False):
    """project -> [norm] -> split_heads -> [rope] -> [cache appended]: q (B, N,
    T, H), k (B, K, S_total, H), v (B, K, S_total, V) (k and v: the
    present cache). append=False: k and v are the new keys' alone (B, K, S, .).
    An in-place cache (call.cache_length): the new keys are written into the
    buffers at P .. P+S-1, call.past_key / past_value become the written
    buffers, and k and v are the buffers whole (whole=True, or a traced P:
    call.allowed then hides the positions past P+S) or their first P+S
    positions."""
    p, N, K, pr = call.params, config.num_heads, config.num_kv_heads, precision
    q = rec("query.project", F.project(call.query, p["query.kernel"], p.get("query.bias"), pr))  # (B, T, N*H)
    k = rec("key.project", F.project(call.key, p["key.kernel"], p.get("key.bias"), pr))  # (B, S, K*H)
    v = rec("value.project", F.project(call.value, p["value.kernel"], p.get("value.bias"), pr))  # (B, S, K*V)
    if config.qk_norm is not None:
        n = config.qk_norm
        q = rec("query.norm", F.norm(q, p["query.norm.scale"], p.get("query.norm.bias"), n.type, n.eps, N, n.scope))
        k = rec("key.norm", F.norm(k, p["key.norm.scale"], p.get("key.norm.bias"), n.type, n.eps, K, n.scope))
    q = rec("query.split_heads", F.split_heads(q, N))  # (B, N, T, H)
    k = rec("key.split_heads", F.split_heads(k, K))  # (B, K, S, H)
    v = rec("value.split_heads", F.split_heads(v, K))  # (B, K, S, V)
    if config.rope is not None:
        inv_freq, factor = rope_tables(config.rope)
        R, interleaved = config.rope.rotary_dim, config.rope.interleaved
        q = rec("query.rope", F.rope(q, F.rope_angles(call.positions, inv_freq, call.dtype), R, interleaved, factor))
        k = rec("key.rope", F.rope(k, F.rope_angles(call.key_positions, inv_freq, call.dtype), R, interleaved,
                                   factor))
    if call.cache_length is not None:
        # dynamic_update_slice: written in place under jax.jit when the caller donates the buffers (a new
        # buffer otherwise, eager calls included); a traced P past C - S is clamped by XLA, not refused
        P, S = call.cache_length, k.shape[2]
        start = (0, 0, P, 0) if isinstance(P, int) else (jnp.int32(0), jnp.int32(0), P, jnp.int32(0))  # one type
        call.past_key = lax.dynamic_update_slice(call.past_key, k.astype(call.past_key.dtype), start)
        call.past_value = lax.dynamic_update_slice(call.past_value, v.astype(call.past_value.dtype), start)
        if whole or call.traced_length:
            return q, call.past_key, call.past_value  # (B, K, C, .): call.allowed hides the positions past P+S
        # the paths that need exactly P+S keys (the trace's and the weights' shapes, chunked.py's causal
        # offsets): a slice, which XLA CPU writes out (a copy of the cache)
        return q, call.past_key[:, :, :P + S], call.past_value[:, :, :P + S]  # (B, K, P+S, .)
    if call.past_key is not None and append:  # the cache holds keys after norm and rope (as HF and ONNX store it)
        k = jnp.concatenate([call.past_key, k], axis=2)  # (B, K, P+S, H)
        v = jnp.concatenate([call.past_value, v], axis=2)  # (B, K, P+S, V)
    return q, k, v


def trace_stages(config: AttentionConfig) -> tuple[str, ...]:
    """The stage names a trace of this config holds, in order (STAGES less
    the norm, rope and softcap stages the config does not turn on)."""
    off = set()
    if config.qk_norm is None:
        off |= {"query.norm", "key.norm"}
    if config.rope is None:
        off |= {"query.rope", "key.rope"}
    if config.logit_softcap is None:
        off.add("softcap")
    return tuple(stage for stage in STAGES if stage not in off)

