"""The call: validate, then run functional.py's stages, the fused XLA
expression, or chunked.py's online softmax: mirrors impl_numpy/attention.py.

Kept apart from functional.py so that imports point one way: this module
and chunked.py import the stages; the stages import neither.

Paths. With return_weights or a trace, or dropout, or 16-bit storage, every
stage runs as written. Otherwise logits .. attend run as one expression
(fused_attention: same einsums, softmax normalised on the context), which
XLA CPU compiles into one kernel instead of five passes over (B, N, T, S).
chunk_size= takes chunked.py's online softmax over blocks instead: no (T, S)
array, causal and window-hidden blocks skipped. Every path honours every
feature of the config and the call: the projections, QK-norm, RoPE and the
cache, the QKV clip and the query temperature run as the stages (qkv_heads)
before the fused expression and before the chunked core of a modern call;
softcap, ALiBi, windows, local chunks, segment ids and sinks are part of both
cores; the output gate runs as its stages after either (the chunked core:
per query block, before the output projection). A latent layer (MLA,
latent.py) runs its expanded form on the stages and its absorbed form (one
shared head over the latent, never expanded) on the fused and chunked cores
and the in-place cache, as impl_numpy does; a decode step over a selection
on the fused path gathers the selected rows and attends to them alone
(latent.gather_selected, impl_numpy's chunked._selected_columns).

float64 needs JAX's x64 mode. This module never switches it on (that would
change the default dtypes of every other JAX program in the process); a
float64 call without it raises ValueError saying how to enable it, instead
of silently computing in float32. impl_jax.adapter (the conformance entry
point) does enable it.

`apply` is pure and works under jax.jit, jax.grad and jax.vmap. Validation
(weights.contract.check_call) reads only static shapes and dtypes, so it runs
at trace time; the one value check (NaN / +inf in bias) runs only when bias
is concrete (eager calls), so jit callers check bias themselves
(weights.contract.check_bias_values; the adapter does). Under jit pass
STATIC_ARGNAMES as static_argnames; positions, the cache and segment ids are
traced arrays (a new value does not recompile, a new shape does). An
in-place cache's cache_length is static there too (each value compiles a
program); a jitted function of the caller's may pass it traced instead (see
apply).

Modules: call.py validates and casts the call (check, prepare, Call);
heads.py runs the stages up to the keys (qkv_heads) and names a trace's
stages; fused.py holds the fused expression; chunked.py the chunked core.
This module chooses the path (plan) and runs it (apply); the names it
imports from them remain importable from here.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from weights import AttentionConfig, compute_dtype
from weights.call import record
from weights.contract import Plan, check_chunk_size

from . import functional as F
from .call import (  # noqa: F401 - re-exported: attention.py was their home, and tests and callers read them here
    IN_PLACE_MESSAGE,
    X64_MESSAGE,
    Call,
    check,
    check_in_place,
    check_params,
    check_traced_length,
    concrete_length,
    in_place_allowed,
    is_concrete,
    is_traced_length,
    pad_to_capacity,
    prepare,
    x64_enabled,
)
from .chunked import chunked_attention
from .fused import absorbed_decode, fused_attention
from .heads import qkv_heads, trace_stages  # noqa: F401 - trace_stages re-exported (impl_jax's public name)
from .latent import absorbed, decodes_in_blocks, expand, gather_selected, gathers_selection, latent_heads

# Arguments of `apply` that must be static under jax.jit (hashable Python values).
STATIC_ARGNAMES = (
    "config", "is_causal", "causal_alignment", "training", "seed", "return_weights", "return_cache", "precision",
    "dtype", "chunk_size", "cache_length",
)


def plan(*, return_weights: bool, traced: bool, chunk_size: int | None, dropout: bool, dtype) -> Plan:
    """The path of a call: the chunked core when chunk_size is given; the
    stages when the weights or the trace are asked for, when a dropout
    keep-mask applies (dropout: training with a mask or a rate), or in
    16-bit storage (every stage's result is rounded to it); else
    fused_attention."""
    if chunk_size is not None:
        return Plan("chunked", f"chunk_size={chunk_size}")
    if return_weights or traced:
        return Plan("stages", "the weights or the trace are asked for")
    if dropout:
        return Plan("stages", "a dropout keep-mask applies (the stages apply it)")
    if compute_dtype(dtype) != dtype:
        return Plan("stages", f"{np.dtype(dtype).name} storage: every stage's result is rounded to it")
    return Plan("fused", "no weights, no trace, no dropout, float32/float64 storage")


def apply(
    config: AttentionConfig,
    params: dict[str, Any],
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
    rng=None,
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
    cache_length=None,
    precision: str = "highest",
    dtype: str | None = None,
    chunk_size: int | None = None,
    trace: list | None = None,
):
    """The forward pass, pure. Returns output (B, T, O); with return_weights
    also weights (B, N, T, P+S) after softmax and before dropout; with
    return_cache also present_key (B, K, P+S, H) and present_value (B, K,
    P+S, V): (output[, weights][, present_key, present_value]).

    params: canonical name -> array ("query.kernel" (D, N, H), ...).
    seed / rng: dropout in training without a dropout_mask: an int seed
    (static under jit) or a jax.random key (traced).
    positions (T,) or (B, T), key_positions (S,) or (B, S): integer RoPE
    positions (default P + arange); past_key (B, K, P, H) and past_value
    (B, K, P, V): the cache, after norm and RoPE; segment_ids (T,) or (B, T)
    and key_segment_ids (S_total,) or (B, S_total): packed sequences;
    past_key_positions (P,) or (B, P): the cached keys' positions (default
    0..P-1; not with a traced cache_length); topk_indices (B, T, k) or (B, K,
    T, k): the keys each query may see, impl_numpy's (joins the mask; not with
    a traced cache_length). All traced arrays under jit.
    With config.indexer: its selection (impl_jax.indexer, under
    lax.stop_gradient), past_index_keys (B, P, J) (with a static
    cache_length the buffer (B, C, J)), return_selection and
    present_index_keys as impl_numpy's: (output[, weights][, selection][,
    present_key, present_value[, present_index_keys]]).
    cache_length: an in-place cache (the contract's; impl_numpy's). past_key
    (B, K, C, H) and past_value (B, K, C, V) are buffers of the storage dtype
    whose first cache_length = P positions are the cache; the call writes its
    new keys and values at P .. P+S-1 (lax.dynamic_update_slice) and computes
    what it would with past_key[:, :, :P]. JAX arrays are immutable, so it
    needs return_cache=True: present_key and present_value are the written
    buffers, whole (C positions). Written in place, without a copy of the
    cache, under jax.jit with the buffers donated (donate_argnums; the given
    arrays are then deleted: keep the returned ones for the next call);
    eagerly, or without donation, XLA writes a new buffer. A Python int is
    static (STATIC_ARGNAMES: each P compiles its own program). Under jit it
    may instead be a traced int32 scalar (one program for every P, as a
    decode loop wants): the call then attends over all C positions with
    those from P+S on hidden, so it takes no mask, bias, dropout, segment
    ids, return_weights, trace, chunk_size or masked_row='uniform' (each
    sized or weighted by P+S), and is_causal or a window needs
    causal_alignment='bottom_right' whatever P it is given, as a static P > 0
    does; its range 0 <= P <= C - S cannot be checked
    (XLA clamps a start past C - S to C - S: the caller's to keep in range).
    dtype: compute in this storage dtype (default: the params' dtype).
    chunk_size: exact online softmax over key (and query) blocks of this size;
    never holds a (T, S) array and skips key blocks the causal mask or a
    window hides (see chunked.py; static under jit). Not with return_weights
    or trace.
    trace: a list that receives a TraceEntry per stage (trace_stages(config));
    inside jit the entries hold tracers, so return them from the jitted
    function to read them (impl_jax.adapter does).
    """
    call = prepare(
        config, params, query, key, value, mask=mask, bias=bias, dropout_mask=dropout_mask,
        is_causal=is_causal, causal_alignment=causal_alignment, training=training, seed=seed, rng=rng,
        positions=positions, key_positions=key_positions, past_key=past_key, past_value=past_value,
        segment_ids=segment_ids, key_segment_ids=key_segment_ids, return_weights=return_weights,
        return_cache=return_cache, cache_length=cache_length, dtype=dtype, precision=precision,
        materializes_scores=chunk_size is None or return_weights, past_key_positions=past_key_positions,
        topk_indices=topk_indices, past_index_keys=past_index_keys, trace=trace,
    )
    if return_selection and call.selection is None:
        raise ValueError("return_selection needs config.indexer (a layer without one makes no selection)")

    def result(out, w, k, v):  # (output[, weights][, selection][, present_key, present_value[, index keys]])
        parts = (out,) + ((w,) if return_weights else ()) + ((call.selection,) if return_selection else ())
        if return_cache:
            parts += (k, v) + ((call.present_index_keys,) if config.indexer is not None else ())
        return parts[0] if len(parts) == 1 else parts

    chunk_size = check_chunk_size(chunk_size, return_weights=return_weights, traced=trace is not None)
    if call.traced_length and (trace is not None or chunk_size is not None):
        given = "trace" if trace is not None else f"chunk_size={chunk_size}"
        raise ValueError(f"a traced cache_length attends over the whole buffer and cannot take {given} (sized "
                         "by P + S, unknown at trace time): pass cache_length as a Python int (static)")
    p, pr, dtype = call.params, precision, call.dtype
    if chunk_size is not None:
        common = dict(mask=call.mask4, bias=call.bias4, keep=call.keep, is_causal=is_causal,
                      causal_alignment=causal_alignment, chunk_size=chunk_size, precision=precision)
        if not (config.is_modern or call.modern or return_cache):
            return chunked_attention(config, p, call.query, call.key, call.value, **common)
        # norm, rope and the cache as the stages, then the core on the heads (as impl_numpy's _fused_modern)
        values_up = None
        if config.latent is not None:  # the absorbed form: one shared head of width C + R over the latent
            q, k, v = latent_heads(config, call, pr)
            heads, values_up = absorbed(config, call, q, k, v, pr), p["value.kernel"]
        else:
            q, k, v = qkv_heads(config, call, pr)
            # differential: each kv head's value joined with its pair's, (B, K, S_total, 2V) (the cache stays v)
            heads = (q, k, v if config.differential is None else F.value_pair(v))
        positioned = config.alibi or config.local_chunk is not None  # the core reads every key's position
        out = chunked_attention(config, p, None, None, None, heads=heads, segment_ids=call.segment_ids,
                                key_segment_ids=call.key_segment_ids, gate_input=call.query, values_up=values_up,
                                positions=call.positions if positioned else None,
                                key_positions=call.every_key_position if positioned else None, **common)
        if call.cache_length is not None:
            k, v = call.past_key, call.past_value  # the written buffers, whole
        return result(out, None, k, v)
    rec = lambda stage, value: record(trace, stage, value)  # noqa: E731
    fused = plan(return_weights=return_weights, traced=trace is not None, chunk_size=None,
                 dropout=call.keep is not None, dtype=dtype).path == "fused"
    # A cache nobody asks back is never concatenated: the fused expression takes it and the new keys as
    # two parts (at P 32768 under jax.jit, 2 x 128 MiB: attention on the cache alone 67-71 ms,
    # concatenate then attention 133-163 ms, on the 2-core Xeon VM, 2026-11-25).
    parts = fused and call.past_key is not None and not return_cache and config.latent is None
    parts = parts and config.differential is None  # differential: value_pair reads every value (the cache's too)
    in_place = call.cache_length is not None
    # An in-place cache on the fused path is read whole, the positions past P+S hidden (fused_attention's
    # key_count): XLA CPU writes a slice [:P+S] of the written buffer out before the dot, and then copies
    # the donated buffers as well (compiled HLO, jax 0.10.2, buffers (1, 8, 65536, 128) at P 61440: both
    # slices written out and 4 copies of the buffers; none when read whole). Reading the C - P - S spare
    # positions costs their share of one read instead. The paths that need exactly P+S keys (the stages:
    # trace and weights; chunked) take the slice.
    whole = in_place and (fused or call.traced_length)
    if whole:
        call.hides_tail = call.traced_length or call.shapes.P + call.shapes.S < call.shapes.capacity
        if call.hides_tail and not call.traced_length:
            pad_to_capacity(call)
    gathered = None  # a decode step over a selection: the selected keys' own mask (latent.gather_selected)
    blocked = False  # an absorbed decode step in key blocks (fused.absorbed_decode)
    if config.latent is not None:  # k and v: the present cache (the latent and the rotary key) until expanded
        q, k, v = latent_heads(config, call, pr, rec, whole=whole)
        cache = k, v
        if fused and gathers_selection(config, call, is_causal, causal_alignment):  # (impl_numpy's gather)
            q, k, v, gathered = gather_selected(config, call, q, k, v, call.allowed(config, is_causal,
                                                                                     causal_alignment, tail=False), pr)
        elif fused and decodes_in_blocks(config, call, is_causal, causal_alignment, whole):
            q, blocked = F.absorb_query(q, p["key.kernel"], config.latent.rope_dim, pr), True  # k, v: the buffers
        else:
            q, k, v = absorbed(config, call, q, k, v, pr) if fused else (q, *expand(config, call, k, v, pr, rec))
    else:
        q, k, v = qkv_heads(config, call, pr, rec, append=not parts, whole=whole)
        cache = k, v
        if config.differential is not None:  # each kv head's value joined with its pair's (the cache stays v)
            v = rec("value.pair", F.value_pair(v))  # (B, K, S_total, 2V)
    allowed = call.allowed(config, is_causal, causal_alignment, tail=not fused) if gathered is None else gathered
    if fused:
        # nothing asks for the stages between: logits .. attend as one expression (the same
        # contractions; results equal to the stages' within the tolerance policy)
        if parts:
            k, v = (call.past_key, k), (call.past_value, v)
        if blocked:
            ctx = absorbed_decode(q, k, v, config.effective_scale, call.cache_length + call.shapes.S
                                  if call.hides_tail else None, pr)
        else:
            ctx = fused_attention(q, k, v, allowed, call.bias4, config.effective_scale, config.masked_row, pr,
                                  softcap=config.logit_softcap, sinks=p.get("sinks"),
                                  alibi=call.alibi_bias(config) if config.alibi else None,
                                  key_count=call.cache_length + call.shapes.S if call.hides_tail and gathered is None
                                  else None,
                                  attend_by_reduce=in_place and call.shapes.T == 1 and gathered is None)
        if config.latent is not None:  # the attended latent through each head's value up-projection
            ctx = F.expand_values(ctx, p["value.kernel"], pr)  # (B, N, T, V)
    else:
        x = rec("logits", F.logits(q, k, config.effective_scale, pr))  # (B, N, T, S_total)
        if config.logit_softcap is not None:
            x = rec("softcap", F.softcap(x, config.logit_softcap))
        if config.alibi:
            x = rec("alibi", F.alibi(x, call.alibi_bias(config)))
        x = rec("mask", F.mask_stage(x, allowed, call.bias4))
        w = rec("softmax", F.softmax(x, config.masked_row, p.get("sinks")))  # (B, N, T, S_total)
        wd = rec("dropout", F.dropout(w, call.keep, config.dropout))
        ctx = rec("attend", F.attend(wd, v, pr))  # (B, N, T, V)
    if config.differential is not None:  # the halves subtracted with lambda, normed, scaled
        ctx = rec("differential", F.differential_stage(config, p, ctx))  # (B, N/2, T, 2V)
    if config.output_gate is not None:
        g = rec("gate.project", F.gate_project(call.query, p["gate.kernel"], p.get("gate.bias"), pr))
        ctx = rec("gate", F.gate(ctx, g, config.num_heads))  # (B, N, T, V)
    ctx = rec("merge_heads", F.merge_heads(ctx))  # (B, T, N*V)
    out = rec("output", F.output(ctx, p["output.kernel"], p.get("output.bias"), pr))  # (B, T, O)
    k, v = cache  # the present cache (a latent layer's: its latent and rotary key)
    if call.cache_length is not None:
        k, v = call.past_key, call.past_value  # the written buffers, whole
    return result(out, w if return_weights else None, k, v)


# The spec's name for the whole call.
multi_head_attention = apply
