"""The fused fast path's core: logits -> [softcap] -> [alibi] -> mask ->
softmax [+ sinks] -> dropout -> attend as one computation on the heads
(fused_attention), for calls that ask for neither the trace nor the weights,
and the test that tells a call whose rows can all be empty
(may_have_empty_rows). attention.py chooses it and runs it, eagerly or
compiled by XLA (XLA_MIN_SCORES).
"""

from __future__ import annotations

import math

from . import backend as bk
from . import functional as F
from ._keras import keras
from .backend import constant, matmul, matmul_nt, maximum, softmax, tanh, where

ops = keras.ops


def may_have_empty_rows(mask4, bias, is_causal: bool, causal_alignment: str, T, S, *, windowed: bool = False,
                        segments: bool = False, chunks: bool = False) -> bool:
    """False only where no query row can lose every key: no mask, no bias, no
    window, no segments, no local chunks (a query's chunk may hold no key), and
    causal (if at all) aligned so that every query sees key 0 or more."""
    if mask4 is not None or bias is not None or windowed or segments or chunks:
        return True
    if not is_causal or causal_alignment == "top_left":
        return False
    return not (isinstance(T, int) and isinstance(S, int) and S >= T)  # bottom_right: query 0 sees S - T + 1 keys


def fused_attention(q, k, v, *, mask4, bias, keep, is_causal: bool, causal_alignment: str, scale: float,
                    rate: float, masked_row: str, softcap: float | None = None, window_left: int = -1,
                    window_right: int = -1, segment_ids=None, key_segment_ids=None, sinks=None, key_length=None,
                    alibi_slopes=None, local_chunk: int | None = None, positions=None, key_positions=None,
                    alibi_rounding: str | None = None):
    """logits -> [softcap] -> [alibi] -> mask -> softmax [+ sinks] -> dropout -> attend
    as one computation, for calls that ask for neither the trace nor the
    weights: q (B, N, T, H), k (B, K, S, H), v (B, K, S, V) -> (B, N, T, V) in
    the storage dtype (S: every key, a cache's included).

    Equal to the stages within the tolerance policy (the arithmetic runs in the
    compute dtype throughout; the stages round each result to the storage
    dtype). The differences of form: the scale multiplies q (T*H values, not
    T*S); the backend's softmax kernel (keras.ops.softmax; with sinks, the softmax written out:
    max, exp and sum with the sink's term); a position whose bias is -inf is
    folded into the allowed mask, so that, as in the spec, no masked position
    passes a gradient; and a fully masked row (every allowed flag False) is
    found on the (broadcast) mask instead of the scores, then given its
    `masked_row` value with one select. Its softmax is NaN before that
    select, and that NaN reaches no gradient: every position of such a row is
    masked, and the mask's select passes none. With sinks no row is empty:
    a fully masked one is 0, as the spec says, with no select.

    alibi_slopes (N,) with positions (B|1, T) and every key's key_positions
    (B|1, S): ALiBi's bias (functional.alibi_bias, in the compute dtype) added
    after the softcap, so the slopes get their gradient; local_chunk with the
    same positions: the chunk mask (functional.allowed_mask).

    key_length (an in-place cache read whole): a scalar tensor, the number of
    keys that count (P + S); the keys past it are the buffers' spare
    positions, which mask4 hides (the caller builds its causal, window,
    local chunk and segment masks over key_length keys and pads them:
    is_causal, windows, chunks and segments are not passed with it; ALiBi's
    key_positions cover the whole capacity, any position past key_length). A
    uniform masked row spreads over key_length keys. A hidden key gets weight 0 exactly, so its value must be
    finite (the contract's rule for the spare positions).
    """
    dtype = F.dtype_name(q)
    ct = F.compute_dtype(dtype)
    # k and v may be tuples of parts along S (a cache and the new keys, not concatenated): their
    # logits are joined instead ((T, S) values where the keys are (S, H)), the context summed per part
    ks, vs = (k, v) if isinstance(k, (tuple, list)) else ((k,), (v,))
    B, N, T, H = bk.shape(q)
    K, V = ks[0].shape[1], vs[0].shape[-1]
    S = bk.shape(ks[0])[2]
    for part in ks[1:]:
        S = S + bk.shape(part)[2]
    # LOGITS and ATTEND as matmuls on the grouped (B, K, G*T, .) queries, as impl_numpy computes
    # them: XLA runs these 1.3-1.7x faster than the 5-D einsum's dot.
    qg = bk.reshape(F._cast(q, ct) * constant(scale, ct), (B, K, (N // K) * T, H))  # (B, K, G*T, H)
    if key_length is not None:
        # an in-place cache (one part, T small beside S): the keys as the matmul's left operand, (S, H) x
        # (H, G*T), then the small (S, G*T) result transposed; XLA's CPU dot ran the (G*T, H) x (H, S)
        # form 2.5-3.5x slower on a (1, 8, 65537, 128) cache (measured: 228 ms against 62-96 ms)
        x = [ops.transpose(matmul_nt(F._cast(ks[0], ct), qg), (0, 1, 3, 2))]  # (B, K, G*T, S)
    else:
        x = [matmul_nt(qg, F._cast(part, ct)) for part in ks]  # (B, K, G*T, S_part) each
    x = bk.reshape(x[0] if len(x) == 1 else ops.concatenate(x, axis=-1), (B, N, T, S))  # (B, N, T, S), scaled
    if softcap is not None:  # before mask and bias, as the spec's stage
        cap = constant(softcap, ct)
        x = tanh(x / cap) * cap
    if alibi_slopes is not None:  # after the softcap, before mask and bias, as the spec's stage
        x = x + F.alibi_bias(alibi_slopes, positions, key_positions, dtype, alibi_rounding)
    allowed = F.allowed_mask(mask4, T, S, is_causal, causal_alignment, window_left=window_left,
                             window_right=window_right, segment_ids=segment_ids, key_segment_ids=key_segment_ids,
                             local_chunk=local_chunk, positions=positions, key_positions=key_positions)
    if bias is not None:
        x = x + bias
        finite = bias > constant(-math.inf, ct)  # (B|1, N|1, T|1, S|1)
        allowed = finite if allowed is None else ops.logical_and(allowed, finite)
    if allowed is not None:
        x = where(allowed, x, constant(-math.inf, ct))
    if sinks is None:
        w = softmax(x)  # (B, N, T, S); a row with no allowed key is NaN here
        if may_have_empty_rows(mask4, bias, is_causal, causal_alignment, T, S,
                               windowed=window_left >= 0 or window_right >= 0, segments=segment_ids is not None,
                               chunks=local_chunk is not None):
            empty = ops.logical_not(ops.any(allowed, axis=-1, keepdims=True))  # (B|1, N|1, T|1, 1), on the mask
            fill = {"zero": 0.0, "uniform": 1.0, "nan": math.nan}[masked_row]
            if masked_row != "uniform":
                fill = constant(fill, ct)
            elif key_length is None:
                fill = constant(fill, ct) / ops.cast(S, ct)
            else:  # over the keys that count; 0 on the hidden ones
                fill = where(ops.arange(S) < key_length, constant(fill, ct) / ops.cast(key_length, ct),
                             constant(0.0, ct))
            w = where(empty, fill, w)
    else:
        sink = bk.reshape(F._cast(sinks, ct), (1, N, 1, 1))  # (1, N, 1, 1)
        shift = ops.stop_gradient(maximum(ops.max(x, axis=-1, keepdims=True), sink))  # finite: the sink is
        e = ops.exp(x - shift)  # (B, N, T, S); masked -> exactly 0
        w = e / (ops.sum(e, axis=-1, keepdims=True) + ops.exp(sink - shift))
    if keep is not None:
        w = where(keep, w / constant(1.0 - rate, ct), constant(0.0, ct))
    wg = bk.reshape(w, (B, K, (N // K) * T, S))  # (B, K, G*T, S)
    if len(vs) == 1:
        ctx = matmul(wg, F._cast(vs[0], ct))  # (B, K, G*T, V)
    else:  # each part's weights times its values
        ctx, s0 = None, 0
        for part in vs:
            s1 = s0 + bk.shape(part)[2]
            term = matmul(wg[..., s0:s1], F._cast(part, ct))  # (B, K, G*T, V)
            ctx, s0 = term if ctx is None else ctx + term, s1
    return F._cast(bk.reshape(ctx, (B, N, T, V)), dtype)  # (B, N, T, V)
