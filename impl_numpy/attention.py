"""The call: validate, then run functional.py's stages, or the fused fast
path of chunked.py where it gives the same numbers faster.

Kept apart from functional.py so that imports point one way: this module
and chunked.py import the stages; the stages import neither.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from weights import AttentionConfig, compute_dtype, dtype_from_name, validate_tensors
from weights.call import record
from weights.contract import (
    CallShapes,
    Plan,
    check_bias_values,
    check_call,
    check_chunk_size,
    check_indexer_call,
    check_input_values,
    check_position_values,
    check_topk_values,
    in_place_buffer_error,
)
from weights.dtypes import is_float
from weights.rope import mrope_axes, rope_tables

from . import functional as F
from .heads import qkv_heads
from .latent import expand as expand_latent
from .latent import latent_heads

# The fused fast path's chunk_size: key blocks of 512 (query blocks of chunked.QUERY_ROWS).
FUSED_BLOCK = 512

# A one-query call (a decode step, T 1) takes its keys in one block where its (B, N, 1, S_total) logits fit in
# this many bytes (else in the largest blocks that fit): one logits matmul, the softmax over every key, one
# attend matmul, the core's own stages on that block (masks, sinks, softcap, masked_row: nothing else
# changes). Its logits are N rows per batch row, not a (T, S) square, so one block costs N S itemsize bytes
# (4 MiB at N 16, S 65537, float32). In 512-key blocks the same step ran 128 blocks of small BLAS calls
# with an online-softmax rescale between them (docs/performance.md, "Sparse attention decode").
DECODE_BLOCK_BYTES = 16 * 2**20


def fused_block(config: AttentionConfig, shapes, dtype) -> int:
    """The fused path's key block: FUSED_BLOCK, or for one query (T 1) every key that fits DECODE_BLOCK_BYTES
    of logits (never fewer than FUSED_BLOCK)."""
    if shapes.T != 1:
        return FUSED_BLOCK
    per_key = shapes.B * config.num_heads * np.dtype(compute_dtype(dtype)).itemsize
    return max(FUSED_BLOCK, min(shapes.S_total, DECODE_BLOCK_BYTES // per_key))


@dataclasses.dataclass
class Call:
    """One validated call, every array in its storage dtype (ids and positions int64)."""

    shapes: CallShapes
    params: dict[str, np.ndarray]
    query: np.ndarray  # (B, T, Dq)
    key: np.ndarray  # (B, S, Dk)
    value: np.ndarray  # (B, S, Dv)
    mask4: np.ndarray | None  # (B|1, N|1, T|1, S_total|1) bool
    bias4: np.ndarray | None  # same, compute dtype
    keep: np.ndarray | None  # dropout keep-mask (B, N, T, S_total), or None
    dtype: np.dtype
    positions: np.ndarray | None  # (B|1, T) where the config reads positions (config.reads_positions)
    key_positions: np.ndarray | None  # (B|1, S)
    past_key: np.ndarray | None  # (B, K, P, H); with cache_length the caller's buffer (B, K, C, H)
    past_value: np.ndarray | None  # (B, K, P, V); with cache_length (B, K, C, V)
    segment_ids: np.ndarray | None  # (T,) or (B, T)
    key_segment_ids: np.ndarray | None  # (S_total,) or (B, S_total)
    cache_length: int | None = None  # P of an in-place cache (past_key/past_value are buffers), else None
    past_key_positions: np.ndarray | None = None  # (B|1, P) the cached keys' positions (default 0..P-1), or None
    selected: bool = False  # topk_indices was given: mask4 holds the selection (the fused core skips unselected blocks)
    selection: np.ndarray | None = None  # config.indexer's selection (B, T, k) or (B, K, T, k) int64, joined to mask4
    present_index_keys: np.ndarray | None = None  # (B, P+S, J); with cache_length the caller's buffer (B, C, J)
    # kv_shared (issue 42): the cache's last S = T entries, the queries' own keys and values (B, K, S, H|V)
    shared_key: np.ndarray | None = None
    shared_value: np.ndarray | None = None

    def allowed(self, config: AttentionConfig, is_causal: bool, causal_alignment: str):
        """mask AND causal AND window AND segments over every key (rank 4), or None."""
        return F.allowed_mask(self.mask4, self.shapes.T, self.shapes.S_total, is_causal, causal_alignment,
                              window_left=config.window_left, window_right=config.window_right,
                              segment_ids=self.segment_ids, key_segment_ids=self.key_segment_ids,
                              local_chunk=config.local_chunk, positions=self.positions,
                              key_positions=self.every_key_position)

    @property
    def max_position(self) -> int | None:
        """The call's largest position (its queries' and new keys'): longrope's choice of table."""
        given = [int(x.max()) for x in (self.positions, self.key_positions) if x is not None and x.size]
        return max(given) if given else None

    def rope_tables(self, config: AttentionConfig):
        """weights.rope.rope_tables for this call (longrope picks its table by the call's largest position)."""
        return rope_tables(config.rope, self.max_position)

    @property
    def every_key_position(self) -> np.ndarray | None:
        """(B|1, P+S): the cache's keys at past_key_positions (0..P-1 by default), then key_positions (where
        the config reads positions)."""
        if self.key_positions is None:
            return None
        return F.all_key_positions(self.key_positions, self.shapes.P, self.past_key_positions)

    def temperature_positions(self, config: AttentionConfig) -> np.ndarray:
        """(B|1, T): the positions the query temperature reads (functional.temperature_positions)."""
        return F.temperature_positions(self.positions, config.query_temperature.position, self.shapes.P,
                                       self.shapes.T)

    def alibi_bias(self, config: AttentionConfig) -> np.ndarray:
        """ALiBi's (B|1, N, T, P+S) bias in compute dtype (functional.alibi_bias)."""
        return F.alibi_bias(self.params["alibi.slopes"], self.positions, self.every_key_position, self.dtype,
                            config.alibi_bias_dtype)

    @property
    def modern(self) -> bool:
        """Uses a cache, packed segments or a selection (the config's own features: config.is_modern)."""
        return self.past_key is not None or self.segment_ids is not None or self.selected


def plan(*, return_weights: bool, traced: bool, chunk_size: int | None, dtype) -> Plan:
    """The path of a call: the chunked core when chunk_size is given; the
    stages when the weights or the trace are asked for (they are the stages'
    results) or the storage is 16-bit (every stage's result is rounded to
    it, which the fused core, computing in float32, does not do); else the
    fused core (chunked.py with key blocks of FUSED_BLOCK)."""
    if chunk_size is not None:
        return Plan("chunked", f"chunk_size={chunk_size}")
    if return_weights or traced:
        return Plan("stages", "the weights or the trace are asked for")
    if compute_dtype(dtype) != dtype:
        return Plan("stages", f"{np.dtype(dtype).name} storage: every stage's result is rounded to it")
    return Plan("fused", "no weights, no trace, float32/float64 storage")


def _optional(x):
    return None if x is None else np.asarray(x)


def _meta(x, name):  # check_call's shape and dtype arguments of one optional input
    return {f"{name}_shape": None if x is None else x.shape, f"{name}_dtype": None if x is None else x.dtype.name}


def prepare(config, tensors, query, key, value, *, mask, bias, dropout_mask, is_causal, causal_alignment,
            training, seed, return_weights, dtype, positions=None, key_positions=None, past_key=None,
            past_value=None, segment_ids=None, key_segment_ids=None, return_cache=False, cache_length=None,
            materializes_scores=True, past_key_positions=None, topk_indices=None, past_index_keys=None,
            trace: list | None = None) -> Call:
    """Validate a call and cast everything to the storage dtype. topk_indices joins the mask (mask4 = mask AND
    functional.selection_mask): every path, the backward and the magnitudes read the selection there. With
    config.indexer the indexer makes that selection here (run_indexer), so every path attends to it; a trace
    receives its stages (weights.call.INDEXER_STAGES), the first of the call's."""
    stored = validate_tensors(config, tensors)
    dtype = stored if dtype is None else dtype_from_name(dtype)
    query = np.asarray(query)
    keys_given = key is not None or value is not None  # else self-attention: the keys are the queries
    key = query if key is None else np.asarray(key)
    value = key if value is None else np.asarray(value)
    optional = {name: _optional(x) for name, x in (
        ("mask", mask), ("bias", bias), ("dropout_mask", dropout_mask), ("positions", positions),
        ("key_positions", key_positions), ("past_key", past_key), ("past_value", past_value),
        ("segment_ids", segment_ids), ("key_segment_ids", key_segment_ids),
        ("past_key_positions", past_key_positions), ("topk_indices", topk_indices))}
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not is_float(x.dtype):
            raise ValueError(f"{name} must be a float array: got dtype {x.dtype}")
    meta = {}
    for name, x in optional.items():
        meta.update(_meta(x, name))
    shapes = check_call(
        config, query_shape=query.shape, key_shape=key.shape, value_shape=value.shape, **meta,
        is_causal=is_causal, causal_alignment=causal_alignment, training=training, seed=seed,
        return_weights=return_weights, return_cache=return_cache, cache_length=cache_length,
        materializes_scores=materializes_scores, scores_itemsize=compute_dtype(dtype).itemsize,
        keys_given=keys_given,
    )
    check_input_values(query=query, key=None if key is query else key, value=None if value is key else value)
    check_position_values(config, optional["positions"])
    if optional["topk_indices"] is not None:
        check_topk_values(optional["topk_indices"], shapes.P, shapes.S)
    check_indexer_call(config, topk_indices is not None, past_index_keys, shapes, cache_length)
    in_place = shapes.capacity is not None
    if in_place:
        past_key, past_value = past_key_buffers(past_key, past_value, dtype)
    else:
        past_key, past_value = optional["past_key"], optional["past_value"]
        # (an in-place cache is not checked: a check reads the whole cache once more every token, and
        # its positions were written by earlier calls from checked inputs, or by the caller)
        if past_key is not None:
            check_input_values(past_key=past_key, past_value=past_value)
    bias_np = optional["bias"]
    if bias_np is not None:
        check_bias_values(bias_np)
        bias_np = bias_np.astype(compute_dtype(dtype)).reshape(shapes.bias_shape)
    params = {name: t.astype(dtype, copy=False) for name, t in tensors.items()}
    keep = optional["dropout_mask"]
    if training and keep is None and config.dropout > 0:
        keep = F.dropout_keep_mask((shapes.B, config.num_heads, shapes.T, shapes.S_total), config.dropout, seed)
    if not training:
        keep = None
    mask_np = None if optional["mask"] is None else optional["mask"].reshape(shapes.mask_shape)
    segment_ids, key_segment_ids = optional["segment_ids"], optional["key_segment_ids"]
    if segment_ids is not None and key_segment_ids is None:
        key_segment_ids = segment_ids  # self-attention without a cache: the keys are the queries (check_call)
    positioned = config.reads_positions  # RoPE, ALiBi, local chunks and the temperature read the positions
    call = Call(
        shapes=shapes, params=params, query=query.astype(dtype, copy=False), key=key.astype(dtype, copy=False),
        value=value.astype(dtype, copy=False), mask4=mask_np,
        bias4=bias_np, keep=keep, dtype=dtype,
        positions=F.default_positions(optional["positions"], shapes.P, shapes.T) if positioned else None,
        key_positions=F.default_positions(optional["key_positions"], shapes.P, shapes.S) if positioned else None,
        past_key=None if past_key is None else past_key.astype(dtype, copy=False),
        past_value=None if past_value is None else past_value.astype(dtype, copy=False),
        segment_ids=segment_ids, key_segment_ids=key_segment_ids, cache_length=shapes.P if in_place else None,
        past_key_positions=F.default_positions(optional["past_key_positions"], 0, shapes.P)
        if positioned and optional["past_key_positions"] is not None else None,
        selected=optional["topk_indices"] is not None or config.indexer is not None,
    )
    if config.kv_shared:
        share_cache(call)
    axes = None if config.rope is None else mrope_axes(config.rope)
    if axes is not None:  # multimodal RoPE: each rotating pair's position, (B|1, L, R/2); nothing reads the cache's
        call.positions = F.mrope_positions(optional["positions"], shapes.P, shapes.T, axes)
        call.key_positions = F.mrope_positions(optional["key_positions"], shapes.P, shapes.S, axes)
        call.past_key_positions = None
    selection = optional["topk_indices"]
    if config.indexer is not None:
        selection = run_indexer(config, call, is_causal, causal_alignment, optional["positions"],
                                optional["key_positions"], past_index_keys,
                                rec=lambda stage, value: record(trace, stage, value))
    if selection is not None:  # the selection joins the mask: (B, 1|N, T, S_total)
        selected = F.selection_mask(selection, config.num_heads, shapes.S_total)
        call.mask4 = selected if call.mask4 is None else call.mask4 & selected
    return call


def share_cache(call: Call) -> None:
    """kv_shared (issue 42): the given cache's last S = T entries become the call's new keys and values
    (call.shared_key / shared_value), read, never written: the cache before them is call.past_key / past_value
    (P = check_shared_call's P - T); an in-place cache's buffers stay whole, the shared entries views of them."""
    P, S = call.shapes.P, call.shapes.S
    call.shared_key, call.shared_value = call.past_key[:, :, P:P + S], call.past_value[:, :, P:P + S]
    if call.cache_length is None:
        call.past_key, call.past_value = call.past_key[:, :, :P], call.past_value[:, :, :P]


def index_mask(config: AttentionConfig, call: Call, is_causal: bool, causal_alignment: str) -> np.ndarray | None:
    """The keys the indexer may select, (B|1, 1, T, P+S) bool, or None (every key): those every other mask of
    the call shows the query (call.allowed, before the selection joins it), any head's."""
    allowed = call.allowed(config, is_causal, causal_alignment)  # (B|1, N|1, T|1, S_total|1) or None
    if allowed is None:
        return None
    return np.broadcast_to(allowed.any(axis=1, keepdims=True), (allowed.shape[0], 1, call.shapes.T,
                                                                  call.shapes.S_total))


def run_indexer(config: AttentionConfig, call: Call, is_causal: bool, causal_alignment: str, positions,
                key_positions, past_index_keys, rec=lambda stage, value: value) -> np.ndarray:
    """config.indexer's selection for this call (impl_numpy.indexer.lightning_indexer), its index cache kept
    in call.present_index_keys (with cache_length written into the caller's buffer at P..P+S-1, the buffer
    whole). The keys it may choose from are those every other mask of the call shows the query (causal in
    the call's alignment, the mask, windows, local chunks, segments: call.allowed), any head's: a hidden key
    never takes a slot. The selection is piecewise constant in every input: no gradient flows through it,
    and the indexer's own tensors get none from the attention's output (DeepSeek trains them apart, with a
    KL loss against the attention's scores). rec: the call's trace recorder, handed to lightning_indexer."""
    from .indexer import lightning_indexer

    P = call.shapes.P
    mask = index_mask(config, call, is_causal, causal_alignment)
    in_place = past_index_keys is not None and call.cache_length is not None
    if in_place:
        buffer = past_index_keys
        if not isinstance(buffer, np.ndarray) or buffer.dtype != call.dtype or not buffer.flags.writeable:
            raise in_place_buffer_error("past_index_keys", f"be a writeable numpy array of the storage dtype "
                                        f"{call.dtype.name}", f"{type(buffer).__name__} {getattr(buffer, 'dtype', '')}")
    # in place, the indexer writes the new index keys into the buffer at P..P+S-1 and scores over its first P+S
    # rows (no copy of the index cache a step); present_index_keys is then the buffer, whole
    result = lightning_indexer(config, call.params, call.query, call.key, positions=positions,
                               key_positions=key_positions, past_index_keys=past_index_keys, mask=mask,
                               is_causal=False, dtype=call.dtype.name, precision=config.indexer.scoring_precision,
                               fp8_scale_format=config.indexer.fp8_scale_format,
                               cache_length=P if in_place else None, rec=rec)
    call.present_index_keys = result["present_index_keys"]
    call.selection = result["topk_indices"]
    return call.selection


def past_key_buffers(past_key, past_value, dtype: np.dtype):
    """The buffers of an in-place cache (cache_length=), as given: NumPy
    arrays of the storage dtype that can be written (a cast or a read-only
    array would write a copy the caller never sees)."""
    for name, buffer in (("past_key", past_key), ("past_value", past_value)):
        if not isinstance(buffer, np.ndarray) or buffer.dtype != dtype or not buffer.flags.writeable:
            what = (f"a {type(buffer).__name__}" if not isinstance(buffer, np.ndarray) else
                    f"a read-only {buffer.dtype} array" if not buffer.flags.writeable else f"dtype {buffer.dtype}")
            raise in_place_buffer_error(name, f"be a writeable numpy array of the storage dtype {dtype.name}", what)
    return past_key, past_value


def multi_head_attention(
    config: AttentionConfig,
    tensors: dict[str, np.ndarray],
    query: np.ndarray,
    key: np.ndarray | None = None,
    value: np.ndarray | None = None,
    *,
    mask: np.ndarray | None = None,
    bias: np.ndarray | None = None,
    is_causal: bool = False,
    causal_alignment: str = "top_left",
    training: bool = False,
    dropout_mask: np.ndarray | None = None,
    seed: int | None = None,
    positions: np.ndarray | None = None,
    key_positions: np.ndarray | None = None,
    past_key: np.ndarray | None = None,
    past_value: np.ndarray | None = None,
    segment_ids: np.ndarray | None = None,
    key_segment_ids: np.ndarray | None = None,
    past_key_positions: np.ndarray | None = None,
    topk_indices: np.ndarray | None = None,
    past_index_keys: np.ndarray | None = None,
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
    P+S, V): (output[, weights][, selection][, present_key, present_value[,
    present_index_keys]]) (weights.call.result_names).

    past_key_positions (P,) or (B, P): the cached keys' positions (default
    0..P-1), read by ALiBi and local chunks as key_positions are (a
    left-padded row: index - pads); RoPE was applied to them when they were new.

    topk_indices (B, T, k) or (B, K, T, k), integer: the keys each query may
    see (one selection for every head, or one per kv head), indexed over the
    cache's P keys first (0..P-1), then the new ones (P..P+S-1); -1 pads an
    unused slot, a key given twice is selected once, any other value is
    refused. ANDed with every other mask (functional.selection_mask): a
    query left with no visible key is a fully masked row (masked_row).

    cache_length: an in-place cache. past_key (B, K, C, H) and past_value
    (B, K, C, V) are the caller's buffers (writeable, of the storage dtype)
    whose first cache_length = P positions are the cache; the call writes
    its new keys and values at P .. P+S-1 of them and computes what it would
    with past_key[:, :, :P]; with return_cache, present_key and
    present_value are the buffers themselves (whole, C positions). The
    buffers are not checked for infinities (that would read the whole cache
    every token). Inference only (impl_numpy.backward refuses it).

    dtype: compute in this storage dtype (default: the tensors' dtype).
    chunk_size: exact online-softmax over key blocks of this size; never
    holds a (T, S) array (see chunked.py). Not with return_weights or trace.

    Fast path: when nothing between the projections is asked for (no trace,
    no weights) and the storage dtype computes in itself (float32, float64),
    logits ... attend run fused, block by block, in chunked.py's core (key
    blocks of FUSED_BLOCK, hidden causal and window blocks skipped): the same
    results to round-off (but see chunked.py on NaN in a hidden key). The
    stages are the spec; the trace, the weights and 16-bit storage (whose
    every stage result is rounded) take them.
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
    path = plan(return_weights=return_weights, traced=trace is not None, chunk_size=chunk_size, dtype=call.dtype).path
    if path in ("chunked", "fused"):
        from .chunked import fused_forward

        out, present_key, present_value = fused_forward(
            config, call, is_causal=is_causal, causal_alignment=causal_alignment,
            chunk_size=fused_block(config, call.shapes, call.dtype) if chunk_size is None else chunk_size,
            return_cache=return_cache)  # (B, T, O)
        if call.cache_length is not None:
            present_key, present_value = call.past_key, call.past_value  # the buffers, whole
        return _result(call, out, None, present_key, present_value, return_selection, return_cache)

    rec = lambda stage, value: record(trace, stage, value)  # noqa: E731
    p = call.params
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
    if call.cache_length is not None:
        present_key, present_value = call.past_key, call.past_value  # the buffers, whole
    return _result(call, out, w if return_weights else None, present_key, present_value, return_selection,
                   return_cache)


def _result(call: Call, out, weights, present_key, present_value, return_selection: bool, return_cache: bool):
    """(output[, weights][, selection][, present_key, present_value[, present_index_keys]]), or output alone."""
    result = (out,) + ((weights,) if weights is not None else ()) + ((call.selection,) if return_selection else ())
    if return_cache:
        result += (present_key, present_value)
        if call.present_index_keys is not None:
            result += (call.present_index_keys,)
    return result[0] if len(result) == 1 else result
