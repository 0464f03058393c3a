"""Exact attention over key blocks with an online softmax (no (T, S) array):
mirrors impl_numpy/chunked.py, the spec of this mode.

Queries are taken in blocks of `chunk_size` rows and keys in blocks of
`chunk_size` columns, so the largest temporary is (B, N, chunk, chunk). For
each query block a running max m, running sum l and running numerator acc are
rescaled as each key block arrives (Milakov & Gimelshein 2018, the recurrence
flash-attention uses). Key blocks that the causal mask, a window or (in an
eager call) the local chunks hide from every query of a block are skipped, as
impl_numpy/chunked.py skips them.
The result equals the stages within the tolerance policy (the same stages on
blocks, the same rounding rule).

Every feature of the config and the call: the QKV clip, QK-norm (before or
after RoPE), RoPE and the query temperature run on each query block after
its projection (all act per token); the keys and values arrive as the
present cache (heads.qkv_heads, clipped and normed there; a latent layer's
as its absorbed form's one shared head, heads.latent_heads); the softcap
follows the logits of each block, then ALiBi's bias, built block by block
from the positions; windows, local chunks and segment ids mask within a
block; sinks start each query block's running max and sum (max = the sink,
sum = 1, numerator 0), so a row that sees no key ends with a context of 0;
a latent layer's attended latent goes through value.kernel, and the output
gate multiplies each query block's context, before its heads are merged.

Beyond impl_numpy, for memory: the query projection runs block by block too
(the (B, T, N*H) queries are never held; at T = 8192, D = 512 they would be
as large as the inputs), and each query block leaves as merged heads
(B, chunk, N*V), so the caller's output projection is the only other
(B, T, ...) array.

How it runs: a Python loop over the query blocks (their number and sizes are
static) and, inside each, a tf.while_loop over the key blocks every query of
the block sees entirely (no causal mask there), then the one or two blocks on
the causal diagonal and a last partial key block. Eagerly that is plain
Python; under tf.function the graph holds one loop per query block, and each
query block waits for the block IN_FLIGHT places before it (a control
dependency): the executor runs two at a time, one per core of this 2-core
machine (a block's step keeps about 1.4 cores busy: at gpt2 74% -> 102% of
the matmul rate, at long 112% -> 138%), and memory stays at two blocks' worth.

One key block (`key_block`: logits, mask, online-softmax update, attend) is
compiled by XLA once its (B, N, chunk, chunk) scores reach XLA_MIN_BLOCK
elements: TensorFlow's CPU kernels run its (chunk x H) x (H x chunk) batched
matmuls at 20-35% of their large-matmul rate and make one pass over the block
per elementwise op; XLA fuses them (at gpt2, 2.5x faster per block). Smaller
blocks (the conformance grid) run as TensorFlow ops. Block offsets are
tensors, sliced with xla.dynamic_slice when compiled (tf.slice's offsets
would be compile-time constants: one compilation per block). Under an outer
tf.function(jit_compile=True) the whole call is one XLA program (at gpt2
about 15% slower than tf.function, which runs the projections as
TensorFlow's own matmuls).

GradientTape differentiates it as written: the running max is held constant
(the result does not depend on it), and masked positions pass no gradient,
as in the spec's backward. T and S must be known when a graph is traced (a
batch of unknown size is fine): the blocks are laid out from them.
"""

from __future__ import annotations

import math

import numpy as np

from weights.contract import check_chunk_size
from weights.rope import rope_tables as default_rope_tables

from ._keras import keras, tf
from .functional import (
    _cast,
    absorb_query,
    alibi_bias,
    clip,
    compute_dtype,
    dtype_name,
    expand_values,
    gate,
    gate_project,
    merge_heads,
    norm,
    norm_heads,
    project,
    rope,
    rope_angles,
    split_heads,
    temperature,
    temperature_factor,
)
from .heads import latent_query_heads

ops = keras.ops

IN_FLIGHT = 2  # query blocks a graph may run at once
XLA_MIN_BLOCK = 2**16  # (B, N, chunk, chunk) score elements from which a key block runs compiled by XLA


def _slice(array, begin, size, compiled: bool):
    """tf.slice with tensor offsets (begin) and static sizes (-1: the whole
    axis). Compiled by XLA, tf.slice's offsets are compile-time constants
    (one compilation per offset); xla.dynamic_slice's are not."""
    begin = tf.stack([tf.cast(b, tf.int32) for b in begin])
    if not compiled:
        return tf.slice(array, begin, size)
    from tensorflow.compiler.tf2xla.python import xla  # TensorFlow's own XLA op wrappers

    size = tf.stack([tf.shape(array)[i] if n == -1 else n for i, n in enumerate(size)])
    if not array.dtype.is_floating:
        return xla.dynamic_slice(array, begin, size)  # a mask: no gradient

    @tf.custom_gradient
    def sliced(x):  # XlaDynamicSlice has no registered gradient: the slice's, written out
        def grad(dy):
            return xla.dynamic_update_slice(tf.zeros_like(x), dy, begin)

        return xla.dynamic_slice(x, begin, size), grad

    return sliced(array)


def _block(array, T: int, S: int, t0, tb: int, s0, sb: int, compiled: bool = False):
    """The (t0:t0+tb, s0:s0+sb) block of a rank-4 array broadcastable to
    (B, N, T, S); an axis of size 1 is broadcast and kept whole. t0 and s0
    are int32 scalars (tensors); the sizes are static."""
    if array is None:
        return None
    full_t, full_s = array.shape[2] != 1 or T == 1, array.shape[3] != 1 or S == 1
    begin = [0, 0, t0 if full_t else 0, s0 if full_s else 0]
    return _slice(array, begin, [-1, -1, tb if full_t else 1, sb if full_s else 1], compiled)


def key_block(m, l, acc, qg, kc, vc, t0, s0, mask4, bias, keep, q_ids=None, k_ids=None, slopes=None, q_pos=None,
              k_pos=None, *, T: int, S: int, tb: int, sb: int, causal: bool, offset: int, rate: float, dtype: str,
              compiled: bool = False, left: int = -1, right: int = -1, cap: float | None = None,
              chunk: int | None = None, alibi_rounding: str | None = None):
    """One key block s0 <= s < s0 + sb into the running (m, l, acc) of the query
    block t0 <= t < t0 + tb: functional.py's stages on a (B, N, tb, sb) block.

    qg (B, K, G*tb, H) scaled queries and kc (B, K, S, H), vc (B, K, S, V) in
    the compute dtype; t0, s0 int32 scalars; mask4 / bias / keep the call's
    rank-4 arrays (or None); q_ids (B|1, T), k_ids (B|1, S) segment ids (or
    None). slopes (N,) in the compute dtype with q_pos (B|1, T) and every
    key's k_pos (B|1, S): ALiBi's bias on the block, after the softcap
    (functional.alibi); chunk (config.local_chunk) with the same positions:
    the local chunk mask. causal, left, right: apply the causal mask and a
    window of that many keys left / right (-1: none) to the block (one that
    crosses the diagonal or a window's edge; key_plan says which). cap: the
    logit softcap.
    Stage results are rounded to the storage `dtype` as in impl_numpy.
    compiled: traced for XLA (the offsets then slice with xla.dynamic_slice).
    LOGITS and ATTEND are matmuls on the grouped queries, as impl_numpy's
    chunked mode writes them (XLA runs them 1.3-1.7x faster than the 5-D
    einsum's dot)."""
    ct = qg.dtype
    B, K, G = ops.shape(qg)[0], qg.shape[1], qg.shape[2] // tb
    N, V = K * G, vc.shape[-1]
    neg_inf = tf.constant(-math.inf, ct)

    def round_(x):
        return _cast(_cast(x, dtype), ct) if ct != dtype else x

    def both(a, b):
        return b if a is None else ops.logical_and(a, b)

    kb = _slice(kc, [0, 0, s0, 0], [-1, -1, sb, -1], compiled)  # (B, K, sb, H)
    vb = _slice(vc, [0, 0, s0, 0], [-1, -1, sb, -1], compiled)  # (B, K, sb, V)
    x = round_(ops.reshape(tf.matmul(qg, kb, transpose_b=True), (B, N, tb, sb)))  # (B, N, tb, sb), scaled
    if cap is not None:  # functional.softcap, before mask and bias
        c = tf.constant(cap, ct)
        x = round_(tf.tanh(x / c) * c)
    if slopes is not None or chunk is not None:
        qp = _slice(q_pos, [0, t0], [-1, tb], compiled)  # (B|1, tb)
        kp = _slice(k_pos, [0, s0], [-1, sb], compiled)  # (B|1, sb)
    if slopes is not None and alibi_rounding is not None:  # Falcon-RW's rounded key form (functional.alibi_bias)
        x = round_(x + alibi_bias(slopes, qp, kp, ct, alibi_rounding))
    elif slopes is not None:  # functional.alibi, after the softcap and before the mask
        distance = _cast(ops.abs(qp[:, :, None] - kp[:, None, :]), ct)[:, None]  # (B|1, 1, tb, sb)
        x = round_(x - ops.reshape(slopes, (1, N, 1, 1)) * distance)
    allowed = _block(mask4, T, S, t0, tb, s0, sb, compiled)
    if bias is not None:
        bb = _block(bias, T, S, t0, tb, s0, sb, compiled)
        x = round_(x + bb)
        allowed = both(allowed, bb > neg_inf)  # a -inf bias masks, and passes no gradient (the spec's backward)
    if causal or left >= 0 or right >= 0:
        aligned = (tf.range(tb) + t0)[:, None] + offset  # (tb, 1): the rows' aligned positions
        j = (tf.range(sb) + s0)[None, :]  # (1, sb)
        visible = None
        if causal:
            visible = j <= aligned
        if left >= 0:
            visible = both(visible, j >= aligned - left)
        if right >= 0:
            visible = both(visible, j <= aligned + right)
        allowed = both(allowed, visible[None, None])  # (1, 1, tb, sb)
    if chunk is not None:  # local chunks: only keys of the query's own chunk of positions
        same = ops.equal(tf.math.floordiv(qp, chunk)[:, :, None], tf.math.floordiv(kp, chunk)[:, None, :])
        allowed = both(allowed, same[:, None])  # (B|1, 1, tb, sb)
    if q_ids is not None:  # packed sequences: only keys of the query's own segment
        qi = _slice(q_ids, [0, t0], [-1, tb], compiled)  # (B|1, tb)
        ki = _slice(k_ids, [0, s0], [-1, sb], compiled)  # (B|1, sb)
        allowed = both(allowed, ops.equal(qi[:, :, None], ki[:, None, :])[:, None])  # (B|1, 1, tb, sb)
    if allowed is not None:
        x = tf.where(allowed, x, neg_inf)
    m_new = tf.stop_gradient(ops.maximum(m, ops.max(x, axis=-1, keepdims=True)))  # (B, N, tb, 1)
    m_safe = tf.where(m_new == neg_inf, ops.zeros_like(m_new), m_new)  # a row with no key yet: 0
    correction = ops.exp(m - m_safe)  # 0 while m is -inf
    e = ops.exp(x - m_safe)  # (B, N, tb, sb); masked -> exactly 0
    l = l * correction + ops.sum(e, axis=-1, keepdims=True)
    if keep is not None:
        e = tf.where(_block(keep, T, S, t0, tb, s0, sb, compiled), e / tf.constant(1.0 - rate, ct),
                     ops.zeros_like(e))
    eg = ops.reshape(e, (B, K, G * tb, sb))  # (B, K, G*tb, sb)
    acc = acc * correction + ops.reshape(tf.matmul(eg, vb), (B, N, tb, V))
    return m_new, l, acc


_COMPILED: dict[tuple, object] = {}


def compiled_key_block(mask4, bias, keep, q_ids=None, k_ids=None, slopes=None, q_pos=None, k_pos=None, **static):
    """key_block compiled by XLA for these static arguments, taking tensors
    only, positionally: (m, l, acc, qg, kc, vc, t0, s0, *present of mask4,
    bias, keep, q_ids, k_ids, slopes, q_pos, k_pos). Eagerly a call costs a
    third less dispatch than the same tf.function called with keywords and Nones."""
    present = tuple(a is not None for a in (mask4, bias, keep, q_ids, k_ids, slopes, q_pos, k_pos))
    cache_key = (present, tuple(sorted(static.items())))
    if cache_key not in _COMPILED:
        if len(_COMPILED) >= 64:
            _COMPILED.clear()

        def step(m, l, acc, qg, kc, vc, t0, s0, *optional):
            given = iter(optional)
            arrays = (next(given) if p else None for p in present)  # mask4, bias, keep, q_ids, k_ids, slopes, q_pos, k_pos
            return key_block(m, l, acc, qg, kc, vc, t0, s0, *arrays, compiled=True, **static)

        _COMPILED[cache_key] = tf.function(step, jit_compile=True, autograph=False)
    return _COMPILED[cache_key]


def key_plan(t0: int, tb: int, *, T: int, S: int, C: int, offset: int, causal: bool, left: int, right: int):
    """The key blocks query rows t0 <= t < t0 + tb run, as (s0, sb, masked)
    triples: blocks aligned to C (the last one S % C long), from the first
    that any of the rows sees to the last, the others skipped; `masked` where
    the causal mask or the window hides some key of the block from some row
    of it (the diagonal, a window's edges), so the block must apply them.
    Rows are aligned as causal_alignment says (row t at t + offset)."""
    first, last = t0 + offset, t0 + tb - 1 + offset  # the block's first and last aligned rows
    reach = [bound for bound in ((0 if causal else -1), right) if bound >= 0]  # keys right of the row it sees
    r = min(reach) if reach else None
    stop = S if r is None else min(S, max(0, last + r + 1))  # past the last key any row sees
    start = max(0, first - left) if left >= 0 else 0  # the first key any row sees
    if start >= stop:  # no row of the block sees any key (rows after a short key sequence, left window)
        return []
    plan = []
    for s0 in range(start - start % C, stop, C):
        sb = min(C, S - s0)
        masked = (r is not None and s0 + sb - 1 > first + r) or (left >= 0 and s0 < last - left)
        plan.append((s0, sb, masked))
    return plan


def chunked_attention(config, query, params, k, v, *, positions=None, mask4, bias, keep, is_causal: bool,
                      causal_alignment: str, chunk_size: int, segment_ids=None, key_segment_ids=None,
                      key_positions=None, rope_tables=None, temperature_positions=None):
    """query (B, T, D) (projected here, block by block, with its clip, norm,
    rope and temperature; the output gate reads it there too), k (B, K, S,
    H), v (B, K, S, V) (the present keys and values: a cache's included), all
    in the storage dtype -> merged context (B, T, N*V), gated.
    Pass k and v without keeping references: they are released (eagerly)
    before the (B, T, N*V) context is assembled.

    params: the canonical tensors (query.kernel, query.bias, query.norm.*,
    sinks, alibi.slopes, gate.* read here); positions (B|1, T) int: the
    queries' positions (rope, the temperature, ALiBi, local chunks);
    key_positions (B|1, S) int: every key's (ALiBi, local chunks).
    temperature_positions (B|1, T) int: what the query temperature reads
    (call.Call.temperature_positions; default positions).
    mask4: bool, rank 4 broadcastable to (B, N, T, S), causal and window not
    included; bias: compute dtype, rank 4; keep: the dropout keep-mask (B, N,
    T, S) or None; segment_ids (T,) or (B, T) and key_segment_ids (S,) or
    (B, S), or None. rope_tables: the call's (inv_freq, attention_factor)
    (call.Call.rope_tables: LongRoPE's table chosen by the call's positions).

    A latent layer (config.latent) runs the absorbed form: k the shared head
    [latent | rotary key] (B, 1, S, C + R), v the latent (B, 1, S, C); each
    query block is absorbed through key.kernel (functional.absorb_query) and
    its attended latent expanded through value.kernel (expand_values).
    """
    C = check_chunk_size(chunk_size)
    T, S = query.shape[1], k.shape[2]
    if T is None or S is None:
        raise ValueError(
            f"chunk_size needs the query and key lengths known when the graph is traced: got T={T}, S={S}"
        )
    T, S = int(T), int(S)
    N, K, V = config.num_heads, k.shape[1], v.shape[-1]  # a latent layer's one shared head: K = 1, V = C
    G = N // K
    B = query.shape[0] if query.shape[0] is not None else tf.shape(query)[0]
    dtype = dtype_name(query)
    ct = compute_dtype(dtype)
    offset = 0 if causal_alignment == "top_left" else S - T
    left, right = config.window_left, config.window_right
    rate = config.dropout
    masked_row = config.masked_row
    kc, vc = _cast(k, ct), _cast(v, ct)  # (B, K, S, H), (B, K, S, V)
    use_xla = (query.shape[0] or 1) * N * C * C >= XLA_MIN_BLOCK
    static = dict(T=T, S=S, offset=offset, rate=rate, dtype=dtype)
    if config.logit_softcap is not None:
        static["cap"] = config.logit_softcap
    if config.local_chunk is not None:
        static["chunk"] = config.local_chunk
    if config.alibi_bias_dtype is not None:
        static["alibi_rounding"] = config.alibi_bias_dtype
    q_ids = k_ids = None
    if segment_ids is not None:  # (B|1, T) and (B|1, S), one integer dtype
        q_ids = ops.convert_to_tensor(segment_ids)
        q_ids = q_ids[None] if len(q_ids.shape) == 1 else q_ids
        k_ids = ops.cast(ops.convert_to_tensor(key_segment_ids), q_ids.dtype)
        k_ids = k_ids[None] if len(k_ids.shape) == 1 else k_ids
    slopes = q_pos = k_pos = None
    if config.alibi:
        slopes = _cast(params["alibi.slopes"], ct)  # (N,)
    if config.alibi or config.local_chunk is not None:  # one integer dtype
        q_pos, k_pos = _cast(positions, "int64"), _cast(key_positions, "int64")  # (B|1, T), (B|1, S)
    # Local chunks skip the key blocks that no query of a block shares a chunk with, as a window's are,
    # where the positions are values here (an eager call; a graph's tensors mask within every block only).
    chunks = None
    if config.local_chunk is not None and tf.executing_eagerly():
        chunks = tuple(np.asarray(x) // config.local_chunk for x in (q_pos, k_pos))  # (B|1, T), (B|1, S)
    arrays = (mask4, bias, keep, q_ids, k_ids, slopes, q_pos, k_pos)  # key_block's, in its order
    optional = [a for a in arrays if a is not None]
    sinks = params.get("sinks") if config.use_sinks else None
    sink = None if sinks is None else ops.reshape(_cast(sinks, ct), (1, N, 1, 1))  # (1, N, 1, 1)
    q_norm = config.qk_norm
    if config.rope is not None:
        inv_freq, factor = default_rope_tables(config.rope) if rope_tables is None else rope_tables

    temp_positions = positions if temperature_positions is None else temperature_positions  # the temperature's positions

    def i32(x):
        return tf.constant(x, tf.int32) if isinstance(x, int) else x

    def run(state, qg, t0, tb, s0, sb, masked):
        window = dict(causal=is_causal, left=left, right=right) if masked else dict(causal=False)
        if use_xla:
            step = compiled_key_block(*arrays, tb=tb, sb=sb, **window, **static)
            return step(*state, qg, kc, vc, i32(t0), i32(s0), *optional)
        return key_block(*state, qg, kc, vc, i32(t0), i32(s0), *arrays, tb=tb, sb=sb, **window, **static)

    def key_loop(state, qg, t0: int, tb: int, j0: int, j1: int):
        """Full key blocks j0 <= j < j1, none crossing the diagonal or a window's edge: one tf.while_loop."""
        if j1 - j0 <= 1:
            return state if j1 <= j0 else run(state, qg, t0, tb, j0 * C, C, False)

        def body(j, m, l, acc):
            return (j + 1, *run((m, l, acc), qg, t0, tb, j * C, C, False))

        _, *state = tf.while_loop(lambda j, *_: j < j1, body, (tf.constant(j0), *state),
                                  maximum_iterations=j1 - j0)
        return tuple(state)

    v_total = None  # over all S: what a fully masked row's context is made of (not "zero")
    if masked_row == "uniform" and keep is None and sink is None:
        v_total = ops.mean(vc, axis=2, keepdims=True)[:, :, None]  # (B, K, 1, 1, V): weights 1/S everywhere
    elif masked_row == "nan" and keep is None and sink is None:
        v_total = ops.sum(vc, axis=2, keepdims=True)[:, :, None]  # (B, K, 1, 1, V): weights NaN everywhere

    def masked_row_ctx(t0: int, tb: int, empty):
        """The context the spec gives a fully masked row (B, N, tb, V), over
        every key, hidden or not: "uniform" weights 1/S, "nan" weights NaN,
        each then through dropout. A "nan" row's weights are NaN only on the
        rows that are empty (0 elsewhere), so that, as in the spec, the NaN
        reaches the value gradient through those rows' kept keys and nothing else."""
        empty_g = ops.reshape(empty, (B, K, G, tb, 1))
        if keep is None:
            if masked_row == "uniform":
                return ops.reshape(ops.broadcast_to(v_total, (B, K, G, tb, V)), (B, N, tb, V))
            nan_or_zero = tf.where(empty_g, tf.constant(math.nan, ct), tf.constant(0.0, ct))  # (B, K, G, tb, 1)
            return ops.reshape(nan_or_zero * v_total, (B, N, tb, V))

        def add(u, s0, sb):
            kept = _block(keep, T, S, i32(t0), tb, s0, sb)  # (B, N, tb, sb)
            if masked_row == "uniform":
                w = tf.where(kept, tf.constant(1.0 / S, ct) / tf.constant(1.0 - rate, ct), tf.constant(0.0, ct))
            else:
                w = tf.where(ops.logical_and(kept, empty), tf.constant(math.nan, ct), tf.constant(0.0, ct))
            vb = _slice(vc, [0, 0, s0, 0], [-1, -1, sb, -1], False)  # (B, K, sb, V)
            return u + ops.reshape(tf.matmul(ops.reshape(w, (B, K, G * tb, sb)), vb), (B, N, tb, V))

        n_full_s = S // C
        u = ops.zeros((B, N, tb, V), dtype=ct)
        if n_full_s:
            _, u = tf.while_loop(lambda j, _: j < n_full_s, lambda j, u: (j + 1, add(u, j * C, C)),
                                 (tf.constant(0), u), maximum_iterations=n_full_s)
        if S % C:
            u = add(u, i32(n_full_s * C), S % C)
        return u

    def query_heads(t0: int, tb: int):
        """The block's queries after project -> [clip] -> [norm] -> split_heads -> [rope] -> [norm after
        rope] -> [temperature]: (B, N, tb, H); a latent layer's absorbed, (B, N, tb, C + R)."""
        if config.latent is not None:
            q = latent_query_heads(config, params, query[:, t0:t0 + tb], positions[:, t0:t0 + tb],
                                   (inv_freq, factor), dtype, temp_positions[:, t0:t0 + tb])  # (B, N, tb, H)
            return absorb_query(q, params["key.kernel"], config.latent.rope_dim)  # (B, N, tb, C + R)
        q = project(query[:, t0:t0 + tb], params["query.kernel"], params.get("query.bias"))  # (B, tb, N*H)
        if config.qkv_clip is not None:
            q = clip(q, config.qkv_clip)
        if q_norm is not None and not q_norm.after_rope:  # per token, so the block's rows alone
            q = norm(q, params.get("query.norm.scale"), params.get("query.norm.bias"), q_norm.type, q_norm.eps, N,
                     q_norm.scope)
        q = split_heads(q, N)  # (B, N, tb, H)
        if config.rope is not None:
            angles = rope_angles(positions[:, t0:t0 + tb], inv_freq, dtype)  # (B|1, 1, tb, R/2)
            q = rope(q, angles, config.rope.rotary_dim, config.rope.interleaved, factor)
        if q_norm is not None and q_norm.after_rope:
            q = norm_heads(q, params.get("query.norm.scale"), params.get("query.norm.bias"), q_norm.type,
                           q_norm.eps, q_norm.scope)
        if config.query_temperature is not None:
            t = config.query_temperature
            q = temperature(q, temperature_factor(temp_positions[:, t0:t0 + tb], t.beta, t.floor, t.offset, dtype))
        return q

    def query_block(t0: int, tb: int):
        """Context of queries t0 <= t < t0 + tb, merged: (B, tb, N*V)."""
        q = query_heads(t0, tb)  # (B, N, tb, H)
        qg = ops.reshape(_cast(q, ct) * tf.constant(config.effective_scale, ct), (B, K, G * tb, -1))  # (B, K, G*tb, H)
        if sink is None:
            state = (ops.full((B, N, tb, 1), -math.inf, dtype=ct), ops.zeros((B, N, tb, 1), dtype=ct),
                     ops.zeros((B, N, tb, V), dtype=ct))
        else:  # the sink joins every row first: max = sink, sum = exp(sink - max) = 1 (its gradient), numerator 0
            m0 = tf.stop_gradient(ops.maximum(ops.full((B, N, tb, 1), -math.inf, dtype=ct), sink))
            state = (m0, ops.exp(sink - m0), ops.zeros((B, N, tb, V), dtype=ct))
        plan = key_plan(t0, tb, T=T, S=S, C=C, offset=offset, causal=is_causal, left=left, right=right)
        if chunks is not None:  # local chunks: the blocks in no chunk of positions that a row of this one is in
            q_chunks = chunks[0][:, t0:t0 + tb]
            plan = [(s0, sb, masked) for s0, sb, masked in plan
                    if chunks[1][:, s0:s0 + sb].max() >= q_chunks.min() and chunks[1][:, s0:s0 + sb].min() <= q_chunks.max()]
        i = 0
        while i < len(plan):  # runs of adjacent full unmasked blocks in one while loop, the others one by one
            j = i
            while (j < len(plan) and not plan[j][2] and plan[j][1] == C
                   and (j == i or plan[j][0] == plan[j - 1][0] + C)):
                j += 1
            if j > i:
                state = key_loop(state, qg, t0, tb, plan[i][0] // C, plan[j - 1][0] // C + 1)
                i = j
            else:
                s0, sb, masked = plan[i]
                state = run(state, qg, t0, tb, s0, sb, masked)
                i += 1
        m, l, acc = state
        empty = l == 0  # (B, N, tb, 1): no key allowed (a row with any has l >= 1; never with sinks)
        ctx = acc / tf.where(empty, ops.ones_like(l), l)  # (B, N, tb, V)
        # "zero": an empty row's acc is already its context, 0 * v as in the spec's attend (so a NaN in
        # a value it computed reaches it, as in impl_numpy); no select, which would hide that NaN.
        # With sinks an empty row's context is 0 whatever masked_row says: acc is 0 there.
        if masked_row != "zero" and sink is None:
            ctx = tf.where(empty, masked_row_ctx(t0, tb, empty), ctx)
        ctx = _cast(ctx, dtype)
        if config.latent is not None:  # the attended latent through each head's value up-projection
            ctx = expand_values(ctx, params["value.kernel"])  # (B, N, tb, V)
        if config.output_gate is not None:  # functional.gate on the block's rows: the gate acts per token
            g = gate_project(query[:, t0:t0 + tb], params["gate.kernel"], params.get("gate.bias"))  # (B, tb, N*V|N)
            ctx = gate(ctx, g, N)
        return merge_heads(ctx)  # (B, tb, N*V)

    blocks = []
    for t0 in range(0, T, C):
        if len(blocks) >= IN_FLIGHT:  # under tf.function: IN_FLIGHT query blocks at a time (bounded memory)
            with tf.control_dependencies([blocks[-IN_FLIGHT]]):
                blocks.append(query_block(t0, min(C, T - t0)))
        else:
            blocks.append(query_block(t0, min(C, T - t0)))
    # Eagerly, the keys and values go before the blocks are joined (the closures above read these
    # names); the caller passes them without keeping a reference. A graph frees them by itself.
    k = v = kc = vc = v_total = None
    return blocks[0] if len(blocks) == 1 else ops.concatenate(blocks, axis=1)  # (B, T, N*V)
