"""The latent family's paths (conformance.bench.latent), one builder per framework: a latent (MLA) layer's
decode step in its two forms over a cache of P tokens, and one read of what each form reads.

  absorbed   the layer's own decode step: its public call with an in-place latent cache (cache_length=P,
             buffers (B, 1, P + 1, C) and (B, 1, P + 1, R)), which every mirror runs in the absorbed form
  expanded   the same layer decoded over a per-head cache: expanded_step below, from the framework's own
             stage functions (impl_*/functional.py), over keys (B, N, P, H) and values (B, N, P, V)
  read.*     a sum over every array the step reads: the latent cache (or the per-head one) and every
             weight of the layer, in the framework (the step's memory traffic, read once)

Both steps are in place: neither copies its cache. The absorbed step writes its new latent and rotary key
at P; the expanded one keeps its new key and value out of the cache arrays (their logits and values are
joined to the cache's, one token's worth), which spares it a write of N (H + V) values per step.
"""

from __future__ import annotations

import numpy as np

from conformance.bench.frameworks.runner import Path_, Unsupported

IN_PLACE = dict(is_causal=True, causal_alignment="bottom_right")  # the new token sees the whole cache


def expanded_step(F, concat, config, p, x, keys, values, positions, dtype):
    """One new token x (B, 1, D) at position P over a per-head cache, keys (B, N, P, H) and values (B, N, P,
    V): the latent layer's stages (impl_numpy/latent.py's expanded form) on the new token alone, its key
    and value joined to the cache's. F: a mirror's functional module; concat: its framework's join on the
    last axis. -> output (B, 1, O)."""
    L, N = config.latent, config.num_heads
    C, R = L.kv_rank, L.rope_dim
    from weights.rope import rope_tables

    inv_freq, factor = rope_tables(config.rope)
    interleaved = config.rope.interleaved
    q = F.split_heads(F.project(x, p["query.kernel"], p.get("query.bias")), N)  # (B, N, 1, H)
    both = F.project(x, p["latent.kernel"], p.get("latent.bias"))  # (B, 1, C + R)
    latent = F.norm(both[..., :C], p["latent.norm.scale"], None, "rms", L.eps, 1, "head")  # (B, 1, C)
    angles = F.rope_angles(positions, inv_freq, dtype)
    q = F.rope_last(q, angles, R, interleaved, factor)
    rotary = F.rope(F.split_heads(both[..., C:], 1), angles, R, interleaved, factor)  # (B, 1, 1, R)
    k = F.join_keys(F.split_heads(F.project(latent, p["key.kernel"], None), N), rotary)  # (B, N, 1, H)
    v = F.split_heads(F.project(latent, p["value.kernel"], None), N)  # (B, N, 1, V)
    scale = config.effective_scale
    w = F.softmax(concat([F.logits(q, keys, scale), F.logits(q, k, scale)]), config.masked_row)  # (B, N, 1, P+1)
    P = keys.shape[2]
    ctx = F.attend(w[..., :P], values) + F.attend(w[..., P:], v)  # (B, N, 1, V)
    return F.output(F.merge_heads(ctx), p["output.kernel"], p.get("output.bias"))  # (B, 1, O)


def latent_buffers(latent: np.ndarray, rotary: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The in-place cache: capacity P + 1, the first P positions the cached latent and rotary key, the last
    the step's own (each timed call writes it again, with the same values)."""
    buffers = []
    for past in (latent, rotary):
        B, one, P, W = past.shape
        buffer = np.zeros((B, one, P + 1, W), np.float32)
        buffer[:, :, :P] = past
        buffers.append(buffer)
    return buffers[0], buffers[1]


def _paths(P, absorbed, expanded, read_latent, read_expanded, mode, note) -> list[Path_]:
    out = [Path_("absorbed", "ours", mode, "forward", absorbed, note=note["absorbed"], compare=True),
           Path_("read.latent", "reference", mode, "forward", read_latent, note=note["read"])]
    if expanded is not None:
        out += [Path_("expanded", "ours", mode, "forward", expanded, note=note["expanded"], compare=True),
                Path_("read.expanded", "reference", mode, "forward", read_expanded, note=note["read"])]
    return out


def numpy_paths(device, config, tensors, x, P, latent, rotary, expanded_cache):
    """expanded_cache: (keys, values) NumPy arrays, or None (not held: the row says why)."""
    import impl_numpy.functional as F
    from impl_numpy.attention import multi_head_attention

    if device != "cpu":
        raise Unsupported("numpy runs on the CPU only")
    bk, bv = latent_buffers(latent, rotary)
    position = np.array([[P]])
    weights = list(tensors.values())
    absorbed = lambda: multi_head_attention(config, tensors, x, past_key=bk, past_value=bv,  # noqa: E731
                                            cache_length=P, **IN_PLACE)
    read_latent = lambda: [np.sum(a) for a in (bk[:, :, :P], bv[:, :, :P], *weights)]  # noqa: E731
    expanded = read_expanded = None
    if expanded_cache is not None:
        keys, values = expanded_cache
        expanded = lambda: expanded_step(F, lambda xs: np.concatenate(xs, axis=-1), config, tensors, x,  # noqa: E731
                                         keys, values, position, np.float32)
        read_expanded = lambda: [np.sum(a) for a in (keys, values, *weights)]  # noqa: E731
    nbytes = {"latent": bk[:, :, :P].nbytes + bv[:, :, :P].nbytes,
              "expanded": None if expanded_cache is None else sum(a.nbytes for a in expanded_cache)}
    note = {"absorbed": "multi_head_attention, cache_length (fused path)", "expanded": "impl_numpy.functional stages",
            "read": "np.sum over the cache and every weight"}
    return _paths(P, absorbed, expanded, read_latent, read_expanded, "eager", note), nbytes


def torch_paths(device, config, tensors, x, P, latent, rotary, expanded_cache):
    import torch

    import impl_torch.functional as F
    from impl_torch.attention import multi_head_attention

    if device != "cpu":
        raise Unsupported("the latent family runs on the CPU only")
    t = {k: torch.from_numpy(v) for k, v in tensors.items()}
    xt = torch.from_numpy(x)
    bk, bv = (torch.from_numpy(a) for a in latent_buffers(latent, rotary))  # shares the NumPy buffers
    position = torch.tensor([[P]])
    weights = list(t.values())

    def absorbed():
        with torch.no_grad():
            return multi_head_attention(config, t, xt, past_key=bk, past_value=bv, cache_length=P, use_sdpa=True,
                                        **IN_PLACE)

    def read_latent():
        return [torch.sum(a) for a in (bk[:, :, :P], bv[:, :, :P], *weights)]

    expanded = read_expanded = None
    if expanded_cache is not None:
        keys, values = (torch.from_numpy(a) for a in expanded_cache)  # no copy

        def expanded():
            with torch.no_grad():
                return expanded_step(F, lambda xs: torch.cat(xs, dim=-1), config, t, xt, keys, values, position,
                                     torch.float32)

        def read_expanded():
            return [torch.sum(a) for a in (keys, values, *weights)]

    nbytes = {"latent": sum(a[:, :, :P].numel() * a.element_size() for a in (bk, bv)),
              "expanded": None if expanded_cache is None else sum(a.nbytes for a in expanded_cache)}
    note = {"absorbed": "multi_head_attention, cache_length, use_sdpa", "expanded": "impl_torch.functional stages",
            "read": "torch.sum over the cache and every weight"}
    return _paths(P, absorbed, expanded, read_latent, read_expanded, "eager", note), nbytes


def tf_paths(device, config, tensors, x, P, latent, rotary, expanded_cache):
    from impl_tf import functional as F
    from impl_tf._keras import tf
    from impl_tf.attention import multi_head_attention

    if device != "cpu":
        raise Unsupported("the latent family runs on the CPU only")
    with tf.device("/CPU:0"):
        t = {k: tf.constant(v) for k, v in tensors.items()}
        xt = tf.constant(x)
        bk, bv = (tf.Variable(a) for a in latent_buffers(latent, rotary))
        position = tf.constant([[P]])
    weights = list(t.values())
    # Returns its output alone: a read of the variables handed out of the graph would make the next write
    # copy the buffer whole (frameworks/tf.py's decode step says the same).
    absorbed = tf.function(lambda inp, tt: multi_head_attention(config, tt, inp, past_key=bk, past_value=bv,
                                                                cache_length=P, **IN_PLACE))
    # The whole buffers (P + 1 positions): a slice of a variable would be a copy, read once more.
    read_latent = tf.function(lambda: [tf.reduce_sum(a) for a in (bk, bv, *weights)])
    expanded = read_expanded = None
    if expanded_cache is not None:
        with tf.device("/CPU:0"):
            keys, values = (tf.constant(a) for a in expanded_cache)  # a copy: the caller drops its NumPy arrays
        step = tf.function(lambda inp, tt, kk, vv: expanded_step(F, lambda xs: tf.concat(xs, axis=-1), config, tt,
                                                                 inp, kk, vv, position, "float32"))
        expanded = lambda: step(xt, t, keys, values)  # noqa: E731
        read_expanded = tf.function(lambda: [tf.reduce_sum(a) for a in (keys, values, *weights)])
    nbytes = {"latent": sum(int(np.prod(a.shape[:2])) * P * a.shape[3] * a.dtype.size for a in (bk, bv)),
              "expanded": None if expanded_cache is None else sum(
                  int(np.prod(a.shape)) * a.dtype.size for a in (keys, values))}
    note = {"absorbed": "multi_head_attention, cache_length (variables), tf.function",
            "expanded": "impl_tf.functional stages, tf.function", "read": "tf.reduce_sum, tf.function"}
    return _paths(P, lambda: absorbed(xt, t), expanded, read_latent, read_expanded, "compiled", note), nbytes


def jax_paths(device, config, tensors, x, P, latent, rotary, expanded_cache):
    import jax
    import jax.numpy as jnp

    import impl_jax.functional as F
    from impl_jax.attention import apply

    if device != "cpu":
        raise Unsupported("the latent family runs on the CPU only")
    dev = jax.devices("cpu")[0]
    p, xj = jax.device_put(tensors, dev), jax.device_put(x, dev)
    # The buffers donated to each call and the written ones kept for the next (frameworks/jax.py's decode).
    in_place = jax.jit(lambda pp, inp, k, v, length: apply(config, pp, inp, past_key=k, past_value=v,
                                                            cache_length=length, return_cache=True, **IN_PLACE),
                       donate_argnums=(2, 3))
    held = list(jax.device_put(latent_buffers(latent, rotary), dev))
    length = jnp.int32(P)

    def absorbed():
        out, held[0], held[1] = in_place(p, xj, held[0], held[1], length)
        return jax.block_until_ready(out)

    sums = jax.jit(lambda arrays: [jnp.sum(a) for a in arrays])
    weights = list(p.values())

    def read_latent():  # the whole buffers (P + 1 positions): a slice outside the program would be a copy
        return jax.block_until_ready(sums([held[0], held[1], *weights]))

    expanded = read_expanded = None
    if expanded_cache is not None:
        keys, values = jax.device_put(expanded_cache, dev)  # a copy: the caller drops its NumPy arrays
        position = jnp.array([[P]], jnp.int32)
        step = jax.jit(lambda pp, inp, kk, vv: expanded_step(F, lambda xs: jnp.concatenate(xs, axis=-1), config,
                                                             pp, inp, kk, vv, position, jnp.float32))

        def expanded():
            return jax.block_until_ready(step(p, xj, keys, values))

        def read_expanded():
            return jax.block_until_ready(sums([keys, values, *weights]))

    nbytes = {"latent": sum(a.nbytes // a.shape[2] * P for a in held),
              "expanded": None if expanded_cache is None else keys.nbytes + values.nbytes}
    note = {"absorbed": "apply, cache_length traced, buffers donated, jax.jit",
            "expanded": "impl_jax.functional stages, jax.jit", "read": "jnp.sum under jax.jit"}
    return _paths(P, absorbed, expanded, read_latent, read_expanded, "compiled", note), nbytes


BUILDERS = {"numpy": numpy_paths, "torch": torch_paths, "tf": tf_paths, "jax": jax_paths}
