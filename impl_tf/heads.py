"""The stages a call runs before attention: project -> [clip] -> [norm] ->
split_heads -> [rope] -> [query temperature] -> [cache] (qkv_heads,
mirroring impl_numpy/heads.py), and the write of the new keys into an
in-place cache's tf.Variables (write_cache, compiled by XLA). The call's
tensors come in as call.prepare's Call.
"""

from __future__ import annotations

from weights import AttentionConfig
from weights.rope import rope_tables

from . import functional as F
from ._keras import keras, tf
from .call import Call

ops = keras.ops


@tf.function(jit_compile=True, autograph=False)
def write_cache(past_key, past_value, k, v, start):
    """past_key[:, :, start:start+S] = k, past_value's = v, in place. Compiled
    by XLA, eagerly too: XLA updates a variable's buffer where it lies (about
    0.5 ms for a (1, 8, 65537, 128) float32 buffer), while TensorFlow's own
    sliced assign copies the buffer whole and leaves the variable copying it
    on every later read (about 150 ms each, measured). start is a tensor, so
    that one compilation serves every step."""
    S = k.shape[2]
    past_key[:, :, start:start + S].assign(k)
    past_value[:, :, start:start + S].assign(v)


def qkv_heads(config: AttentionConfig, call: Call, rec=None, *, query: bool = True, append: bool = True):
    """project -> [clip] -> [norm] -> split_heads -> [rope] -> [temperature] -> [cache appended]: q (B, N,
    T, H) (None unless `query`), k (B, K, S_total, H), v (B, K, S_total, V)
    (k and v: the present cache). rec(stage, value) records a stage.
    append=False: k and v are the new keys' alone (B, K, S, .)."""
    rec = rec or (lambda stage, value: value)
    p, N, K = call.params, config.num_heads, config.num_kv_heads
    q = rec("query.project", F.project(call.query, p["query.kernel"], p.get("query.bias"))) if query else None
    k = rec("key.project", F.project(call.key, p["key.kernel"], p.get("key.bias")))  # (B, S, K*H)
    v = rec("value.project", F.project(call.value, p["value.kernel"], p.get("value.bias")))  # (B, S, K*V)
    if config.qkv_clip is not None:
        if query:
            q = rec("query.clip", F.clip(q, config.qkv_clip))
        k = rec("key.clip", F.clip(k, config.qkv_clip))
        v = rec("value.clip", F.clip(v, config.qkv_clip))
    if config.qk_norm is not None:
        n = config.qk_norm
        if query:
            q = rec("query.norm", F.norm(q, p["query.norm.scale"], p.get("query.norm.bias"), n.type, n.eps, N,
                                         n.scope))
        k = rec("key.norm", F.norm(k, p["key.norm.scale"], p.get("key.norm.bias"), n.type, n.eps, K, n.scope))
    if query:
        q = rec("query.split_heads", F.split_heads(q, N))  # (B, N, T, H)
    k = rec("key.split_heads", F.split_heads(k, K))  # (B, K, S, H)
    v = rec("value.split_heads", F.split_heads(v, K))  # (B, K, S, V)
    if config.rope is not None:
        inv_freq, factor = rope_tables(config.rope)
        R, interleaved = config.rope.rotary_dim, config.rope.interleaved
        if query:
            q = rec("query.rope", F.rope(q, F.rope_angles(call.positions, inv_freq, call.dtype), R, interleaved,
                                         factor))
        k = rec("key.rope", F.rope(k, F.rope_angles(call.key_positions, inv_freq, call.dtype), R, interleaved, factor))
    if config.query_temperature is not None and query:
        t = config.query_temperature
        q = rec("query.temperature", F.temperature(q, F.temperature_factor(call.positions, t.beta, t.floor, t.offset,
                                                                           call.dtype)))
    if call.cache_length is not None:  # in place: the new keys written after the P cached ones
        P = call.cache_length
        write_cache(call.past_key, call.past_value, k, v, tf.constant(P, tf.int32))
        if not append:
            return q, k, v
        n = P + k.shape[2]  # read back after the write (one copy of P+S positions: the stages and chunked paths)
        return q, tf.convert_to_tensor(call.past_key)[:, :, :n], tf.convert_to_tensor(call.past_value)[:, :, :n]
    if call.past_key is not None and append:  # the cache holds keys after norm and rope (as HF and ONNX store it)
        k = ops.concatenate([call.past_key, k], axis=2)  # (B, K, P+S, H)
        v = ops.concatenate([call.past_value, v], axis=2)  # (B, K, P+S, V)
    return q, k, v
