"""Ring attention written by hand with jax.shard_map: a user's own
sequence-sharded attention, in the shape `mha verify --shard sequence:N`
calls (docs/sharding.md, "Verifying your own sharded attention"):

    attention(config, tensors, inputs, options, *, mesh) -> {"output", "grads", "not_returned"}

The function wraps its own sharding: it receives whole arrays (as an
unsharded `mha verify` function does) plus `mesh`, a jax.sharding.Mesh over
the N devices with one axis named "sequence", and returns whole arrays.
Inside, the projections run on whole arrays; then each device holds one
block of queries and one block of keys and values (by position), the key and
value blocks travel round the ring (jax.lax.ppermute, N - 1 hops), and each
device folds every block it receives into a running max, sum and numerator
(the online softmax). The block a device holds after `step` hops came from
device (me - step) mod N and covers keys src*Sb ... src*Sb + Sb - 1: the
causal mask must compare the queries with those positions.

`heads_attention` is the other kind, for `--shard heads:N` (mesh axis
"heads"): Megatron-style, each device projects with its heads' kernel
columns, attends over the whole sequence, multiplies by its rows of the
output kernel, and one jax.lax.psum sums the partial outputs before the
output bias is added, once. It splits the key/value heads with the query
heads, so it refuses num_kv_heads not divisible by N (MQA on 2 devices).

`attention_with_causal_offset_bug` is the ring with the classic bug:
every received block is masked as if it were the device's own (its keys
counted from the device's own block start). It fails the causal vectors.

Covers: the projections with or without biases, GQA and MQA, any scale,
causal in both alignments, the masked-row policies "zero" and "nan", every
dtype (16-bit inputs computed in float32, as the reference does), and the
gradients of sum(output * cotangent) by jax.vjp through the ring. Refuses
with NotImplementedError (reported "unsupported"): mask, bias, dropout,
the modern features (RoPE, cache, windows, softcap, QK-norm, sinks, packed
rows), and the masked-row policy "uniform" (its mean over every value row
needs one more collective). The attention weights are reported not returned:
no device holds a whole row of them.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

jax.config.update("jax_enable_x64", True)  # the float64 vectors need float64 arithmetic

AXIS = "sequence"  # the mesh axis `mha verify --shard sequence:N` names
HEADS = "heads"  # and `--shard heads:N`
HIGHEST = lax.Precision.HIGHEST
INPUTS = {"query", "key", "value"}
# Config fields this example does not implement, and the value that switches each off.
OFF = {"rope": None, "logit_softcap": None, "window_left": -1, "window_right": -1, "qk_norm": None, "use_sinks": False}


def _refuse(config, inputs, options, mesh, axis=AXIS) -> None:
    who = "this ring" if axis == AXIS else "heads_attention"
    if tuple(mesh.axis_names) != (axis,):
        raise NotImplementedError(f"{who} shards the {axis} only: got a mesh over {tuple(mesh.axis_names)}")
    missing = [f"{name}={config[name]!r}" for name, off in OFF.items() if config.get(name, off) != off]
    missing += [f"input {name}" for name in inputs if name not in INPUTS]
    missing += [name for name in ("return_cache",) if options.get(name)]
    if options.get("training") and config["dropout"] > 0:
        missing.append(f"dropout {config['dropout']}")
    if config["masked_row"] == "uniform" and axis == AXIS:
        missing.append("masked_row='uniform'")
    if missing:
        raise NotImplementedError(f"{who} does not implement {', '.join(missing)}")


def _ring(q, k, v, *, mesh, S, scale, causal_offset, masked_row, causal_offset_bug):
    """q (B, N, T, H), k (B, N, S, H), v (B, N, S, V), whole; -> (B, N, T, V), whole."""
    d = mesh.shape[AXIS]
    T = q.shape[2]
    Tb, Sb = -(-T // d), -(-S // d)  # block lengths; the padded tail is dropped or never visible

    def pad(x, length):
        return jnp.pad(x, ((0, 0), (0, 0), (0, length - x.shape[2]), (0, 0)))

    def body(q, k, v):  # this device's blocks: (B, N, Tb, H), (B, N, Sb, H), (B, N, Sb, V)
        me = lax.axis_index(AXIS)
        rows = me * Tb + jnp.arange(Tb)  # the global positions of this device's queries
        B, N = q.shape[:2]
        m = jnp.full((B, N, Tb), -jnp.inf, q.dtype)  # running max
        total = jnp.zeros((B, N, Tb), q.dtype)  # running sum of exp
        acc = jnp.zeros((B, N, Tb, v.shape[-1]), q.dtype)  # running numerator
        for step in range(d):
            src = (me - step) % d  # the device this key/value block started on
            cols = src * Sb + jnp.arange(Sb)  # its keys' global positions
            visible = jnp.broadcast_to(cols[None, :] < S, (Tb, Sb))  # padded keys: never
            if causal_offset is not None:
                seen = (me * Sb + jnp.arange(Sb)) if causal_offset_bug else cols
                visible &= seen[None, :] <= rows[:, None] + causal_offset
            s = scale * jnp.einsum("bnth,bnsh->bnts", q, k, precision=HIGHEST)
            s = jnp.where(visible, s, -jnp.inf)
            # the shift is a constant of the result (any shift gives the same softmax): no gradient through it
            m_new = lax.stop_gradient(jnp.maximum(m, s.max(-1)))
            shift = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # a row that has seen no key yet: exp(-inf) = 0
            p = jnp.exp(s - shift[..., None])
            rescale = jnp.exp(m - shift)
            total = total * rescale + p.sum(-1)
            acc = acc * rescale[..., None] + jnp.einsum("bnts,bnsv->bntv", p, v, precision=HIGHEST)
            m = m_new
            if step < d - 1:  # pass the block on: device i sends to i + 1
                k, v = lax.ppermute((k, v), AXIS, perm=[(i, (i + 1) % d) for i in range(d)])
        fill = 0.0 if masked_row == "zero" else jnp.nan  # a row that saw no key at all
        return jnp.where(total[..., None] > 0, acc / jnp.where(total > 0, total, 1.0)[..., None], fill)

    spec = P(None, None, AXIS, None)
    ctx = jax.shard_map(body, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec)(
        pad(q, d * Tb), pad(k, d * Sb), pad(v, d * Sb))  # (B, N, d*Tb, V)
    return ctx[:, :, :T]


def attention(config, tensors, inputs, options, *, mesh, causal_offset_bug=False):
    _refuse(config, inputs, options, mesh)
    dtype = inputs["query"].dtype
    ct = jnp.float64 if dtype == np.float64 else jnp.float32  # 16-bit inputs are computed in float32
    N, K, H = config["num_heads"], config["num_kv_heads"], config["head_dim"]
    scale = config["scale"] if config["scale"] is not None else 1.0 / math.sqrt(H)
    T, S = inputs["query"].shape[1], inputs["key"].shape[1]
    causal_offset = None
    if options.get("is_causal"):
        causal_offset = S - T if options.get("causal_alignment") == "bottom_right" else 0

    def forward(params, xq, xk, xv):
        def project(x, name):
            y = jnp.einsum("BLD,DNH->BNLH", x, params[f"{name}.kernel"], precision=HIGHEST)  # (B, heads, L, H)
            return y + params[f"{name}.bias"][None, :, None, :] if f"{name}.bias" in params else y

        q = project(xq, "query")
        k, v = (jnp.repeat(project(x, name), N // K, axis=1) for x, name in ((xk, "key"), (xv, "value")))
        ctx = _ring(q, k, v, mesh=mesh, S=S, scale=scale, causal_offset=causal_offset,
                    masked_row=config["masked_row"], causal_offset_bug=causal_offset_bug)  # (B, N, T, V)
        out = jnp.einsum("BNTV,NVO->BTO", ctx, params["output.kernel"], precision=HIGHEST)
        return out + params["output.bias"] if "output.bias" in params else out

    result = _run(forward, tensors, inputs, options, ct, dtype)
    result["not_returned"] = {"weights": "a ring holds no whole row of the attention weights"}
    return result


def heads_attention(config, tensors, inputs, options, *, mesh):
    """Heads split across the mesh's "heads" axis; the output projection row-parallel, summed once."""
    _refuse(config, inputs, options, mesh, axis=HEADS)
    d = mesh.shape[HEADS]
    N, K, H = config["num_heads"], config["num_kv_heads"], config["head_dim"]
    if N % d or K % d:
        raise NotImplementedError(f"heads_attention splits query and key/value heads alike: needs num_heads and "
                                  f"num_kv_heads divisible by {d} devices, got {N} and {K}")
    dtype = inputs["query"].dtype
    ct = jnp.float64 if dtype == np.float64 else jnp.float32
    scale = config["scale"] if config["scale"] is not None else 1.0 / math.sqrt(H)
    T, S = inputs["query"].shape[1], inputs["key"].shape[1]
    fill = {"zero": 0.0, "uniform": 1.0 / S, "nan": jnp.nan}[config["masked_row"]]
    visible = jnp.ones((T, S), bool)
    if options.get("is_causal"):
        offset = S - T if options.get("causal_alignment") == "bottom_right" else 0
        visible = jnp.arange(S)[None, :] <= jnp.arange(T)[:, None] + offset
    # each kernel and bias by its heads axis; the output bias whole on every device
    specs = {name: P() if name == "output.bias" else P(HEADS) if name.endswith(".bias") or name == "output.kernel"
             else P(None, HEADS) for name in tensors}

    def body(params, xq, xk, xv):  # this device's N/d query heads and K/d key/value heads
        def project(x, name):
            y = jnp.einsum("BLD,DNH->BNLH", x, params[f"{name}.kernel"], precision=HIGHEST)
            return y + params[f"{name}.bias"][None, :, None, :] if f"{name}.bias" in params else y

        q = project(xq, "query")
        k, v = (jnp.repeat(project(x, name), N // K, axis=1) for x, name in ((xk, "key"), (xv, "value")))
        logits = jnp.where(visible, scale * jnp.einsum("BNTH,BNSH->BNTS", q, k, precision=HIGHEST), -jnp.inf)
        top = lax.stop_gradient(logits.max(-1, keepdims=True))
        empty = ~jnp.isfinite(top)  # a row with no key to attend to
        e = jnp.exp(logits - jnp.where(empty, 0.0, top))
        w = jnp.where(empty, fill, e / jnp.where(empty, 1.0, e.sum(-1, keepdims=True)))
        ctx = jnp.einsum("BNTS,BNSV->BNTV", w, v, precision=HIGHEST)
        partial = jnp.einsum("BNTV,NVO->BTO", ctx, params["output.kernel"], precision=HIGHEST)
        out = lax.psum(partial, HEADS)  # the d partial outputs summed once, then the bias once
        return out + params["output.bias"] if "output.bias" in params else out

    forward = jax.shard_map(body, mesh=mesh, in_specs=(specs, P(), P(), P()), out_specs=P())
    return _run(forward, tensors, inputs, options, ct, dtype)


def _run(forward, tensors, inputs, options, ct, dtype) -> dict:
    """forward(params, xq, xk, xv) on the vector's arrays in the compute dtype; its gradients by jax.vjp."""
    params = {name: jnp.asarray(t, ct) for name, t in tensors.items()}
    xq, xk, xv = (jnp.asarray(inputs[name], ct) for name in ("query", "key", "value"))
    result = {"not_returned": {"weights": "this sharded call returns no attention weights"}}
    if "cotangent" not in options:
        result["output"] = np.asarray(jax.jit(forward)(params, xq, xk, xv)).astype(dtype)
        return result

    @jax.jit
    def forward_and_grads(params, xq, xk, xv, cotangent):
        out, pullback = jax.vjp(forward, params, xq, xk, xv)
        d_params, d_q, d_k, d_v = pullback(cotangent)
        return out, {**d_params, "query": d_q, "key": d_k, "value": d_v}

    out, grads = forward_and_grads(params, xq, xk, xv, jnp.asarray(options["cotangent"], ct))
    result["output"] = np.asarray(out).astype(dtype)
    result["grads"] = {name: np.asarray(g).astype(dtype) for name, g in grads.items()}
    return result


def attention_with_causal_offset_bug(config, tensors, inputs, options, *, mesh):
    """The same ring, each received key block masked as if it were the device's own block."""
    return attention(config, tensors, inputs, options, mesh=mesh, causal_offset_bug=True)
