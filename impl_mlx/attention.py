"""The call: validate, then run functional.py's stages, MLX's fused kernel
(fused.py: mx.fast.scaled_dot_product_attention) or chunked.py's online
softmax: mirrors impl_numpy/attention.py.

Kept apart from functional.py so that imports point one way: this module
and the cores import the stages; the stages import neither.

Paths (plan, each predicate named). chunk_size= takes the chunked core.
The weights or a trace take the stages (they are the stages' results).
Otherwise the fused kernel takes the call unless it cannot compute it:
dropout (the kernel has no keep-mask), a logit softcap (no counterpart),
or float64 storage (the kernel computes in float32 whatever its inputs'
dtype: its float64 results carry float32's error, measured in
tests/test_mlx.py); those take the stages. Every path honours every
feature of the config and the call: the projections, clip, QK-norm, RoPE,
temperature and the cache run as the stages (heads.qkv_heads) before
either core; ALiBi, windows, local chunks, segments, the selection
(topk_indices, or the lightning indexer's: in the mask, call.prepare), bias and sinks are part of
both; the output gate runs after. A latent layer (MLA, latent.py)
runs its expanded form on the stages and its absorbed form on the fused and
chunked cores and the in-place cache, as impl_numpy does; a one-token call of
it over a selection gathers the selected rows on the fused path
(latent.gather_selected) instead of masking the whole cache.

In-place cache (cache_length=P): past_key (B, K, C, H) and past_value
(B, K, C, V) are the caller's mx.arrays of the storage dtype; the call
writes its new keys and values at P .. P+S-1 by slice assignment, which
MLX applies to the caller's array objects (the written buffers are the
caller's own, no copy handed back), and with return_cache returns them whole.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from weights import AttentionConfig
from weights.call import record
from weights.contract import Plan, check_chunk_size

from . import functional as F
from .call import prepare
from .chunked import chunked_attention
from .convert import np_dtype
from .fused import sdpa_attend
from .heads import qkv_heads
from .latent import absorbed, expand, gather_selected, gathers_selection, latent_heads

FLOAT64_REFUSAL = ("float64 storage: mx.fast.scaled_dot_product_attention computes in float32 whatever its "
                   "inputs' dtype (its float64 results carry float32's error)")


# Why a differential layer whose fully masked rows are NaN (masked_row "nan") takes the stages: the NaN row's
# cotangent (the differential norm's backward of a NaN context) reaches the fused kernel's backward, which multiplies
# the masked keys' zero weights by it; the stages' select (functional.where) drops it, as the spec's backward does.
DIFFERENTIAL_NAN_ROWS = ("masked_row nan with differential: a NaN row's cotangent reaches the fused kernel's "
                         "backward, which multiplies the masked keys' zero weights by it (the stages drop it)")


def plan(config: AttentionConfig, *, return_weights: bool, traced: bool, chunk_size: int | None, dropout: bool,
         dtype) -> Plan:
    """The path of a call: the chunked core when chunk_size is given; the stages when the weights or the trace
    are asked for, a dropout keep-mask applies, the config has a logit softcap, or the storage is float64;
    else the fused kernel. dtype: a NumPy or MLX storage dtype."""
    dtype = np.dtype(dtype) if not isinstance(dtype, mx.Dtype) else np_dtype(dtype)
    if chunk_size is not None:
        return Plan("chunked", f"chunk_size={chunk_size}")
    if return_weights or traced:
        return Plan("stages", "the weights or the trace are asked for (the fused kernel returns neither)")
    if dropout:
        return Plan("stages", "a dropout keep-mask applies (the fused kernel takes none; the stages apply it)")
    if config.logit_softcap is not None:
        return Plan("stages", "a logit softcap has no counterpart in mx.fast.scaled_dot_product_attention")
    if dtype == np.float64:
        return Plan("stages", FLOAT64_REFUSAL)
    if config.differential is not None and config.masked_row == "nan":
        return Plan("stages", DIFFERENTIAL_NAN_ROWS)
    return Plan("fused", "no weights, no trace, no dropout, no softcap, 32- or 16-bit storage")


def multi_head_attention(
    config: AttentionConfig,
    params: dict,
    query,
    key=None,
    value=None,
    *,
    mask=None,
    bias=None,
    is_causal: bool = False,
    causal_alignment: str = "top_left",
    training: bool = False,
    dropout_mask=None,
    seed: int | None = None,
    positions=None,
    key_positions=None,
    past_key=None,
    past_value=None,
    segment_ids=None,
    key_segment_ids=None,
    past_key_positions=None,
    topk_indices=None,
    past_index_keys=None,
    return_weights: bool = False,
    return_selection: bool = False,
    return_cache: bool = False,
    cache_length: int | None = None,
    dtype: str | None = None,
    chunk_size: int | None = None,
    trace: list | None = None,
):
    """The forward pass (impl_numpy.multi_head_attention's arguments and results, mx.arrays out; inputs NumPy
    arrays or mx.arrays). Returns output (B, T, O); with return_weights also weights (B, N, T, P+S); with
    return_cache also present_key (B, K, P+S, H) and present_value (B, K, P+S, V).

    topk_indices (B, T, k) or (B, K, T, k), integer: the keys each query may see, as impl_numpy's (indexed
    over the cache's keys then the new ones, -1 an unused slot); it joins the mask on every path (the fused
    kernel's bool mask, the chunked core's blocks, which skips the key blocks nothing selects).
    With config.indexer: its selection (impl_mlx.indexer, under mx.stop_gradient) joins the mask instead;
    past_index_keys (B, P, J) (with cache_length the caller's buffer (B, C, J), written in place),
    return_selection and present_index_keys as impl_numpy's: (output[, weights][, selection][, present_key,
    present_value[, present_index_keys]]).
    cache_length: an in-place cache (see the module docstring); inference and gradients alike (MLX's
    slice assignment is differentiable), the buffers written whatever the transform.
    chunk_size: exact online softmax over blocks of this size (chunked.py). Not with return_weights or trace.
    Differentiable with mx.vjp / mx.grad on every path.
    """
    call = prepare(
        config, params, query, key, value, mask=mask, bias=bias, dropout_mask=dropout_mask,
        is_causal=is_causal, causal_alignment=causal_alignment, training=training, seed=seed,
        positions=positions, key_positions=key_positions, past_key=past_key, past_value=past_value,
        segment_ids=segment_ids, key_segment_ids=key_segment_ids, return_weights=return_weights,
        return_cache=return_cache, cache_length=cache_length, dtype=dtype,
        materializes_scores=chunk_size is None or return_weights, past_key_positions=past_key_positions,
        topk_indices=topk_indices, past_index_keys=past_index_keys, trace=trace,
    )
    if return_selection and call.selection is None:
        raise ValueError("return_selection needs config.indexer (a layer without one makes no selection)")
    chunk_size = check_chunk_size(chunk_size, return_weights=return_weights, traced=trace is not None)
    path = plan(config, return_weights=return_weights, traced=trace is not None, chunk_size=chunk_size,
                dropout=call.keep is not None, dtype=call.dtype).path
    p = call.params
    rec = lambda stage, value: record(trace, stage, value)  # noqa: E731
    if path in ("chunked", "fused"):
        values_up = gathered = None
        if config.latent is not None:  # the absorbed form: one shared head of width C + R over the latent
            q, k, v = latent_heads(config, call)
            cache = k, v
            if path == "fused" and gathers_selection(config, call, is_causal, causal_alignment):
                k, v, gathered = gather_selected(config, call, k, v)  # a decode step: the selected rows alone
            q, k, v = absorbed(config, call, q, k, v)
            values_up = p["value.kernel"]
        else:
            q, k, v = qkv_heads(config, call)
            cache = k, v
            if config.differential is not None:  # each kv head's value joined with its pair's (the cache stays v)
                v = F.value_pair(v)  # (B, K, S_total, 2V)
        if path == "chunked":
            out = chunked_attention(config, call, q, k, v, is_causal=is_causal, causal_alignment=causal_alignment,
                                    chunk_size=chunk_size, values_up=values_up)
        else:
            out = _fused(config, call, q, k, v, is_causal, causal_alignment, values_up, gathered)
        present_key, present_value = cache
    else:
        if config.latent is not None:  # the expanded form: the present cache is the latent and the rotary key
            q, present_key, present_value = latent_heads(config, call, rec)
            k, v = expand(config, call, present_key, present_value, rec)
        else:
            q, k, v = qkv_heads(config, call, rec)
            present_key, present_value = k, v
            if config.differential is not None:  # each kv head's value joined with its pair's (the cache stays v)
                v = rec("value.pair", F.value_pair(v))  # (B, K, S_total, 2V)
        allowed = call.allowed(config, is_causal, causal_alignment)
        x = rec("logits", F.logits(q, k, config.effective_scale))  # (B, N, T, S_total)
        if config.logit_softcap is not None:
            x = rec("softcap", F.softcap(x, config.logit_softcap))
        if config.alibi:
            x = rec("alibi", F.alibi(x, call.alibi_bias(config)))
        x = rec("mask", F.mask_stage(x, allowed, call.bias4))
        w = rec("softmax", F.softmax(x, config.masked_row, p.get("sinks")))  # (B, N, T, S_total)
        wd = rec("dropout", F.dropout(w, call.keep, config.dropout))
        ctx = rec("attend", F.attend(wd, v))  # (B, N, T, V)
        if config.differential is not None:  # the halves subtracted with lambda, normed, scaled
            ctx = rec("differential", F.differential_stage(config, p, ctx))  # (B, N/2, T, 2V)
        if config.output_gate is not None:
            g = rec("gate.project", F.gate_project(call.query, p["gate.kernel"], p.get("gate.bias")))
            ctx = rec("gate", F.gate(ctx, g, config.num_heads))  # (B, N, T, V)
        ctx = rec("merge_heads", F.merge_heads(ctx))  # (B, T, N*V)
        out = rec("output", F.output(ctx, p["output.kernel"], p.get("output.bias")))  # (B, T, O)
    if call.cache_length is not None:
        present_key, present_value = call.past_key, call.past_value  # the buffers, whole
    result = (out,) + ((w,) if return_weights else ()) + ((call.selection,) if return_selection else ())
    if return_cache:
        result += (present_key, present_value) + ((call.present_index_keys,) if config.indexer is not None else ())
    return result[0] if len(result) == 1 else result


def _fused(config, call, q, k, v, is_causal: bool, causal_alignment: str, values_up, gathered=None):
    """logits .. attend through fused.sdpa_attend, then [expand_values] -> [gate] -> merge_heads -> output.
    gathered: the selected keys' own mask (B, 1|N, 1, k) where k and v are a decode step's gathered rows
    (latent.gather_selected), else None."""
    p = call.params
    T, S = q.shape[2], k.shape[2]
    bias = call.bias4
    if config.alibi:
        alibi = call.alibi_bias(config)
        bias = alibi if bias is None else alibi + bias
    # MLX's own causal mask aligns bottom-right: it serves a causal call of that alignment (or T == S) that
    # nothing else masks, where T <= S (T > S leaves the first T - S rows without a key, which MLX gives the
    # mean of V, not the masked_row policy); every other mask is folded into a bool mask
    only_causal = (is_causal and bias is None and call.mask4 is None and config.window_left < 0
                   and config.window_right < 0 and config.local_chunk is None and call.segment_ids is None
                   and T <= S and (causal_alignment == "bottom_right" or T == S))
    allowed = gathered if gathered is not None else None if only_causal else call.allowed(config, is_causal,
                                                                                          causal_alignment)
    ctx = sdpa_attend(config, q, k, v, allowed=allowed, bias=bias, sinks=p.get("sinks"),
                      bottom_right_causal=only_causal)  # (B, N, T, V|C)
    if values_up is not None:  # the attended latent through each head's value up-projection
        ctx = F.expand_values(ctx, values_up)  # (B, N, T, V)
    if config.differential is not None:  # the halves subtracted with lambda, normed, scaled: (B, N/2, T, 2V)
        ctx = F.differential_stage(config, p, ctx)
    if config.output_gate is not None:
        ctx = F.gate(ctx, F.gate_project(call.query, p["gate.kernel"], p.get("gate.bias")), config.num_heads)
    return F.output(F.merge_heads(ctx), p["output.kernel"], p.get("output.bias"))  # (B, T, O)
