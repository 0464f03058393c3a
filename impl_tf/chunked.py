"""Exact attention over key blocks with an online softmax (no (T, S) array):
mirrors impl_numpy/chunked.py, the spec of this mode.

Queries are taken in blocks of `chunk_size` rows and keys in blocks of
`chunk_size` columns, so the largest temporary is (B, N, chunk, chunk). For
each query block a running max m, running sum l and running numerator acc are
rescaled as each key block arrives (Milakov & Gimelshein 2018, the recurrence
flash-attention uses). Key blocks that the causal mask hides entirely are
skipped. The result equals functional.py's plain path within the tolerance
policy (the same stages on blocks, the same rounding rule).

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

from weights.contract import check_chunk_size

from ._keras import keras, tf
from .functional import _cast, compute_dtype, dtype_name, merge_heads, project, split_heads

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


def key_block(m, l, acc, qg, kc, vc, t0, s0, mask4, bias, keep, *, T: int, S: int, tb: int, sb: int,
              causal: bool, offset: int, rate: float, dtype: str, compiled: bool = False):
    """One key block s0 <= s < s0 + sb into the running (m, l, acc) of the query
    block t0 <= t < t0 + tb: functional.py's stages on a (B, N, tb, sb) block.

    qg (B, K, G*tb, H) scaled queries and kc (B, K, S, H), vc (B, K, S, V) in
    the compute dtype; t0, s0 int32 scalars; mask4 / bias / keep the call's
    rank-4 arrays (or None). causal: apply the causal mask (the block may
    cross the diagonal: the diagonal's blocks and a last partial key block).
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

    kb = _slice(kc, [0, 0, s0, 0], [-1, -1, sb, -1], compiled)  # (B, K, sb, H)
    vb = _slice(vc, [0, 0, s0, 0], [-1, -1, sb, -1], compiled)  # (B, K, sb, V)
    x = round_(ops.reshape(tf.matmul(qg, kb, transpose_b=True), (B, N, tb, sb)))  # (B, N, tb, sb), scaled
    allowed = _block(mask4, T, S, t0, tb, s0, sb, compiled)
    if bias is not None:
        bb = _block(bias, T, S, t0, tb, s0, sb, compiled)
        x = round_(x + bb)
        finite = bb > neg_inf  # a -inf bias masks, and passes no gradient (the spec's backward)
        allowed = finite if allowed is None else ops.logical_and(allowed, finite)
    if causal:
        visible = (tf.range(sb) + s0)[None, :] <= (tf.range(tb) + t0)[:, None] + offset  # (tb, sb)
        allowed = visible[None, None] if allowed is None else ops.logical_and(allowed, visible[None, None])
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


def compiled_key_block(mask4, bias, keep, **static):
    """key_block compiled by XLA for these static arguments, taking tensors
    only, positionally: (m, l, acc, qg, kc, vc, t0, s0, *present of mask4,
    bias, keep). Eagerly a call costs a third less dispatch than the same
    tf.function called with keywords and Nones."""
    present = (mask4 is not None, bias is not None, keep is not None)
    cache_key = (present, tuple(sorted(static.items())))
    if cache_key not in _COMPILED:
        if len(_COMPILED) >= 64:
            _COMPILED.clear()

        def step(m, l, acc, qg, kc, vc, t0, s0, *optional):
            given = iter(optional)
            mask4, bias, keep = (next(given) if p else None for p in present)
            return key_block(m, l, acc, qg, kc, vc, t0, s0, mask4, bias, keep, compiled=True, **static)

        _COMPILED[cache_key] = tf.function(step, jit_compile=True, autograph=False)
    return _COMPILED[cache_key]


def chunked_attention(config, query, q_kernel, q_bias, k, v, *, mask4, bias, keep, is_causal: bool,
                      causal_alignment: str, chunk_size: int):
    """query (B, T, D) (projected here, block by block), k (B, K, S, H),
    v (B, K, S, V), all in the storage dtype -> merged context (B, T, N*V).
    Pass k and v without keeping references: they are released (eagerly)
    before the (B, T, N*V) context is assembled.

    mask4: bool, rank 4 broadcastable to (B, N, T, S), causal not included;
    bias: compute dtype, rank 4; keep: the dropout keep-mask (B, N, T, S) or None.
    """
    C = check_chunk_size(chunk_size)
    T, S = query.shape[1], k.shape[2]
    if T is None or S is None:
        raise ValueError(
            f"chunk_size needs the query and key lengths known when the graph is traced: got T={T}, S={S}"
        )
    T, S = int(T), int(S)
    N, K, V = config.num_heads, config.num_kv_heads, config.value_head_dim
    G = N // K
    B = query.shape[0] if query.shape[0] is not None else tf.shape(query)[0]
    dtype = dtype_name(query)
    ct = compute_dtype(dtype)
    offset = 0 if causal_alignment == "top_left" else S - T
    rate = config.dropout
    masked_row = config.masked_row
    kc, vc = _cast(k, ct), _cast(v, ct)  # (B, K, S, H), (B, K, S, V)
    n_full_s = S // C  # key blocks of the full size; a last one of S % C follows
    use_xla = (query.shape[0] or 1) * N * C * C >= XLA_MIN_BLOCK
    static = dict(T=T, S=S, offset=offset, rate=rate, dtype=dtype)
    optional = [a for a in (mask4, bias, keep) if a is not None]

    def i32(x):
        return tf.constant(x, tf.int32) if isinstance(x, int) else x

    def run(state, qg, t0, tb, s0, sb, causal):
        if use_xla:
            step = compiled_key_block(mask4, bias, keep, tb=tb, sb=sb, causal=causal, **static)
            return step(*state, qg, kc, vc, i32(t0), i32(s0), *optional)
        return key_block(*state, qg, kc, vc, i32(t0), i32(s0), mask4, bias, keep, tb=tb, sb=sb, causal=causal,
                         **static)

    def key_loop(state, qg, t0: int, tb: int, j0: int, j1: int):
        """Full key blocks j0 <= j < j1, none crossing the diagonal: one tf.while_loop."""
        if j1 - j0 <= 1:
            return state if j1 <= j0 else run(state, qg, t0, tb, j0 * C, C, False)

        def body(j, m, l, acc):
            return (j + 1, *run((m, l, acc), qg, t0, tb, j * C, C, False))

        _, *state = tf.while_loop(lambda j, *_: j < j1, body, (tf.constant(j0), *state),
                                  maximum_iterations=j1 - j0)
        return tuple(state)

    v_total = None  # over all S: what a fully masked row's context is made of (not "zero")
    if masked_row == "uniform" and keep is None:
        v_total = ops.mean(vc, axis=2, keepdims=True)[:, :, None]  # (B, K, 1, 1, V): weights 1/S everywhere
    elif masked_row == "nan" and keep is None:
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

        u = ops.zeros((B, N, tb, V), dtype=ct)
        if n_full_s:
            _, u = tf.while_loop(lambda j, _: j < n_full_s, lambda j, u: (j + 1, add(u, j * C, C)),
                                 (tf.constant(0), u), maximum_iterations=n_full_s)
        if S % C:
            u = add(u, i32(n_full_s * C), S % C)
        return u

    def query_block(t0: int, tb: int):
        """Context of queries t0 <= t < t0 + tb, merged: (B, tb, N*V)."""
        q = split_heads(project(query[:, t0:t0 + tb], q_kernel, q_bias), N)  # (B, N, tb, H)
        qg = ops.reshape(_cast(q, ct) * tf.constant(config.effective_scale, ct), (B, K, G * tb, -1))  # (B, K, G*tb, H)
        state = (ops.full((B, N, tb, 1), -math.inf, dtype=ct), ops.zeros((B, N, tb, 1), dtype=ct),
                 ops.zeros((B, N, tb, V), dtype=ct))
        if is_causal:
            last = t0 + tb - 1 + offset  # the last key the block's last query sees
            first = t0 + offset  # keys up to here are seen by every query of the block
            n_seen = min(n_full_s, max(0, (first + 1) // C))  # full key blocks seen entirely
            n_any = min(n_full_s, max(0, last // C + 1))  # full key blocks seen at least in part
            state = key_loop(state, qg, t0, tb, 0, n_seen)
            for j in range(n_seen, n_any):  # the diagonal: one or two blocks
                state = run(state, qg, t0, tb, j * C, C, True)
            if S % C and n_full_s * C <= last:
                state = run(state, qg, t0, tb, n_full_s * C, S % C, True)
        else:
            state = key_loop(state, qg, t0, tb, 0, n_full_s)
            if S % C:
                state = run(state, qg, t0, tb, n_full_s * C, S % C, False)
        m, l, acc = state
        empty = l == 0  # (B, N, tb, 1): no key allowed (a row with any has l >= 1)
        ctx = acc / tf.where(empty, ops.ones_like(l), l)  # (B, N, tb, V)
        # "zero": an empty row's acc is already its context, 0 * v as in the spec's attend (so a NaN in
        # a value it computed reaches it, as in impl_numpy); no select, which would hide that NaN.
        if masked_row != "zero":
            ctx = tf.where(empty, masked_row_ctx(t0, tb, empty), ctx)
        return merge_heads(_cast(ctx, dtype))  # (B, tb, N*V)

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
