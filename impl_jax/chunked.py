"""Exact attention over key blocks with an online softmax (no (T, S) array): mirrors impl_numpy/chunked.py.

The same recurrence as the NumPy spec of this mode (Milakov & Gimelshein
2018, the one flash-attention uses): queries are taken in blocks of
`chunk_size` rows and keys in blocks of `chunk_size` columns; for each query
block a running max m, running sum l and running numerator acc are rescaled
as each key block arrives, so the largest temporary is (B, N, chunk, chunk).
Key blocks that the causal mask, a window or the local chunks hide entirely
are skipped (lax.switch: a hidden block costs a branch and no arithmetic; only blocks
the diagonal or a window's edge crosses pay for the structural select).
Under a band (a left window with causality or a right window) a query
block's key loop runs only the fixed number of blocks the band can reach,
from the band's first (a dynamic start), so a fixed window costs the same
per query at every length: the loop over all key blocks made the skipped
steps alone grow as T * S. The stage functions of functional.py run
on each block (project of a query block, split_heads, logits, mask,
merge_heads, output), so in 16 bits those stages round as the plain path's
do. Softmax, dropout and attend, merged into the running recurrence, stay in
float32 until the context is stored (the plain path also rounds the weights
and the dropped-out weights to 16 bits; impl_numpy's chunked core, like this
one, does not). In float32/float64, where rounding to the storage dtype is
the identity, the scale multiplies the (chunk, H) queries instead of every
(chunk, chunk) block of logits (one pass over each block fewer; the same
product up to one rounding, exactly the same when the scale is a power of
two, as 1/sqrt(64)).

Pure JAX: lax.scan over query blocks, lax.scan over key blocks inside, so the
call works under jax.jit (chunk_size is static), jax.grad and jax.vmap. Both
scan bodies are rematerialised in the backward pass (jax.checkpoint): the
gradient holds per-block residuals, not the (T, S) weights.

Memory. The key and value projections are computed once, (B, S, K*H) and
(B, S, K*V); the query projection, the attention and the output projection
run per query block, so neither the (B, T, N*H) queries nor the (B, T, N*V)
context exist whole. A length that is not a multiple of the block size is
not padded (that would copy q, k, v, masks and bias): the last block starts
at L - chunk and overlaps its neighbour; overlapping keys are masked out of
the last key block, overlapping query rows are computed twice (identically)
and kept once. Dropout: an explicit dropout_mask is (B, N, T, S) by contract,
and a seed (or rng) draws that whole keep-mask as the plain path does (as
impl_numpy does), so a seed means the same dropout on both paths.

Modern calls (a config with any field beyond the plain layer's: norm, rope,
softcap, windows, sinks, ALiBi, local chunks, the temperature, the clip or
the gate; or a call with a cache or segment ids) hand in their heads instead
of the inputs: attention.py runs the stages up to the present keys (project,
clip, norm, split_heads, rope, temperature, the cache appended), as impl_numpy's _fused_modern does,
and the same recurrence runs on slices of those heads (so such a call
holds its (B, N, T, H) queries whole, as impl_numpy's does; still no (T, S)
array). Softcap follows the
logits in each block; a window hides key blocks from a whole query block
as causality does (skipped by the same switch; the blocks its edges cross
take the structural mask); segment ids, local chunks and ALiBi's distances
are computed block by block from the positions (no (T, S) array); sinks
start each row's running max at its sink and its running sum at 1. The
QKV clip and the query temperature run among the stages before the core;
the output gate runs on each query block's context before its output
projection. A differential layer's values come in paired (value.pair: 2V
wide, as the spec's chunked core takes them) and the differential stage
runs on each query block's stored context before the gate (it mixes heads,
not rows: a block's rows are the whole call's).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from weights import compute_dtype
from weights.contract import check_chunk_size

from .functional import (
    ATTEND,
    LOGITS,
    _precision,
    alibi,
    alibi_bias,
    differential_stage,
    expand_values,
    gate,
    gate_project,
    logits,
    mask_stage,
    merge_heads,
    output,
    project,
    softcap,
    split_heads,
)


def _starts(length: int, block: int) -> np.ndarray:
    """First index of each block; the last one is clamped to length - block (overlap, no padding)."""
    n = -(-length // block)
    return np.minimum(np.arange(n) * block, length - block).astype(np.int32)


def _block(array, T: int, S: int, t0, Cq: int, s0, Ck: int):
    """A rank-4 broadcastable array's (t0:t0+Cq, s0:s0+Ck) block, slicing only the full T and S axes."""
    if array is None:
        return None
    if array.shape[2] == T:
        array = lax.dynamic_slice_in_dim(array, t0, Cq, axis=2)
    if array.shape[3] == S:
        array = lax.dynamic_slice_in_dim(array, s0, Ck, axis=3)
    return array


def chunked_attention(config, p, query, key, value, *, mask, bias, keep, is_causal: bool, causal_alignment: str,
                      chunk_size: int, precision: str = "highest", heads=None, segment_ids=None,
                      key_segment_ids=None, positions=None, key_positions=None, gate_input=None, values_up=None):
    """query (B, T, query_dim), key (B, S, key_dim), value (B, S, value_dim), all
    cast to the storage dtype, canonical tensors p -> output (B, T, O).

    mask (bool), bias (compute dtype) and keep (bool, (B, N, T, S)) are rank
    4 and broadcast to (B, N, T, S), or None: prepare()'s results.

    heads: a modern call's (q (B, N, T, H), k (B, K, S, H), v (B, K, S, V)),
    the stages up to the present keys already run (norm, rope, the cache
    appended: S counts every key); query, key and value are then None.
    segment_ids (T,) or (B, T) and key_segment_ids (S,) or (B, S): packed
    sequences. The config's softcap, window and sinks (p["sinks"]) apply, and
    ALiBi (p["alibi.slopes"]) and local chunks, which read positions (B|1, T)
    and every key's key_positions (B|1, S), block by block. gate_input: the
    query input (B, T, query_dim), cast, for the output gate (its stages run
    on each query block's context, before the output projection).
    values_up: a latent layer's value.kernel (C, K, V): heads are then the
    absorbed form's (latent.absorbed: one shared head of width C + R, the
    latent as values), and each query block's attended latent goes through
    functional.expand_values before the gate and the output projection."""
    chunk_size = check_chunk_size(chunk_size)
    if heads is None:
        dtype = query.dtype
        B, T, _ = query.shape
        S = key.shape[1]
    else:
        q_heads, k_heads, v_heads = heads
        dtype = q_heads.dtype
        B, T, S = q_heads.shape[0], q_heads.shape[2], k_heads.shape[2]
    ct = compute_dtype(dtype)
    N, K = config.num_heads, config.num_kv_heads
    V, H = config.value_head_dim, config.head_dim
    if heads is not None:  # the heads' own widths: a latent layer's absorbed form has one head of C + R and C
        K, H, V = k_heads.shape[1], q_heads.shape[3], v_heads.shape[3]
    G = N // K
    Cq, Ck = min(chunk_size, T), min(chunk_size, S)
    q_starts, k_starts = _starts(T, Cq), _starts(S, Ck)
    nq, nk = len(q_starts), len(k_starts)
    k_overlap = S % Ck != 0  # the last key block overlaps its neighbour: its first keys are masked out
    offset = 0 if causal_alignment == "top_left" else S - T
    # Key j is visible to query i only if j <= i + offset + upper (causal: upper 0; a right window: its size)
    # and j >= i + offset - left (a left window); None: no such bound.
    uppers = ([0] if is_causal else []) + ([config.window_right] if config.window_right >= 0 else [])
    upper = min(uppers) if uppers else None
    left = config.window_left if config.window_left >= 0 else None
    scale = config.effective_scale
    cap = config.logit_softcap
    sinks = p.get("sinks")
    slopes = p.get("alibi.slopes") if config.alibi else None  # (N,)
    rounding = config.alibi_bias_dtype  # Falcon-RW's rounded key form (functional.alibi_bias), or None
    chunk = config.local_chunk
    rate = jnp.asarray(1.0 - config.dropout, ct)
    # A fully masked row's weights, as functional.softmax fills them: 1/S or NaN on all S keys, then
    # dropout. Its context is those weights times V over every key (hidden blocks too), so that its
    # gradient reaches V as on the plain path: 1/S each, or NaN where such a row exists. "zero" (weights
    # 0): its running numerator is its context, 0 x V over the key blocks it read (NaN in a column where
    # one of their values is NaN), as impl_numpy's and impl_tf's chunked paths give it: a block hidden from
    # the whole query block is never read, so a NaN value there reaches no row of it (0 x V over every key
    # made a row whose blocks were all skipped NaN where the other mirrors give 0). With sinks no row is
    # empty: its mass goes to the sink (weights 0).
    zero_rows = config.masked_row == "zero"
    fill = {"zero": 0.0, "uniform": 1.0 / S, "nan": np.nan}[config.masked_row]
    fill_everywhere = keep is None  # the same fill weight on every key of an empty row
    pr = _precision(precision)
    exact = ct == dtype  # float32/float64: rounding each stage to the storage dtype is the identity

    if heads is None:
        k_all = project(key, p["key.kernel"], p.get("key.bias"), precision)  # (B, S, K*H)
        v_all = project(value, p["value.kernel"], p.get("value.bias"), precision)  # (B, S, K*V)
    if fill_everywhere and sinks is None and not zero_rows:
        v_total = v_all.astype(ct).sum(axis=1) if heads is None else v_heads.astype(ct).sum(axis=2)  # (B, K*V|K, V)
        v_sum = v_total.reshape(B, K, 1, 1, V)  # (B, K, 1, 1, V)
        v_sum = jnp.broadcast_to(v_sum, (B, K, G, 1, V)).reshape(B, N, 1, V)  # (B, N, 1, V)
    q_ids = k_ids = None
    if segment_ids is not None:
        q_ids = jnp.asarray(segment_ids).reshape(-1, T)  # (B|1, T)
        k_ids = jnp.asarray(key_segment_ids).reshape(-1, S)  # (B|1, S)

    def attend_acc(w, vb):
        """w (B, N, Cq, Ck) in compute dtype times vb (B, K, Ck, V) -> (B, N, Cq, V), in compute dtype."""
        return jnp.einsum(ATTEND, w.reshape(B, K, G, Cq, Ck), vb.astype(ct), precision=pr).reshape(B, N, Cq, V)

    def key_blocks(j, s0):
        """Key block j: its keys and values (B, K, Ck, H|V), and which of its keys no earlier block had."""
        if heads is None:
            kb = split_heads(lax.dynamic_slice_in_dim(k_all, s0, Ck, axis=1), K)  # (B, K, Ck, H)
            vb = split_heads(lax.dynamic_slice_in_dim(v_all, s0, Ck, axis=1), K)  # (B, K, Ck, V)
        else:
            kb = lax.dynamic_slice_in_dim(k_heads, s0, Ck, axis=2)  # (B, K, Ck, H)
            vb = lax.dynamic_slice_in_dim(v_heads, s0, Ck, axis=2)  # (B, K, Ck, V)
        cols = s0 + jnp.arange(Ck, dtype=jnp.int32)  # (Ck,) key indices
        fresh = (cols >= j * Ck)[None, None, None, :] if k_overlap else None  # (1, 1, 1, Ck)
        return kb, vb, cols, fresh

    xs = (jnp.arange(nk, dtype=jnp.int32), jnp.asarray(k_starts))
    # A band (a left window and a causal or right bound) reaches at most `span` keys from a query block:
    # its key loop then runs a fixed nb blocks from the band's first one instead of all nk (steps O(T*window),
    # not O(T*S)); hidden blocks among those nb are still skipped by the switch.
    banded = left is not None and upper is not None
    nb = min(nk, (Cq - 1 + left + upper) // Ck + 2) if banded else nk

    def query_block(t0):
        if heads is None:
            qb = project(lax.dynamic_slice_in_dim(query, t0, Cq, axis=1), p["query.kernel"], p.get("query.bias"),
                         precision)  # (B, Cq, N*H)
            qb = split_heads(qb, N)  # (B, N, Cq, H)
        else:
            qb = lax.dynamic_slice_in_dim(q_heads, t0, Cq, axis=2)  # (B, N, Cq, H)
        rows = t0 + jnp.arange(Cq, dtype=jnp.int32)  # (Cq,) query indices
        if exact:  # float32/float64: the scale on the (Cq, H) queries, not on every (Cq, Ck) block of logits
            qs = qb.astype(ct) * jnp.asarray(scale, ct)
            qs = qs.reshape(B, K, G * Cq, H)  # (B, K, G*Cq, H)
        qb_ids = None if q_ids is None else lax.dynamic_slice_in_dim(q_ids, t0, Cq, axis=1)  # (B|1, Cq)
        qb_pos = None if positions is None else lax.dynamic_slice_in_dim(positions, t0, Cq, axis=1)  # (B|1, Cq)
        qb_chunks = None if chunk is None else qb_pos // chunk  # (B|1, Cq): the queries' chunks of positions

        def key_block(carry, js):
            j, s0 = js
            kb, vb, cols, fresh = key_blocks(j, s0)
            keep_b = _block(keep, T, S, t0, Cq, s0, Ck)  # (B, N, Cq, Ck) or None

            def compute(structural: bool):
                def run(m, l, acc):
                    allowed = _block(mask, T, S, t0, Cq, s0, Ck)
                    if structural:  # the causal diagonal, a window's edge and/or the overlapping keys
                        ok = fresh
                        if upper is not None:
                            below = (cols[None, :] <= rows[:, None] + (offset + upper))[None, None]  # (1, 1, Cq, Ck)
                            ok = below if ok is None else ok & below
                        if left is not None:
                            above = (cols[None, :] >= rows[:, None] + (offset - left))[None, None]  # (1, 1, Cq, Ck)
                            ok = above if ok is None else ok & above
                        allowed = ok if allowed is None else allowed & ok
                    if qb_ids is not None:  # packed sequences: only keys of the query's own segment
                        kb_ids = lax.dynamic_slice_in_dim(k_ids, s0, Ck, axis=1)  # (B|1, Ck)
                        same = (qb_ids[:, :, None] == kb_ids[:, None, :])[:, None]  # (B|1, 1, Cq, Ck)
                        allowed = same if allowed is None else allowed & same
                    if qb_pos is not None:  # ALiBi's distances and the local chunks: this block's positions
                        kb_pos = lax.dynamic_slice_in_dim(key_positions, s0, Ck, axis=1)  # (B|1, Ck)
                    if chunk is not None:  # local chunks: only keys of the query's own chunk of positions
                        near = (qb_pos[:, :, None] // chunk == kb_pos[:, None, :] // chunk)[:, None]  # (B|1, 1, Cq, Ck)
                        allowed = near if allowed is None else allowed & near
                    bias_b = _block(bias, T, S, t0, Cq, s0, Ck)
                    if exact:  # the stages' arithmetic, rounding to the storage dtype being the identity
                        x = jnp.einsum(LOGITS.replace("G", ""), qs, kb.astype(ct), precision=pr).reshape(B, N, Cq, Ck)
                        if cap is not None:  # functional.softcap, before mask and bias
                            c = jnp.asarray(cap, ct)
                            x = jnp.tanh(x / c) * c
                        if slopes is not None:  # functional.alibi, after the softcap and before the mask
                            x = x + alibi_bias(slopes, qb_pos, kb_pos, dtype, rounding)
                        if bias_b is not None:
                            x = x + bias_b
                            finite = bias_b > -jnp.inf  # a -inf bias is a mask, as in mask(): NaN logits there too
                            allowed = finite if allowed is None else allowed & finite
                        if allowed is not None:
                            x = jnp.where(allowed, x, jnp.asarray(-jnp.inf, ct))
                    else:  # 16-bit: the stage functions, each result rounded to the storage dtype
                        x = logits(qb, kb, scale, precision)  # (B, N, Cq, Ck), storage dtype
                        if cap is not None:
                            x = softcap(x, cap)
                        if slopes is not None:
                            x = alibi(x, alibi_bias(slopes, qb_pos, kb_pos, dtype, rounding))
                        x = mask_stage(x, allowed, bias_b).astype(ct)
                    # softmax is shift-invariant: the running max carries no gradient
                    m_new = lax.stop_gradient(jnp.maximum(m, x.max(axis=-1, keepdims=True)))  # (B, N, Cq, 1)
                    m_safe = jnp.where(m_new == -jnp.inf, jnp.asarray(0, ct), m_new)
                    correction = jnp.exp(m - m_safe)  # 0 while m is -inf
                    e = jnp.exp(x - m_safe)  # masked -> exactly 0
                    l_new = l * correction + e.sum(axis=-1, keepdims=True)
                    if keep_b is not None:
                        e = jnp.where(keep_b, e / rate, jnp.asarray(0, ct))
                    return m_new, l_new, acc * correction + attend_acc(e, vb)
                return run

            if upper is None and left is None and not k_overlap and chunk is None:
                return compute(False)(*carry), None
            # hidden: every key after every query's last visible one, or before every query's first
            # visible one, or (local chunks) in no chunk of positions that a query of the block is in;
            # crosses: the causal diagonal, a window's edge or the overlap runs through the block, which
            # then needs the structural mask (a chunk's edge is masked inside every block, from positions)
            hidden = crosses = False
            if chunk is not None:
                kb_chunks = lax.dynamic_slice_in_dim(key_positions, s0, Ck, axis=1) // chunk  # (B|1, Ck)
                hidden = (kb_chunks.max() < qb_chunks.min()) | (kb_chunks.min() > qb_chunks.max())
            if upper is not None:
                hidden = hidden | (s0 > t0 + (Cq - 1 + offset + upper))
                crosses = s0 + (Ck - 1) > t0 + (offset + upper)
            if left is not None:
                hidden = hidden | (s0 + (Ck - 1) < t0 + (offset - left))
                crosses = crosses | (s0 < t0 + (Cq - 1 + offset - left))
            if k_overlap:
                crosses = crosses | (j == nk - 1)
            if crosses is False:  # local chunks alone: no causal, window or overlap edge crosses any block
                return lax.switch(jnp.where(hidden, 0, 1), [lambda *c: c, compute(False)], *carry), None
            branch = jnp.where(hidden, 0, jnp.where(crosses, 2, 1))
            return lax.switch(branch, [lambda *c: c, compute(False), compute(True)], *carry), None

        if sinks is None:
            init = (jnp.full((B, N, Cq, 1), -jnp.inf, ct), jnp.zeros((B, N, Cq, 1), ct),
                    jnp.zeros((B, N, Cq, V), ct))
        else:  # the sink joins every row first: max = sink, sum = exp(sink - sink) = 1 (its gradient), numerator 0
            sink = sinks.astype(ct).reshape(1, N, 1, 1)
            sink_max = lax.stop_gradient(sink)
            init = (jnp.broadcast_to(sink_max, (B, N, Cq, 1)), jnp.broadcast_to(jnp.exp(sink - sink_max), (B, N, Cq, 1)),
                    jnp.zeros((B, N, Cq, V), ct))
        if nb < nk:  # blocks j0 .. j0+nb-1 hold every key the band shows this query block
            first = jnp.maximum(t0 + (offset - left), 0) // Ck  # the block of the band's first key
            j0 = jnp.clip(first, 0, nk - nb).astype(jnp.int32)
            js = j0 + jnp.arange(nb, dtype=jnp.int32)
            band = (js, jnp.asarray(k_starts)[js])
        else:
            band = xs
        (m, l, acc), _ = lax.scan(jax.checkpoint(key_block, prevent_cse=False), init, band)
        if sinks is not None:
            ctx = acc / l  # l >= exp(0) from the row's largest logit or its sink: never 0
        else:
            empty = l == 0  # no allowed key in the row (l >= 1 otherwise: the max contributes exp(0))
            ctx = acc / jnp.where(empty, jnp.asarray(1, ct), l)  # "zero": an empty row's acc, 0 x V, as it is
            if fill_everywhere and not zero_rows:
                # the fill weight on every key: its factor is 0 on the other rows, so no NaN reaches their gradients
                ctx = jnp.where(empty, jnp.where(empty, jnp.asarray(fill, ct), jnp.asarray(0, ct)) * v_sum, ctx)
            elif not zero_rows:
                # with dropout: the fill weights, kept or dropped key by key, on the empty rows only: one more
                # pass over the key blocks (training with masked_row "uniform" or "nan" only)
                def fill_block(filled, js):
                    j, s0 = js
                    _, vb, _, fresh = key_blocks(j, s0)
                    kept = _block(keep, T, S, t0, Cq, s0, Ck) & empty
                    kept = kept if fresh is None else kept & fresh
                    w = jnp.where(kept, jnp.asarray(fill, ct) / rate, jnp.asarray(0, ct))  # (B, N, Cq, Ck)
                    return filled + attend_acc(w, vb), None

                filled, _ = lax.scan(jax.checkpoint(fill_block, prevent_cse=False), jnp.zeros_like(acc), xs)
                ctx = jnp.where(empty, filled, ctx)
        ctx = ctx.astype(dtype)  # (B, N, Cq, V): the core's context, stored
        if values_up is not None:  # the attended latent (B, N, Cq, C) through each head's value up-projection
            ctx = expand_values(ctx, values_up, precision)  # (B, N, Cq, V)
        if config.differential is not None:  # the halves subtracted with lambda, normed, scaled: (B, N/2, Cq, 2V)
            ctx = differential_stage(config, p, ctx)  # row by row: a query block's rows are the whole rows'
        if config.output_gate is not None:  # the gate's stages on this block's rows of the query input
            xb = lax.dynamic_slice_in_dim(gate_input, t0, Cq, axis=1)  # (B, Cq, query_dim)
            ctx = gate(ctx, gate_project(xb, p["gate.kernel"], p.get("gate.bias"), precision), N)
        ctx = merge_heads(ctx)  # (B, Cq, N*V)
        return output(ctx, p["output.kernel"], p.get("output.bias"), precision)  # (B, Cq, O)

    def step(_, t0):
        return None, query_block(t0)

    _, ys = lax.scan(jax.checkpoint(step, prevent_cse=False), None, jnp.asarray(q_starts))  # (nq, B, Cq, O)
    O = ys.shape[-1]
    out = jnp.moveaxis(ys, 0, 1)  # (B, nq, Cq, O)
    if T % Cq == 0:
        return out.reshape(B, T, O)  # (B, T, O)
    tail = T - (nq - 1) * Cq  # rows of the last (overlapping) block not in the one before
    head = out[:, :-1].reshape(B, (nq - 1) * Cq, O)
    return jnp.concatenate([head, out[:, -1, Cq - tail:]], axis=1)  # (B, T, O)
