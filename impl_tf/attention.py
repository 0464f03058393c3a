"""The call: validate, then run functional.py's stages, fused.py's fused
core, or chunked.py's chunked path: mirrors impl_numpy/attention.py.

Kept apart from functional.py so that imports point one way: this module and
chunked.py import the stages; the stages import neither.

Three paths, each honouring every feature of the config and the call (rope,
LongRoPE's table chosen by the call's positions, QK-norm (weightless, per
head, after RoPE), the value norm, softcap, windows, sinks, a cache, segment
ids, and the frontier fields: the QKV clip, the query temperature, ALiBi,
local chunks, the output gate, latent attention):
- the stages (functional.py), whenever `trace` or `return_weights` is asked
  for: the spec, stage by stage, each result stored in the storage dtype;
- `fused_attention` otherwise: logits -> [softcap] -> [alibi] -> mask ->
  softmax [+ sinks] -> dropout -> attend as one computation on the heads that
  `qkv_heads` made (project, [clip], [norm], split, [rope], [temperature],
  [cache]), the output gate after it: the scale folded
  into q, the backend's own softmax kernel (a sink-aware one where sinks are
  on), masks and masked rows handled with as few passes over the (B, N, T,
  S) scores as the call allows; compiled by XLA from XLA_MIN_SCORES scores;
- `chunk_size=` (chunked.py): impl_numpy's chunked mode, exact attention with
  an online softmax over key blocks that never holds a (T, S) array and
  skips key blocks the causal mask or a window hides.
A latent layer (MLA, config.latent) runs the expanded form on the stages
(heads.latent_heads, expand_latent) and the absorbed form on the fused,
chunked and in-place paths, as impl_numpy/chunked.py's _fused_modern: the
query through key.kernel (absorbed_heads), one shared key head [latent |
rotary key] with the latent as its values, the attended latent through
value.kernel (expanded); its cache is the latent and the rotary key.
A plain call (no modern feature, no cache, no segments) runs exactly the ops
it ran before the modern features existed.

cache_length= (an in-place cache in the caller's tf.Variables): the new keys
are written by `write_cache` (XLA, in the buffers where they lie); the fused
path then attends over the buffers' whole capacity with the positions past
P+S masked (`in_place_fused`, which says why not a slice); the stages and the
chunked path read the first P+S positions back.

Modules: call.py validates and casts the call (prepare, Call); heads.py
runs the stages up to the keys (qkv_heads) and writes an in-place cache
(write_cache); fused.py holds fused_attention; chunked.py the chunked path.
This module chooses the path (plan), runs fused_attention eagerly or through
XLA, and runs the call (multi_head_attention); the names it imports from
them remain importable from here.
"""

from __future__ import annotations

from weights import AttentionConfig
from weights.call import record
from weights.contract import Plan, check_chunk_size

from . import functional as F
from ._keras import BACKEND, TENSORFLOW, keras
from .call import (  # noqa: F401 - re-exported: attention.py was their home, and tests and callers read them here
    Call,
    check_inputs,
    check_tensors,
    past_key_buffers,
    prepare,
)
from .fused import fused_attention, may_have_empty_rows  # noqa: F401 - may_have_empty_rows re-exported
from .heads import expand_latent, latent_heads, qkv_heads, write_cache  # noqa: F401 - write_cache re-exported

if TENSORFLOW:
    from .chunked import chunked_attention

ops = keras.ops

# Why the chunked path (chunk_size=) is TensorFlow's alone, in the words a NotImplementedError carries.
CHUNKED_UNSUPPORTED = (
    f"chunk_size (the chunked path) needs Keras's TensorFlow backend (keras runs on {BACKEND}): its loop over "
    "key blocks is a tf.while_loop over XLA's dynamic slices, which keras.ops has no form of (impl_jax's "
    "and impl_torch's chunked paths are their own mirrors'); call without chunk_size"
)


# -- the path ---------------------------------------------------------------------

def plan(*, return_weights: bool, traced: bool, chunk_size: int | None) -> Plan:
    """The path of a call (the module docstring says what each computes): the
    chunked path when chunk_size is given, the stages when the weights or the
    trace are asked for, fused_attention otherwise, in every storage dtype
    (it computes in the compute dtype throughout, where the stages round each
    result to the storage dtype). The chunked path exists on TensorFlow alone (NotImplementedError elsewhere:
    CHUNKED_UNSUPPORTED)."""
    if chunk_size is not None:
        if not TENSORFLOW:
            raise NotImplementedError(CHUNKED_UNSUPPORTED)
        return Plan("chunked", f"chunk_size={chunk_size}")
    if return_weights or traced:
        return Plan("stages", "the weights or the trace are asked for")
    return Plan("fused", "no weights, no trace")


def _over_capacity(x, S_total: int, C: int, fill):
    """x (..., S_total) -> (..., C), the keys past S_total filled with `fill`;
    x (..., 1) (broadcast over the keys) or None unchanged."""
    if x is None or x.shape[-1] == 1 or C == S_total:
        return x
    return ops.pad(x, [[0, 0]] * (len(x.shape) - 1) + [[0, C - S_total]], constant_values=fill)


# -- the fused path: fused.py's core, eagerly or through XLA ------------------

# Score arrays of this many elements or more run fused_attention compiled by
# XLA, eagerly too: TensorFlow's own CPU kernels run the (T, H) x (H, S) batched
# matmuls at 20-35% of their large-matmul rate (XLA: 40-90%), and every
# elementwise op over (B, N, T, S) writes a fresh array, one page fault per 4
# KiB once it passes glibc's 32 MiB mmap threshold. XLA fuses those passes.
# Smaller calls (the conformance grid) stay eager: compiling would cost more
# than it saves. The first call of a shape pays the compile. TensorFlow only:
# on jax and torch the fused core runs as Keras runs it (eagerly; inside a
# caller's jax.jit, or a Keras model compiled with jit_compile, compiled whole).
XLA_MIN_SCORES = 2**18

if TENSORFLOW:
    from .tf_only import xla

    _fused_attention_xla = xla(fused_attention)
else:
    _fused_attention_xla = None


def _attention(q, k, v, **options):
    """fused_attention, through XLA when the scores are large (XLA_MIN_SCORES)."""
    B, N, T = q.shape[:3]
    sizes = [part.shape[2] for part in (k if isinstance(k, tuple) else (k,))]
    S = None if None in sizes else sum(sizes)
    if _fused_attention_xla is not None and None not in (N, T, S) and (B or 1) * N * T * S >= XLA_MIN_SCORES:
        return _fused_attention_xla(q, k, v, **options)
    return fused_attention(q, k, v, **options)


def _modern_core_options(config: AttentionConfig, call: Call) -> dict:
    """fused_attention's options for the config's and the call's modern features (none for a plain call,
    so that a plain call's XLA function is the one it always was)."""
    options = {}
    if config.logit_softcap is not None:
        options["softcap"] = config.logit_softcap
    if config.window_left >= 0 or config.window_right >= 0:
        options.update(window_left=config.window_left, window_right=config.window_right)
    if call.segment_ids is not None:
        options.update(segment_ids=call.segment_ids, key_segment_ids=call.key_segment_ids)
    if config.use_sinks:
        options["sinks"] = call.params["sinks"]
    if config.alibi:
        options["alibi_slopes"] = call.params["alibi.slopes"]
        if config.alibi_bias_dtype is not None:
            options["alibi_rounding"] = config.alibi_bias_dtype
    if config.local_chunk is not None:
        options["local_chunk"] = config.local_chunk
    if config.alibi or config.local_chunk is not None:
        options.update(positions=call.positions, key_positions=call.every_key_position)
    return options


def gated(config: AttentionConfig, call: Call, ctx):
    """The context (B, N, T, V) through the output gate (gate.project, gate) where the config has one, as the
    stages run it after attend: the fused and chunked cores leave it to this."""
    if config.output_gate is None:
        return ctx
    p = call.params
    return F.gate(ctx, F.gate_project(call.query, p["gate.kernel"], p.get("gate.bias")), config.num_heads)


def differenced(config: AttentionConfig, call: Call, ctx):
    """The context (B, N, T, 2V) through the differential stage (B, N/2, T, 2V) where the config has one, as the
    stages run it after attend: the fused and chunked cores leave it to this (the chunked one's merged heads
    split again)."""
    return ctx if config.differential is None else F.differential_stage(config, call.params, ctx)


def absorbed_heads(config: AttentionConfig, call: Call, *, append: bool = True):
    """A latent layer's absorbed form (impl_numpy/chunked.py's _fused_modern): the query through key.kernel,
    q (B, N, T, C + R); the keys [latent | rotary key] (B, 1, S_total, C + R) as one shared head, the
    latent (B, 1, S_total, C) as its values; and the present cache (latent, rotary key).
    append=False (an in-place cache): the keys and values are the buffers, whole (capacity positions)."""
    q, latent, rotary = latent_heads(config, call, append=append)  # (B, N, T, H), (B, 1, S|S_total, C), (.., R)
    q = F.absorb_query(q, call.params["key.kernel"], config.latent.rope_dim)  # (B, N, T, C + R)
    if not append:  # in place: the buffers, written, read whole
        latent, rotary = ops.convert_to_tensor(call.past_key), ops.convert_to_tensor(call.past_value)
    return q, ops.concatenate([latent, rotary], axis=-1), latent, (latent, rotary)


# The gather runs where the call has at least this many keys (impl_jax.latent.GATHER_MIN_KEYS says why).
GATHER_MIN_KEYS = 64


def gathers_selection(config: AttentionConfig, call: Call, is_causal: bool, causal_alignment: str) -> bool:
    """impl_numpy.chunked._selected_columns's conditions in keras.ops (impl_jax.latent.gathers_selection's): a
    one-token latent call over a selection, shared (B, 1, k) or per kv head (B, K, 1, k), shapes known, at
    least GATHER_MIN_KEYS keys and more than k, a mask (the selection in it) per batch row or per head, no
    window, local chunks, ALiBi, segments, bias or dropout, causal (if at all) bottom-right, masked_row
    "zero" (a fully masked row's "uniform" 1/S_total and "nan" fill weigh every key of S_total: the masked
    core keeps them)."""
    idx = call.topk
    shape = None if idx is None else tuple(idx.shape)
    return (config.latent is not None and shape is not None and len(shape) in (3, 4)
            and all(isinstance(n, int) for n in shape) and shape[-2] == 1 and isinstance(call.T, int) and call.T == 1
            and isinstance(call.S_total, int) and GATHER_MIN_KEYS <= call.S_total and shape[-1] < call.S_total
            and call.mask4 is not None and call.mask4.shape[1] in (1, config.num_heads)
            and call.mask4.shape[3] == call.S_total
            and call.bias4 is None and call.keep is None and call.segment_ids is None and not config.alibi
            and config.local_chunk is None and config.window_left < 0 and config.window_right < 0
            and (not is_causal or causal_alignment == "bottom_right") and config.masked_row == "zero")


def kept_slots(idx):
    """A selection's slots (R, k) sorted, and which of them gather_selected keeps: those that select a key
    (not -1), each key once (the first of its slots; equal keys are adjacent once sorted)."""
    idx = ops.sort(idx, axis=-1)  # -1 slots first
    first = ops.concatenate([ops.ones((idx.shape[0], 1), dtype="bool"), ops.not_equal(idx[:, 1:], idx[:, :-1])],
                            axis=-1)
    return idx, ops.logical_and(idx >= 0, first)


def selection_rows(topk):
    """The one query's selection (B, 1, k) or (B, Ks, 1, k) as rows (B * Ks, k) int32, and Ks (1: shared by
    every head; else one per kv head, query head n reading n // G). Row r is batch row r // Ks's head r % Ks."""
    idx = F._cast(topk, "int32")
    Ks = 1 if len(idx.shape) == 3 else idx.shape[1]
    return ops.reshape(idx, (idx.shape[0] * Ks, idx.shape[-1])), Ks


def gather_selected(config: AttentionConfig, call: Call, latent, rotary):
    """The absorbed form over the selected keys alone (gathers_selection; impl_jax.latent.gather_selected's
    way: each batch row's (and selection head's) k selected rows by index, a static width), not the whole
    cache masked. latent (B, 1, S_x, C), rotary (B, 1, S_x, R) (S_x: S_total, or an in-place buffer's
    capacity: the selection indexes S_total alone) -> keys (B, Ks, k, C + R), values (B, Ks, k, C), mask4
    (B, 1|N, 1, k): a slot is kept where it selects a key, the first of its slots, and the call's mask shows
    that key to the head (Ks: 1, or one per kv head; the core reads key head n // G for query head n)."""
    B, N, S = call.topk.shape[0], config.num_heads, call.S_total
    idx, Ks = selection_rows(call.topk)  # (B * Ks, k)
    k = idx.shape[-1]
    idx, keep = kept_slots(idx)  # (B * Ks, k) sorted, and the slots that select a key once
    safe = ops.maximum(idx, 0)  # a dropped slot reads key 0, weight 0 (keep)
    batch_row = ops.arange(B * Ks, dtype="int32")[:, None] // Ks  # (B * Ks, 1): each row's batch row

    def take(x):  # (B, 1, L, F) at each row's safe slots -> (B, Ks, k, F)
        L, width = x.shape[2], x.shape[3]
        flat = ops.reshape(safe + batch_row * L, (B * Ks * k,))
        return ops.reshape(ops.take(ops.reshape(x, (B * L, width)), flat, axis=0), (B, Ks, k, width))

    lat, rot = take(latent), take(rotary)
    M = call.mask4.shape[1]  # the mask's heads: 1, or N
    shown = ops.reshape(ops.broadcast_to(call.mask4[:, :, :1], (B, M, 1, S)), (B * M * S,))  # (B, 1|N, 1, S)
    keep = ops.reshape(keep, (B, Ks, k))
    if M == 1:  # one mask per batch row: each selection head's slots read it
        at = ops.reshape(safe, (B, Ks, k)) + ops.arange(B, dtype="int32")[:, None, None] * S
        keep = ops.logical_and(keep, ops.reshape(ops.take(shown, ops.reshape(at, (B * Ks * k,)), axis=0), (B, Ks, k)))
        if Ks > 1:
            keep = ops.repeat(keep, N // Ks, axis=1)  # (B, N, k): query head n reads its kv head's slots
    else:  # per head: head n reads its kv head's selection n // G and its own mask
        G = N // Ks
        keep = ops.repeat(keep, G, axis=1)  # (B, N, k)
        at = (ops.repeat(ops.reshape(safe, (B, Ks, k)), G, axis=1)
              + ops.reshape(ops.arange(B * N, dtype="int32"), (B, N, 1)) * S)  # (B, N, k) into (B * N * S,)
        keep = ops.logical_and(keep, ops.reshape(ops.take(shown, ops.reshape(at, (B * N * k,)), axis=0), (B, N, k)))
    return ops.concatenate([lat, rot], axis=-1), lat, ops.expand_dims(keep, 2)


def expanded(config: AttentionConfig, call: Call, ctx):
    """The absorbed form's attended latent (B, N, T, C) through each head's value up-projection (B, N, T, V);
    any other layer's context unchanged."""
    return ctx if config.latent is None else F.expand_values(ctx, call.params["value.kernel"])


def in_place_fused(config: AttentionConfig, call: Call, is_causal: bool, causal_alignment: str):
    """The fused path over an in-place cache: the new keys written into the
    buffers, then attention over their whole capacity C, the positions from
    P+S on hidden by the mask. -> output (B, T, O).

    Whole, not sliced to P+S: the variables are read where they lie, with no
    copy. A slice [:, :, :P+S] of a (B, K, C, H) buffer is no view in
    TensorFlow (it copies P+S positions every step), and a slice inside XLA
    ran slower still (measured on a (1, 8, 65537, 128) float32 variable: the
    sum of it whole 19 ms, of its slice to 65536 positions under XLA 517 ms).
    Reading C rather than P+S positions costs the spare capacity the caller
    chose; the masks over (T, C) are small beside the cache."""
    p = call.params
    if gathers_selection(config, call, is_causal, causal_alignment):  # the selected rows alone, no mask over C
        q, _, _, (latent, rotary) = absorbed_heads(config, call, append=False)
        keys, values, allowed = gather_selected(config, call, latent, rotary)
        options = {name: value for name, value in _modern_core_options(config, call).items()
                   if name in ("softcap", "sinks")}
        ctx = _attention(q, keys, values, mask4=allowed, bias=None, keep=None, is_causal=False,
                         causal_alignment=causal_alignment, scale=config.effective_scale, rate=config.dropout,
                         masked_row=config.masked_row, **options)  # the attended latent (B, N, 1, C)
        ctx = gated(config, call, differenced(config, call, expanded(config, call, ctx)))
        return F.output(F.merge_heads(ctx), p["output.kernel"], p.get("output.bias"))  # (B, T, O)
    if config.latent is not None:  # the absorbed form over the buffers (latent | rotary key), whole
        q, keys, values, _ = absorbed_heads(config, call, append=False)
    else:  # writes the new keys and values at P .. P+S-1
        q, _, _ = qkv_heads(config, call, append=False)
        keys, values = ops.convert_to_tensor(call.past_key), ops.convert_to_tensor(call.past_value)
        if config.differential is not None:  # each kv head's value joined with its pair's, over the capacity
            values = F.value_pair(values)  # (B, K, C, 2V)
    S_total, C = call.S_total, call.past_key.shape[2]
    # one bottom-right query (a decode step) sees every key: no causal mask to build
    decode_step = causal_alignment == "bottom_right" and isinstance(call.T, int) and call.T == 1
    allowed = call.allowed(config, is_causal and not decode_step, causal_alignment)  # over S_total keys, or None
    valid = (ops.arange(C) < S_total)[None, None, None]  # (1, 1, 1, C)
    allowed = valid if allowed is None else ops.logical_and(_over_capacity(allowed, S_total, C, False), valid)
    options = {name: value for name, value in _modern_core_options(config, call).items()
               if name in ("softcap", "sinks", "alibi_slopes", "alibi_rounding")}  # windows, chunks and segments are in `allowed`
    if config.alibi:  # every key's position over the capacity: the spare ones (hidden) at 0
        options.update(positions=call.positions,
                       key_positions=_over_capacity(call.every_key_position, S_total, C, 0))
    ctx = _attention(
        q, keys, values, mask4=allowed,
        bias=_over_capacity(call.bias4, S_total, C, 0.0), keep=_over_capacity(call.keep, S_total, C, False),
        is_causal=False, causal_alignment=causal_alignment, scale=config.effective_scale, rate=config.dropout,
        masked_row=config.masked_row, key_length=ops.convert_to_tensor(S_total, "int32"), **options,
    )  # (B, N, T, V), or the attended latent (B, N, T, C)
    ctx = gated(config, call, differenced(config, call, expanded(config, call, ctx)))
    return F.output(F.merge_heads(ctx), p["output.kernel"], p.get("output.bias"))  # (B, T, O)


# -- the call ------------------------------------------------------------------------

def multi_head_attention(
    config: AttentionConfig,
    tensors,
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
    """The forward pass. Returns output (B, T, O); with return_weights also
    weights (B, N, T, P+S) after softmax and before dropout; with
    return_cache also present_key (B, K, P+S, H) and present_value (B, K,
    P+S, V): (output[, weights][, present_key, present_value]). A latent
    layer's cache (weights.contract.cache_widths) is its normed latent (B, 1,
    ., C) in past_key / present_key and its rotated shared key (B, 1, ., R)
    in past_value / present_value; its `value` input is not read.
    past_key_positions (P,) or (B, P): the cached keys' positions (default
    0..P-1), as impl_numpy's, on every path (the in-place cache included).
    With config.indexer: its selection, past_index_keys, return_selection
    and present_index_keys as impl_numpy's ((output[, weights][,
    selection][, present_key, present_value[, present_index_keys]])), run
    eagerly (refused in a graph).
    topk_indices (B, T, k) or (B, K, T, k): the keys each query may see, as
    impl_numpy's (it joins the mask).

    tensors: the canonical tensors (NumPy arrays, or tensors/variables of the
    canonical shapes). dtype: compute in this storage dtype (default: the
    tensors' dtype). chunk_size: exact online softmax over key blocks of this
    size, queries in blocks of the same size; never holds a (T, S) array (see
    chunked.py). Not with return_weights or trace. trace: a list that
    receives a TraceEntry per stage.

    cache_length: an in-place cache (a Python int P). past_key (B, K, C, H)
    and past_value (B, K, C, V) are the caller's tf.Variables of the storage
    dtype whose first P positions are the cache; the call writes its new keys
    and values at P .. P+S-1 of them and computes what it would with
    past_key[:, :, :P]; with return_cache, present_key and present_value are
    the variables themselves (whole, C positions). Eagerly and in
    tf.function (the variables passed or captured). The buffers are not
    checked for infinities (that would read the whole cache every token);
    positions from P+S on must hold finite values (a zeroed buffer): the
    fused path reads them with weight 0. Inference only: refused under a
    recording GradientTape.
    """
    call = prepare(
        config, tensors, query, key, value, mask=mask, bias=bias, dropout_mask=dropout_mask,
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
    path = plan(return_weights=return_weights, traced=trace is not None, chunk_size=chunk_size).path
    p = call.params

    def result(out, w, k, v):
        if call.cache_length is not None:
            k, v = call.past_key, call.past_value  # the buffers, whole
        parts = (out,) + ((w,) if return_weights else ()) + ((call.selection,) if return_selection else ())
        if return_cache:
            parts += (k, v) + ((call.present_index_keys,) if config.indexer is not None else ())
        return parts[0] if len(parts) == 1 else parts

    if path == "chunked":
        if config.latent is not None:  # the absorbed form: one shared head [latent | rotary key], the latent as values
            _, latent, rotary = latent_heads(config, call, query=False)  # (B, 1, S_total, C), (B, 1, S_total, R)
            k, v, present = ops.concatenate([latent, rotary], axis=-1), latent, (latent, rotary)
            latent = rotary = None
        else:
            _, k, v = qkv_heads(config, call, query=False)  # (B, K, S_total, H), (B, K, S_total, V)
            present = (k, v)
            if config.differential is not None:  # each kv head's value joined with its pair's (the cache stays v)
                v = F.value_pair(v)  # (B, K, S_total, 2V)
        if not return_cache:
            present = (None, None)  # released (eagerly) with k and v before the output projection
        ctx = chunked_attention(
            config, call.query, p, k, v, positions=call.positions, mask4=call.mask4, bias=call.bias4,
            keep=call.keep, is_causal=is_causal, causal_alignment=causal_alignment, chunk_size=chunk_size,
            segment_ids=call.segment_ids, key_segment_ids=call.key_segment_ids,
            key_positions=call.every_key_position,
            rope_tables=call.rope_tables(config) if config.rope is not None else None,
            temperature_positions=None if config.query_temperature is None else call.temperature_positions(config),
        )  # (B, T, N*V): the queries are projected (and gated) block by block
        k = v = None
        if config.differential is not None:  # the merged heads split again, through the differential stage
            ctx = F.merge_heads(differenced(config, call, F.split_heads(ctx, config.num_heads)))  # (B, T, N*V)
        return result(F.output(ctx, p["output.kernel"], p.get("output.bias")), None, *present)  # (B, T, O)
    if path == "fused" and call.cache_length is not None:
        return result(in_place_fused(config, call, is_causal, causal_alignment), None, None, None)
    if path == "fused":
        # a cache nobody asks back is never concatenated: fused_attention takes it and the new keys as parts
        cache_parts = call.past_key is not None and not return_cache and config.latent is None
        cache_parts = cache_parts and config.differential is None  # value_pair reads every value
        gather = gathers_selection(config, call, is_causal, causal_alignment)
        if config.latent is not None:  # the absorbed form: q (B, N, T, C+R) over one shared head (B, 1, S_total, .)
            q, k, v, present = absorbed_heads(config, call)
        else:
            q, k, v = qkv_heads(config, call, append=not cache_parts)  # (B, N, T, H), (B, K, S_total|S, H), (.., V)
            present = (k, v)
            if config.differential is not None:  # each kv head's value joined with its pair's (the cache stays v)
                v = F.value_pair(v)  # (B, K, S_total, 2V)
        if cache_parts:
            k, v = (call.past_key, k), (call.past_value, v)
        # one bottom-right query (a decode step) sees every key: no causal mask to build and select by
        decode_step = causal_alignment == "bottom_right" and isinstance(call.T, int) and call.T == 1
        mask4 = call.mask4
        if gather:  # a decode step over a selection: the selected rows alone (impl_numpy's gather)
            k, v, mask4 = gather_selected(config, call, *present)
        ctx = _attention(
            q, k, v, mask4=mask4, bias=call.bias4, keep=call.keep, is_causal=is_causal and not decode_step,
            causal_alignment=causal_alignment, scale=config.effective_scale, rate=config.dropout,
            masked_row=config.masked_row, **_modern_core_options(config, call),
        )  # (B, N, T, V), or the attended latent (B, N, T, C)
        ctx = gated(config, call, differenced(config, call, expanded(config, call, ctx)))
        return result(F.output(F.merge_heads(ctx), p["output.kernel"], p.get("output.bias")), None, *present)
    rec = lambda stage, value: record(trace, stage, value)  # noqa: E731
    if config.latent is not None:  # the expanded form: the present cache is the latent and the rotary key
        q, present_key, present_value = latent_heads(config, call, rec)
        k, v = expand_latent(config, call, present_key, present_value, rec)
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
    return result(out, w, present_key, present_value)
