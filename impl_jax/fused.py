"""The fast path of a call: logits .. attend in one expression
(fused_attention), for calls that ask for neither the weights nor the trace,
without dropout, in float32 or float64. attention.py chooses it (plan) and
runs the stages around it; it imports the stages' helpers alone.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from weights import compute_dtype
from weights.call import ATTEND, LOGITS

from .functional import _precision


def fused_attention(q, k, v, allowed, bias, scale: float, masked_row: str, precision: str = "highest", *,
                    softcap: float | None = None, sinks=None, alibi=None, key_count: int | None = None,
                    attend_by_reduce: bool = False):
    """logits -> [softcap] -> [alibi] -> mask -> softmax [+ sinks] -> attend in one
    expression, for calls that ask for neither the weights nor the trace, in
    float32 or float64 (where every stage's rounding to the storage dtype is
    the identity) and without dropout. The same contractions (LOGITS and
    ATTEND with G folded into T, as impl_numpy's matmuls do) and the same
    arithmetic up to the order of rounding: the softmax's division by the
    row sum is applied to the (T, V) context instead of the (T, S) weights.

    Written for XLA CPU's YNNPACK fusion, which fuses dot, max, exp, sum,
    dot and the division as long as the expression holds no select: a call
    with neither mask, causality nor bias runs as that one fusion. Otherwise
    one select hides positions, as mask() does (an added -inf would not: a
    NaN or infinite logit there, from a NaN key or an overflowing product,
    plus -inf is NaN and would reach the whole row, where the stages give it
    weight 0), and a bias is added where it is finite; the select sits
    outside the fusion (one more pass over the logits). A row with no allowed key is
    computed finite (every position kept, no bias) and its context replaced
    afterwards by the masked_row policy's (0 x V, the mean of V, NaN), as
    functional.softmax fills its weights. Windows, local chunks and segment
    ids arrive in `allowed`. softcap: cap * tanh(logits / cap) before the
    bias, as the stage. alibi: functional.alibi_bias's (B|1, N, T, S) bias in
    compute dtype, added after the softcap and before the bias, as the stage.
    sinks (N,): each row's max and denominator include its head's sink; a row
    with no allowed key then keeps every position hidden and gets weights 0
    (context 0 x V), as functional.softmax gives it.

    q (B, N, T, H), k (B, K, S, H), v (B, K, S, V); allowed (bool) and bias
    rank 4, broadcasting to (B, N, T, S), or None -> context (B, N, T, V).
    k and v may also be tuples of parts along S (a cache and the new keys,
    not concatenated): the logits of the parts are joined instead, (T, S)
    values where the keys are (S, H), and the context is the sum of each
    part's weights times its values.

    key_count: only the first key_count keys count (an in-place cache read
    whole: P+S, a Python int or traced); the others get -inf added to their
    (finite) logits, empty rows are judged and the masked_row "uniform" fill
    averaged over the counted keys alone. attend_by_reduce: the context as a
    multiply and a sum over s instead of the ATTEND dot (same products,
    summed in another order), for an in-place cache's decode step: XLA CPU
    otherwise fuses the in-place write of the value buffer into the layout
    change its dot operand needs and then copies the buffers up to four times
    (compiled HLO, jax 0.10.2, B 1 and 2); the reduction reads the written
    buffer as it is. At P 65536 (B 1, K 8, H 128, float32, 2-core VM) the
    step took 291 ms with the dot and 115 ms with the reduction, which alone
    costs about twice the dot (67 vs 30 ms). The absorbed (latent) form's step
    from DECODE_MIN_KEYS buffer positions on runs as absorbed_decode instead."""
    ks, vs = (k, v) if isinstance(k, tuple) else ((k,), (v,))
    B, N, T, H = q.shape
    K, S, V = ks[0].shape[1], sum(part.shape[2] for part in ks), vs[0].shape[3]
    ct = compute_dtype(q.dtype)
    pr = _precision(precision)
    add = empty = visible = tail = None
    if key_count is not None:  # (1, 1, 1, S): the keys that count
        tail = (jnp.arange(S, dtype=jnp.int32) < key_count)[None, None, None]
    if allowed is not None or bias is not None:
        ok = allowed
        if bias is not None:
            finite = bias > -jnp.inf
            ok = finite if ok is None else ok & finite
        if tail is not None:  # an empty row is one with no allowed key among those that count
            ok = ok & tail
        if sinks is None:
            empty = ~jnp.any(ok, axis=-1, keepdims=True)  # (B|1, N|1, T|1, 1): rows with no allowed key
            visible = ok | empty  # the positions mask() keeps, and an empty row's (computed finite, then replaced)
        else:  # an empty row's mass goes to the sink: nothing to replace
            visible = ok
        if bias is not None:  # 0 where hidden or in an empty row: the select below sets what is hidden
            add = jnp.where(ok, bias.astype(ct), jnp.asarray(0, ct))
    G = N // K

    def grouped(a):
        """A rank-4 (b, n, t, s) array broadcasting to (B, N, T, S) -> broadcasting to (B, K, G*T, S)."""
        b, n, t, s = a.shape
        if n > 1:  # per head: (b, N, T, s) -> (b, K, G*T, s)
            return jnp.broadcast_to(a, (b, N, T, s)).reshape(b, K, G * T, s)
        if t > 1 and G > 1:  # the same (T, s) for each of the G query heads of a K head
            return jnp.broadcast_to(a[:, :, None], (b, 1, G, T, s)).reshape(b, 1, G * T, s)
        return a

    # LOGITS and ATTEND with G and T as one axis (a free reshape of (B, N, T, H)), as impl_numpy's
    # matmuls do: XLA then fuses the whole expression, where a separate G axis costs a layout copy.
    qg = q.reshape(B, K, G * T, H).astype(ct)  # (B, K, G*T, H)
    x = [jnp.einsum(LOGITS.replace("G", ""), qg, part.astype(ct), precision=pr) for part in ks]
    x = (x[0] if len(x) == 1 else jnp.concatenate(x, axis=-1)) * jnp.asarray(scale, ct)  # (B, K, G*T, S)
    if softcap is not None:
        c = jnp.asarray(softcap, ct)
        x = jnp.tanh(x / c) * c
    if alibi is not None:
        x = x + grouped(alibi)  # (B, K, G*T, S)
    if add is not None:
        x = x + grouped(add)  # (B, K, G*T, S)
    if tail is not None:
        # -inf added past key_count, not selected: a select would split the YNNPACK fusion of the dot from
        # its operand, and XLA CPU would copy the written buffer (see attend_by_reduce); safe because
        # those positions hold finite values (the contract's), so their logits are finite
        x = x + jnp.where(tail, jnp.asarray(0, ct), jnp.asarray(-jnp.inf, ct))
    if visible is not None:  # a hidden NaN or inf logit must not reach its row (as in mask())
        x = jnp.where(grouped(visible), x, jnp.asarray(-jnp.inf, ct))  # (B, K, G*T, S)
    row_max = x.max(axis=-1, keepdims=True)  # (B, K, G*T, 1)
    sink = None
    if sinks is not None:  # (N,) -> (1, K, G*T, 1): head n = k*G + g, row g*T + t
        sink = jnp.broadcast_to(sinks.astype(ct).reshape(1, K, G, 1, 1), (1, K, G, T, 1)).reshape(1, K, G * T, 1)
        row_max = jnp.maximum(row_max, sink)
    row_max = lax.stop_gradient(row_max)  # softmax is shift-invariant
    e = jnp.exp(x - row_max)  # (B, K, G*T, S)
    total = e.sum(axis=-1, keepdims=True)
    if sink is not None:
        total = total + jnp.exp(sink - row_max)
    ctx, s0 = 0, 0
    for part in vs:  # each part's weights times its values
        w_part = e[..., s0:s0 + part.shape[2]]  # (B, K, G*T, s)
        if attend_by_reduce:  # (B, K, G*T, s, 1) x (B, K, 1, s, V) summed over s
            ctx = ctx + (w_part[..., None] * part.astype(ct)[:, :, None]).sum(axis=3)
        else:
            ctx = ctx + jnp.einsum(ATTEND.replace("G", ""), w_part, part.astype(ct), precision=pr)
        s0 += part.shape[2]
    ctx = ctx / total
    ctx = ctx.reshape(B, N, T, V)  # (B, N, T, V)
    if empty is not None:
        # the fill weights (0, 1/S or NaN) times V, as the stages' attend: V's gradient is the plain path's,
        # and "zero" gives 0 x V (NaN in a column where a value is NaN), not a plain 0
        if tail is None:
            v_sum = sum(part.astype(ct).sum(axis=2, keepdims=True) for part in vs)  # (B, K, 1, V)
        else:  # the keys that count only (an in-place buffer read whole is one part)
            counted = jnp.where(tail[0, 0, 0, :, None], vs[0].astype(ct), jnp.asarray(0, ct))  # (B, K, S, V)
            v_sum = counted.sum(axis=2, keepdims=True)
        v_sum = jnp.broadcast_to(v_sum[:, :, None], (B, K, N // K, 1, V)).reshape(B, N, 1, V)  # (B, N, 1, V)
        w = {"zero": 0.0, "uniform": 1.0 / (S if key_count is None else key_count), "nan": np.nan}[masked_row]
        fill = jnp.where(empty, jnp.asarray(w, ct), jnp.asarray(0, ct)) * v_sum  # NaN only on empty rows
        ctx = jnp.where(empty, fill, ctx)
    return ctx.astype(q.dtype)



# An absorbed (latent) decode step over an in-place cache runs in key blocks (absorbed_decode) from this many
# buffer positions on; below it (the grid's and the tests' small caches, each a program of its own to compile
# in a cold `mha check`) fused_attention runs it as one expression.
DECODE_MIN_KEYS = 1024
DECODE_BLOCK = 2048  # keys per turn of absorbed_decode's loop (1024-4096 within noise of each other)


def absorbed_decode(q, latent, rotary, scale: float, key_count=None, precision: str = "highest"):
    """fused_attention for the absorbed form's one-query step over an in-place cache read whole, with
    neither mask, bias, softcap, ALiBi nor sinks (nothing hidden but the positions past key_count): a
    fori_loop over blocks of DECODE_BLOCK keys with an online softmax (running max, sum and context,
    rescaled by exp(old max - new max) at each block): the block's logits with the keys as rows, (s, C) x
    (C, N) + (s, R) x (R, N), its context as w^T (N, s) x (s, C). The same products as fused_attention's,
    summed in another order, and the softmax's division applied to the context as there.

    Why a loop: the buffers are loop operands, so XLA CPU cannot fuse the in-place write into a layout
    change of the whole buffer and then copy it (fused_attention's attend_by_reduce), and the absorbed
    form's joined key [latent | rotary] (a copy of the cache) is never formed: the compiled HLO (jax 0.10.2,
    P 65536) holds no copy of either buffer. The DeepSeek V3.2 step (`mha bench --shapes sparse`, N 16, C
    512, R 64, float32, P 65536) took 49-54 ms of CPU against 356-379 ms as one expression, back to back on
    the 2-core AMD EPYC VM, 2026-11-30, loaded. Measured there per orientation, in the same loop of 4096-key
    blocks: logits keys as rows 11 ms; the context as w^T x latent 22 ms, as latent^T x w (a (C, N) result)
    107 ms; blocks of 1024-4096 keys within noise of each other, 8192 and 16384 slower.

    q (B, N, 1, C + R) (absorbed: functional.absorb_query), latent (B, 1, S, C), rotary (B, 1, S, R) (S: the
    buffer's capacity), key_count: the keys that count (P + S, a Python int or traced; None: all S; at least
    1) -> context (B, N, 1, C) (the attended latent, before functional.expand_values). The last block is
    clamped back to end at S; the keys it shares with the block before are hidden in it."""
    B, N, _, _ = q.shape
    S, C = latent.shape[2], latent.shape[3]
    ct = compute_dtype(q.dtype)
    pr = _precision(precision)
    block = min(DECODE_BLOCK, S)
    count = S if key_count is None else key_count
    q_lat, q_rot = q[:, :, 0, :C].astype(ct), q[:, :, 0, C:].astype(ct)  # (B, N, C), (B, N, R)
    scale = jnp.asarray(scale, ct)
    neg = jnp.asarray(-jnp.inf, ct)

    def body(i, carry):
        top, total, ctx = carry  # (B, N), (B, N), (B, N, C)
        start = jnp.minimum(i * block, S - block)
        lat = lax.dynamic_slice_in_dim(latent, start, block, axis=2)[:, 0].astype(ct)  # (B, s, C)
        rot = lax.dynamic_slice_in_dim(rotary, start, block, axis=2)[:, 0].astype(ct)  # (B, s, R)
        x = (jnp.einsum("BsC,BNC->BsN", lat, q_lat, precision=pr)
             + jnp.einsum("BsR,BNR->BsN", rot, q_rot, precision=pr)) * scale  # (B, s, N)
        x = jnp.where(_counted(i, start, block, count)[None, :, None], x, neg)  # (B, s, N)
        new_top = jnp.maximum(top, x.max(axis=1))  # (B, N): finite from the first block on (key 0 counts)
        e = jnp.exp(x - new_top[:, None])  # (B, s, N)
        rescale = _rescale(top, new_top)  # (B, N): 0 at the first block
        total = total * rescale + e.sum(axis=1)
        ctx = ctx * rescale[..., None] + jnp.einsum("BsN,BsC->BNC", e, lat, precision=pr)  # (B, N, C)
        return new_top, total, ctx

    init = (jnp.full((B, N), -jnp.inf, ct), jnp.zeros((B, N), ct), jnp.zeros((B, N, C), ct))
    _, total, ctx = lax.fori_loop(0, -(-S // block), body, init)
    ctx = ctx / total[..., None]  # (B, N, C)
    return ctx[:, :, None].astype(q.dtype)  # (B, N, 1, C)


def _counted(i, start, block: int, count):
    """(block,) bool: which keys of absorbed_decode's block i (read from `start`) count: those before `count`
    and not before i * block (the clamped last block's keys that the block before it attended)."""
    pos = start + jnp.arange(block, dtype=jnp.int32)
    return (pos >= i * block) & (pos < count)


def _rescale(top, new_top):
    """exp(old max - new max): the online softmax's factor on the sum and context of the blocks before."""
    return jnp.exp(top - new_top)
