"""Sharded attention on JAX's own engine: a jax.sharding.Mesh over N devices, shard_map inside jit.

The same call as impl_jax.adapter (NumPy in and out, the contract's inputs
and options), run across `devices` devices in one of two ways:

heads (Megatron-style tensor parallelism). The query heads are split N
ways; the key/value heads split with them when K >= N and K % N == 0, and
are replicated per group when K < N (N % K == 0; MQA is K = 1): the key and
value kernels then stay whole on every device and each device attends with
the one key/value head its query heads read. The q projection (and k, v when
they split) is column-parallel: its kernel constrained to shards by head
(NamedSharding), XLA partitions the product; each device runs the stages
(functional.py) on its heads over the whole sequence; the output projection
is row-parallel: each device multiplies its heads' context by its rows of
the output kernel and the partial outputs are summed once (lax.psum), the
output bias added once, after the sum.

sequence (context parallelism, ring attention). Queries, keys and values
(after projection, QK-norm, RoPE and the cache appended, which run per
position under XLA's partitioner before the ring) are split by position
into N blocks, the cache's positions with the new ones; each device keeps
its query block while the key and value blocks travel round the ring
(lax.ppermute, N - 1 hops), merging
each block into a running max, sum and numerator: the online-softmax rule
of chunked.py. Every mask is computed per block from the global positions
the block carries (the key block's positions travel with it), so causality
(both alignments), windows, the mask and bias inputs, segment ids, sinks
and the masked-row policy hold across blocks whatever the block order.
Block order: contiguous without causality; with causality the load-balanced
"zigzag" order: the sequence is cut into 2N chunks and device i holds chunks
i and 2N-1-i (an early and a late chunk, so every device has about the same
number of visible keys: a block that causality or a window hides from every
query a device holds is skipped, lax.cond per device). The results do not
depend on the order. A length that does not divide into the blocks is
padded: padded keys are invisible to every query, padded query rows see
no key and are dropped from the result. The mask and bias inputs
are arbitrary (T, S) arrays by contract, so each device holds their rows for
its queries (all S columns) and reads the columns of the key block it holds.

Gradients: jax.vjp of the whole sharded program (jax differentiates through
shard_map, psum and ppermute).

Devices. On CPU the devices are host devices that XLA creates when the
process starts with XLA_FLAGS=--xla_force_host_platform_device_count=N,
which must be set before JAX initialises its backend (`mha run --shard` and
`mha check --sharded` set it before importing JAX). Nothing here assumes one
host: the mesh is built from jax.devices() (every process's devices after
jax.distributed.initialize()), inputs become global arrays through
jax.make_array_from_callback (each process supplies its own shards) and the
results are replicated, read from a device of this process. On several hosts,
call jax.distributed.initialize() in each process before the first call (see
docs/sharding.md).

Refused with the reason (NotImplementedError): the trace; the weights and
dropout under sequence sharding; head counts that do not split N ways;
ALiBi, the output gate and latent attention (frontier_refusal), local
chunks under sequence sharding, past_key_positions (the cache's keys
are at 0..P-1 here) and topk_indices (not wired for a selection). The QKV clip and the query temperature run among the
stages before either core (qkv_heads), and local chunks under heads
sharding in the mask (call.allowed).
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import weights
from weights import compute_dtype
from weights.call import OPTIONAL_INPUTS
from weights.contract import check_input_values

from . import functional as F
from .adapter import cpu_compile_options
from .call import check, prepare
from .heads import qkv_heads

jax.config.update("jax_enable_x64", True)  # float64 is a conformance dtype, as in impl_jax.adapter

NAME = "jax"
KINDS = ("heads", "sequence")
AXIS = "x"  # the mesh's one axis
_ARRAYS = ("query", "key", "value", *OPTIONAL_INPUTS)
_DIFFERENTIABLE = ("query", "key", "value", "past_key", "past_value")
HIGHEST = lax.Precision.HIGHEST


# -- the mesh ------------------------------------------------------------------------

def initialize_from_environment() -> bool:
    """Join a multi-process JAX run when MHA_JAX_NUM_PROCESSES is set:
    jax.distributed.initialize(JAX_COORDINATOR_ADDRESS, MHA_JAX_NUM_PROCESSES,
    MHA_JAX_PROCESS_ID), once, before the first computation (`mha run --shard`
    calls it). Returns whether it did. Every process then sees every
    process's devices in jax.devices(), and mesh() spans them."""
    count = os.environ.get("MHA_JAX_NUM_PROCESSES")
    if not count:
        return False
    for name in ("JAX_COORDINATOR_ADDRESS", "MHA_JAX_PROCESS_ID"):
        if not os.environ.get(name):
            raise ValueError(f"{name} must be set with MHA_JAX_NUM_PROCESSES={count}: got nothing")
    # CPU devices of several processes talk through gloo (XLA's CPU client has no collectives across
    # processes otherwise); GPUs and TPUs use their own and ignore this setting
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(os.environ["JAX_COORDINATOR_ADDRESS"], num_processes=int(count),
                               process_id=int(os.environ["MHA_JAX_PROCESS_ID"]))
    return True


def mesh(devices: int) -> Mesh:
    """A one-axis Mesh over the first `devices` of jax.devices() (all processes')."""
    present = jax.devices()
    if devices > len(present):
        raise NotImplementedError(
            f"{devices} devices asked for, {len(present)} present ({present[0].platform}); on CPU start the "
            f"process with XLA_FLAGS=--xla_force_host_platform_device_count={devices} (set before JAX starts)")
    return Mesh(np.array(present[:devices]), (AXIS,))


def frontier_refusal(config, kind: str) -> str | None:
    """Why this engine cannot take the config's frontier fields, or None: neither core adds ALiBi's bias,
    gates the context or runs a latent layer (MLA), and the ring compares no positions for local chunks."""
    if getattr(config, "differential", None) is not None:  # differential attention: its own refusal
        return (f"{kind} sharding does not run differential (no core subtracts one half of the heads' context from "
                "the other): run the unsharded call")
    why = {"alibi": "no core adds ALiBi's bias", "output_gate": "no core gates the context",
           "local_chunk": "the ring compares no positions",
           "latent": "the cores take expanded heads, and the cache is the latent's",
           "indexer": "no engine runs the lightning indexer's selection",
           "rope.mrope_section": "the engines take one position per token, not multimodal RoPE's three"}
    used = [name for name, on in (("alibi", config.alibi), ("output_gate", config.output_gate is not None),
                                  ("local_chunk", kind == "sequence" and config.local_chunk is not None),
                                  ("latent", config.latent is not None),
                                  ("indexer", getattr(config, "indexer", None) is not None),
                                  ("rope.mrope_section", config.rope is not None
                                   and config.rope.mrope_section is not None)) if on]
    if getattr(config, "kv_shared", False):  # issue 42
        why["kv_shared"] = "no engine reads the shared keys from the given cache"
        used.append("kv_shared")
    if not used:
        return None
    return (f"{kind} sharding does not run {', '.join(used)} ({'; '.join(why[name] for name in used)}): run the "
            "unsharded call")


def _check_kind(kind, devices) -> None:
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}: got {kind!r}")
    if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
        raise ValueError(f"devices must be a positive integer: got {devices!r}")


def kv_split(config, devices: int) -> str:
    """How heads sharding places the key/value heads: "split" (K >= N devices,
    K % N == 0) or "replicated" (K < N, N % K == 0: each device holds the one
    key/value head of its query heads' group)."""
    Nh, K = config.num_heads, config.num_kv_heads
    if Nh % devices:
        raise NotImplementedError(f"heads sharding needs num_heads divisible by the devices: got num_heads={Nh}, "
                                  f"devices={devices}")
    if K >= devices and K % devices == 0:
        return "split"
    if K < devices and devices % K == 0:
        return "replicated"
    raise NotImplementedError(f"heads sharding needs num_kv_heads and the devices to divide one another: got "
                              f"num_kv_heads={K}, devices={devices}")


# -- heads ---------------------------------------------------------------------------

def _kv_head_index(shard, devices: int, K: int):
    """The key/value head a shard's query heads read when K < devices: shard i
    holds query heads i*N/d .. (i+1)*N/d - 1, all in group i*K // d."""
    return shard * K // devices


def _add_output_bias(partial, bias, ct):
    """The partial outputs summed over the shards, then the output bias once."""
    total = lax.psum(partial, AXIS)  # (B, T, O)
    return total if bias is None else total + bias.astype(ct)


def _heads_core(config, devices, q, k, v, allowed, bias, keep, sinks, wo, bo, dtype, return_weights):
    """One shard's heads: q (B, N/d, T, H), k and v (B, K/d or K, S, .), then
    the output projection's rows of these heads, summed over the shards."""
    if kv_split(config, devices) == "replicated":
        j = _kv_head_index(lax.axis_index(AXIS), devices, config.num_kv_heads)
        k = lax.dynamic_slice_in_dim(k, j, 1, axis=1)  # (B, 1, S, H)
        v = lax.dynamic_slice_in_dim(v, j, 1, axis=1)  # (B, 1, S, V)
    x = F.logits(q, k, config.effective_scale)  # (B, N/d, T, S)
    if config.logit_softcap is not None:
        x = F.softcap(x, config.logit_softcap)
    x = F.mask_stage(x, allowed, bias)
    w = F.softmax(x, config.masked_row, sinks)  # (B, N/d, T, S)
    ctx = F.attend(F.dropout(w, keep, config.dropout), v)  # (B, N/d, T, V)
    ctx = F.merge_heads(ctx)  # (B, T, N/d*V)
    ct = compute_dtype(dtype)
    partial = jnp.einsum(F.OUTPUT, ctx.astype(ct), wo.reshape(-1, wo.shape[-1]).astype(ct), precision=HIGHEST)
    out = _add_output_bias(partial, bo, ct).astype(dtype)  # (B, T, O)
    return (out, w) if return_weights else out


def _head_spec(a, N):
    """A rank-4 (B|1, N|1, T|1, S|1) array: split on its head axis when it has one."""
    return None if a is None else (P(None, AXIS) if a.shape[1] == N else P())


def _heads(config, call, devices, m, is_causal, alignment, return_weights):
    N = config.num_heads
    split = kv_split(config, devices) == "split"
    # column-parallel q, k, v: their kernels (and biases) sharded by head; XLA partitions the products
    by_head = {"query": True, "key": split, "value": split}
    for name, sharded in by_head.items():
        for part, spec in ((".kernel", P(None, AXIS)), (".bias", P(AXIS))):
            if sharded and name + part in call.params:
                call.params[name + part] = lax.with_sharding_constraint(call.params[name + part],
                                                                        NamedSharding(m, spec))
    p = call.params
    q, k, v = qkv_heads(config, call)
    allowed = call.allowed(config, is_causal, alignment)
    kv = P(None, AXIS) if split else P()
    args = dict(q=q, k=k, v=v, allowed=allowed, bias=call.bias4, keep=call.keep, sinks=p.get("sinks"),
                wo=p["output.kernel"], bo=p.get("output.bias"))
    specs = dict(q=P(None, AXIS), k=kv, v=kv, allowed=_head_spec(allowed, N), bias=_head_spec(call.bias4, N),
                 keep=None if call.keep is None else P(None, AXIS), sinks=None if "sinks" not in p else P(AXIS),
                 wo=P(AXIS), bo=None if "output.bias" not in p else P())
    present = {name: a for name, a in args.items() if a is not None}

    def body(a):
        return _heads_core(config, devices, a["q"], a["k"], a["v"], a.get("allowed"), a.get("bias"), a.get("keep"),
                           a.get("sinks"), a["wo"], a.get("bo"), call.dtype, return_weights)

    out_specs = (P(), P(None, AXIS)) if return_weights else P()
    result = jax.shard_map(body, mesh=m, in_specs=({n: specs[n] for n in present},), out_specs=out_specs)(present)
    out, w = result if return_weights else (result, None)
    return out, w, k, v


# -- sequence ------------------------------------------------------------------------

def block_order(length: int, devices: int, zigzag: bool) -> np.ndarray:
    """Global positions in device order, -1 for padding: (devices * block,).
    Contiguous: device i holds block i. Zigzag (causal): 2N chunks, device i
    holds chunks i and 2N-1-i."""
    parts = 2 * devices if zigzag else devices
    chunk = -(-max(length, 1) // parts)
    padded = np.arange(parts * chunk)
    padded = np.where(padded < length, padded, -1).reshape(parts, chunk)
    if zigzag:
        padded = np.concatenate([np.concatenate([padded[i], padded[parts - 1 - i]]) for i in range(devices)])
    return padded.reshape(-1).astype(np.int32)


def _block_visible(config, T, S, is_causal, alignment, qi, kj):
    """(Tb, Sb) bool: causality and windows between the global positions qi
    (Tb,) of the queries held and kj (Sb,) of the key block held (which
    travelled with it: the received block's offset). Key j is visible to
    query i iff j <= p_i and p_i - left <= j <= p_i + right, p_i = i
    (top_left) or i + S - T (bottom_right)."""
    i, j = qi[:, None], kj[None, :]
    aligned = i + (0 if alignment == "top_left" else S - T)  # (Tb, 1): p_i
    vis = jnp.ones((qi.shape[0], kj.shape[0]), bool)
    if is_causal:
        vis = vis & (j <= aligned)
    if config.window_left >= 0:
        vis = vis & (j >= aligned - config.window_left)
    if config.window_right >= 0:
        vis = vis & (j <= aligned + config.window_right)
    return vis


def _segments_visible(qseg, kseg):
    """(B|1, 1, Tb, Sb): equal segment ids."""
    return (qseg[:, :, None] == kseg[:, None, :])[:, None]


def _columns(a, kj_safe, S):
    """A rank-4 array's columns of the held key block (its last axis when it spans every key)."""
    return jnp.take(a, kj_safe, axis=3) if a.shape[3] == S else a


def _merge(m, l, acc, x, vb, ct):
    """Fold one key block into the running (max, sum, numerator): x (B, N, Tb,
    Sb) masked logits (-inf hidden), vb (B, K, Sb, V). A block whose keys are
    all hidden changes nothing: its max is -inf, and the shift of a row that
    has seen nothing yet is 0, so exp(-inf) = 0 everywhere, never NaN."""
    B, N, Tb, Sb = x.shape
    K = vb.shape[1]
    m_new = jnp.maximum(m, x.max(axis=-1, keepdims=True))  # (B, N, Tb, 1)
    m_new = lax.stop_gradient(m_new)  # softmax is shift-invariant: the shift carries no gradient
    shift = jnp.where(m_new == -jnp.inf, jnp.asarray(0, ct), m_new)
    alpha = jnp.exp(m - shift)  # rescales what came before (0 while nothing was seen)
    e = jnp.exp(x - shift)  # (B, N, Tb, Sb)
    l = l * alpha + e.sum(axis=-1, keepdims=True)
    ctx = jnp.einsum(F.ATTEND, e.reshape(B, K, N // K, Tb, Sb), vb.astype(ct), precision=HIGHEST)
    acc = acc * alpha + ctx.reshape(B, N, Tb, -1)
    return m_new, l, acc


def _ring_core(config, devices, T, S, is_causal, alignment, dtype, a):
    """One device of the ring: its query block stays, key/value blocks pass."""
    ct = compute_dtype(dtype)
    q, qi = a["q"], a["qi"]  # (B, N, Tb, H), (Tb,)
    k, v, kj = a["k"], a["v"], a["kj"]  # (B, K, Sb, H), (B, K, Sb, V), (Sb,)
    kseg = a.get("kseg")
    B, N, Tb, H = q.shape
    K, V = k.shape[1], v.shape[3]
    sinks = a.get("sinks")
    qvalid = (qi >= 0)[None, None, :, None]  # (1, 1, Tb, 1): padded rows see nothing, and get no fill
    if sinks is None:
        m = jnp.full((B, N, Tb, 1), -jnp.inf, ct)
        l = jnp.zeros((B, N, Tb, 1), ct)
    else:  # the sink starts every row: its max and a term of its sum
        s = sinks.astype(ct).reshape(1, N, 1, 1)
        m = jnp.broadcast_to(lax.stop_gradient(s), (B, N, Tb, 1))
        l = jnp.broadcast_to(jnp.exp(s - lax.stop_gradient(s)), (B, N, Tb, 1))
    acc = jnp.zeros((B, N, Tb, V), ct)
    seen = jnp.zeros((B, N, Tb, 1), bool)
    v_sum = jnp.zeros((B, K, 1, V), ct)
    qg = q.reshape(B, K, N // K, Tb, H).astype(ct)
    ring = [(i, (i + 1) % devices) for i in range(devices)]
    # the running state differs per device from the first block on: say so up front, so that a skipped
    # block's branch (which returns the state as it came) has the type of a computed one
    m, l, acc, seen = (lax.pcast(t, AXIS, to="varying") for t in (m, l, acc, seen))
    for step in range(devices):
        # causality and windows between the held positions (padding: a padded query or key sees nothing)
        structural = _block_visible(config, T, S, is_causal, alignment, qi, kj) & (qi >= 0)[:, None] & (kj >= 0)

        def fold(state, k=k, v=v, kj=kj, kseg=kseg, structural=structural):
            m, l, acc, seen = state
            kj_safe = jnp.maximum(kj, 0)
            x = jnp.einsum(F.LOGITS, qg, k.astype(ct), precision=HIGHEST).reshape(B, N, Tb, -1)
            x = x * jnp.asarray(config.effective_scale, ct)  # (B, N, Tb, Sb)
            if config.logit_softcap is not None:
                c = jnp.asarray(config.logit_softcap, ct)
                x = jnp.tanh(x / c) * c
            ok = structural[None, None]  # (1, 1, Tb, Sb)
            if "mask" in a:
                ok = ok & _columns(a["mask"], kj_safe, S)
            if "qseg" in a:
                ok = ok & _segments_visible(a["qseg"], kseg)
            if "bias" in a:
                bias = _columns(a["bias"], kj_safe, S).astype(ct)
                ok = ok & (bias > -jnp.inf)
                x = x + jnp.where(ok, bias, jnp.asarray(0, ct))
            x = jnp.where(ok, x, jnp.asarray(-jnp.inf, ct))
            m, l, acc = _merge(m, l, acc, x, v, ct)
            return m, l, acc, seen | ok.any(axis=-1, keepdims=True)

        # a block that causality or a window hides from every query held is skipped (a branch per device:
        # the zigzag order gives each device as many skipped blocks as the others)
        m, l, acc, seen = lax.cond(structural.any(), fold, lambda state: state, (m, l, acc, seen))
        v_sum = v_sum + jnp.where((kj >= 0)[None, None, :, None], v.astype(ct), 0).sum(axis=2, keepdims=True)
        if step < devices - 1:
            k, v, kj = (lax.ppermute(t, AXIS, ring) for t in (k, v, kj))
            if kseg is not None:
                kseg = lax.ppermute(kseg, AXIS, ring)
    ctx = acc / jnp.where(l == 0, jnp.asarray(1, ct), l)  # (B, N, Tb, V)
    if sinks is None:  # a row that saw no key: the masked-row policy's weights times V, as functional.softmax
        empty = ~seen & qvalid
        fill = {"zero": 0.0, "uniform": 1.0 / S, "nan": np.nan}[config.masked_row]
        # every device has seen every key block once: its v_sum is the whole sum
        v_all = jnp.broadcast_to(v_sum[:, :, None], (B, K, N // K, 1, V)).reshape(B, N, 1, V)
        ctx = jnp.where(empty, jnp.where(empty, jnp.asarray(fill, ct), 0) * v_all, ctx)
    return ctx.astype(dtype)


def _rows(a, order, axis, full):
    """Take `order`'s positions (padding: position 0) along `axis` when the axis spans the full length."""
    if a is None or a.shape[axis] != full:
        return a
    return jnp.take(a, jnp.asarray(np.maximum(order, 0)), axis=axis)


def _sequence(config, call, devices, m, is_causal, alignment):
    T, S = call.shapes.T, call.shapes.S_total
    q, k, v = qkv_heads(config, call)  # per position: XLA partitions them as the inputs are sharded
    q_order = block_order(T, devices, is_causal)
    k_order = block_order(S, devices, is_causal)
    args = {"q": _rows(q, q_order, 2, T), "qi": jnp.asarray(q_order), "k": _rows(k, k_order, 2, S),
            "v": _rows(v, k_order, 2, S), "kj": jnp.asarray(k_order)}
    specs = {"q": P(None, None, AXIS), "qi": P(AXIS), "k": P(None, None, AXIS), "v": P(None, None, AXIS),
             "kj": P(AXIS)}
    for name, a in (("mask", call.mask4), ("bias", call.bias4)):
        if a is not None:
            args[name] = _rows(a, q_order, 2, T)  # this device's query rows, every key column
            specs[name] = P(None, None, AXIS) if a.shape[2] == T else P()
    if call.segment_ids is not None:
        qseg = call.segment_ids[None] if call.segment_ids.ndim == 1 else call.segment_ids  # (B|1, T)
        kseg = call.key_segment_ids[None] if call.key_segment_ids.ndim == 1 else call.key_segment_ids  # (B|1, S)
        args["qseg"], specs["qseg"] = _rows(qseg, q_order, 1, T), P(None, AXIS)
        args["kseg"], specs["kseg"] = _rows(kseg, k_order, 1, S), P(None, AXIS)
    if "sinks" in call.params:
        args["sinks"], specs["sinks"] = call.params["sinks"], P()
    core = functools.partial(_ring_core, config, devices, T, S, is_causal, alignment, call.dtype)
    ctx = jax.shard_map(core, mesh=m, in_specs=(specs,), out_specs=P(None, None, AXIS))(args)  # (B, N, d*Tb, V)
    inverse = np.empty(T, np.int32)
    inverse[q_order[q_order >= 0]] = np.nonzero(q_order >= 0)[0]
    ctx = jnp.take(ctx, jnp.asarray(inverse), axis=2)  # (B, N, T, V) in position order
    p = call.params
    out = F.output(F.merge_heads(ctx), p["output.kernel"], p.get("output.bias"))  # (B, T, O)
    return out, k, v


# -- the call ------------------------------------------------------------------------

def _program(config, kind, devices, static, return_weights, return_cache, params, inputs, others, d_output):
    """Forward and VJP of the sharded call in one program (as impl_jax.adapter)."""
    m = mesh(devices)
    opts = dict(static)
    is_causal, alignment = opts["is_causal"], opts["causal_alignment"]

    def f(params, inputs):
        arrays = {**inputs, **others}
        call = prepare(config, params, arrays["query"], arrays.get("key"), arrays.get("value"),
                       **{n: arrays.get(n) for n in OPTIONAL_INPUTS}, return_weights=return_weights,
                       return_cache=return_cache, rng=None, precision="highest", **opts)
        if kind == "heads":
            out, w, k, v = _heads(config, call, devices, m, is_causal, alignment, return_weights)
        else:
            (out, k, v), w = _sequence(config, call, devices, m, is_causal, alignment), None
        return out, (w, (k, v) if return_cache else None)

    out, pullback, (w, cache) = jax.vjp(f, params, inputs, has_aux=True)
    d_params, d_inputs = pullback(d_output.astype(out.dtype))
    return out, w, cache, d_params, d_inputs


_STATIC = ("config", "kind", "devices", "static", "return_weights", "return_cache")


@functools.lru_cache(maxsize=8)
def _jitted(devices):
    replicated = NamedSharding(mesh(devices), P())
    # impl_jax.adapter's CPU compile options: compilation, not running, is a small call's time
    options = cpu_compile_options() if jax.devices()[0].platform == "cpu" else None
    return jax.jit(_program, static_argnums=(0, 1, 2, 3, 4, 5), out_shardings=replicated, compiler_options=options)


def _global(tree, devices):
    """Host NumPy arrays as global arrays replicated over the mesh: each process supplies its own devices' copies."""
    sharding = NamedSharding(mesh(devices), P())

    def one(x):
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

    return jax.tree_util.tree_map(one, tree)


def _local(x):
    """A replicated result as NumPy, read from one of this process's devices."""
    return np.asarray(x.addressable_data(0))


def _run(config, tensors, inputs, options, d_output, *, kind, devices):
    _check_kind(kind, devices)
    weights.validate_tensors(config, tensors)
    if kind == "heads":
        kv_split(config, devices)
    refusal = frontier_refusal(config, kind)
    if refusal:
        raise NotImplementedError(refusal)
    if inputs.get("past_key_positions") is not None:
        raise NotImplementedError("the sharded engines place a cache's keys at 0..P-1: past_key_positions is not "
                                  "taken (run the unsharded call)")
    if inputs.get("topk_indices") is not None:
        raise NotImplementedError("the sharded engines are not wired for a selection over every key (no sharded "
                                  "grid case holds one): topk_indices is not taken (run the unsharded call)")
    training = bool(options.get("training", False))
    return_weights = bool(options.get("return_weights", False))
    return_cache = bool(options.get("return_cache", False))
    if kind == "sequence" and return_weights:
        raise NotImplementedError("sequence sharding returns no attention weights: no device holds a row's weights "
                                  "(the ring merges them block by block)")
    if kind == "sequence" and training and config.dropout > 0:
        raise NotImplementedError("sequence sharding does not run dropout (a (B, N, T, S) keep-mask is the "
                                  "unsharded call's)")
    static = (("is_causal", bool(options.get("is_causal", False))),
              ("causal_alignment", options.get("causal_alignment", "top_left")),
              ("training", training), ("seed", options.get("seed")), ("dtype", options.get("dtype")))
    host = {name: np.asarray(inputs[name]) for name in _ARRAYS if inputs.get(name) is not None}
    shapes, dtype = check(config, tensors, host["query"], host.get("key"), host.get("value"),
                          **{name: host.get(name) for name in OPTIONAL_INPUTS}, return_weights=return_weights,
                          return_cache=return_cache, **dict(static))
    check_input_values(query=host["query"], key=host.get("key"), value=host.get("value"))
    if "past_key" in host:
        check_input_values(past_key=host["past_key"], past_value=host["past_value"])
    want = (shapes.B, shapes.T, config.out_dim)
    d_output = np.zeros(want, dtype) if d_output is None else np.asarray(d_output)
    if d_output.shape != want:
        raise ValueError(f"d_output must have shape (B, T, O) = {want}: got {d_output.shape}")
    params = {n: t for n, t in tensors.items()}
    differentiable = {n: host[n] for n in _DIFFERENTIABLE if n in host}
    others = {n: host[n] for n in host if n not in differentiable}
    g = _global((params, differentiable, others, d_output.astype(dtype)), devices)
    return _jitted(devices)(config, kind, devices, static, return_weights, return_cache, *g)


def forward(config, tensors, inputs, options, *, kind, devices, trace=False):
    """The sharded forward pass: a dict as impl_numpy.adapter.forward's (output, weights?, present_key/value?)."""
    if trace:
        raise NotImplementedError("a sharded call has no trace: its stages run on shards (run the unsharded call)")
    out, w, cache, _, _ = _run(config, tensors, inputs, options, None, kind=kind, devices=devices)
    answer = {"output": _local(out)}
    if w is not None:
        answer["weights"] = _local(w)
    if cache is not None:
        answer["present_key"], answer["present_value"] = (_local(x) for x in cache)
    return answer


def vjp(config, tensors, inputs, options, d_output, *, kind, devices):
    """Output and gradients (jax.vjp of the sharded program), as impl_numpy.adapter.vjp's."""
    out, _, _, d_params, d_inputs = _run(config, tensors, inputs, options, d_output, kind=kind, devices=devices)
    grads = {n: _local(d_inputs[n]) for n in ("query", "key", "value") if n in d_inputs}
    if "past_key" in d_inputs and np.asarray(inputs["past_key"]).shape[2] > 0:
        grads.update({n: _local(d_inputs[n]) for n in ("past_key", "past_value")})
    grads.update({n: _local(d_params[n]) for n in config.tensor_shapes()})
    return {"output": _local(out), "grads": grads}
