"""One call of impl_mlx's attention, validated and cast: `prepare` (the contract's checks in the
reference's words, weights.contract.check_call on shapes and dtypes, the value checks on the arrays, then
every array in its storage dtype as an mx.array) and the `Call` it returns. attention.py runs the call;
this module imports neither it nor heads.py, fused.py or chunked.py.

Inputs may be NumPy arrays or mx.arrays (mx.vjp hands the function mx.arrays; MLX evaluates them when a
check reads their values, which it may do inside mx.vjp).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import mlx.core as mx
import numpy as np

from weights import DTYPES, AttentionConfig, compute_dtype, dtype_from_name, validate_tensors
from weights.call import record
from weights.contract import (
    CallShapes,
    check_bias_values,
    check_call,
    check_indexer_call,
    check_input_values,
    check_position_values,
    check_topk_values,
    in_place_buffer_error,
)
from weights.dtypes import is_float
from weights.rope import mrope_axes, rope_tables

from . import functional as F
from .convert import dtype_name, np_dtype, to_mx, to_mx_dtype, to_numpy
from .indexer import lightning_indexer


def _np_dtype_of(x) -> np.dtype:
    return np_dtype(x.dtype) if isinstance(x, mx.array) else np.dtype(x.dtype)


def _as_array(x):
    """mx and NumPy arrays as they are; anything else through NumPy."""
    return x if isinstance(x, (mx.array, np.ndarray)) else np.asarray(x)


def check_params(config: AttentionConfig, params) -> np.dtype:
    """Names, shapes and the one dtype of `params` (mx or NumPy arrays) in weights.validate_tensors'
    words; returns the storage dtype. Values are checked where tensors enter (the layer, the adapter)."""
    params = {name: _as_array(t) for name, t in params.items()}
    expected = config.tensor_shapes()
    dtypes = {_np_dtype_of(t) for t in params.values()}
    if (set(params) == set(expected) and all(tuple(params[n].shape) == shape for n, shape in expected.items())
            and len(dtypes) == 1 and next(iter(dtypes)) in DTYPES.values()):
        return next(iter(dtypes))
    return validate_tensors(config, {n: np.broadcast_to(np.zeros((), _np_dtype_of(t)), t.shape)
                                     for n, t in params.items()})


@dataclasses.dataclass
class Call:
    """One validated call, every float array an mx.array of its storage dtype (bias in compute dtype)."""

    shapes: CallShapes
    params: dict[str, mx.array]
    query: mx.array  # (B, T, Dq)
    key: mx.array  # (B, S, Dk)
    value: mx.array  # (B, S, Dv)
    mask4: Any  # (B|1, N|1, T|1, S_total|1) bool, or None
    bias4: Any  # same, compute dtype, or None
    keep: Any  # dropout keep-mask (B, N, T, S_total), or None
    dtype: Any  # the mx storage dtype
    positions: Any  # (B|1, T) int64 where the config reads positions, else None
    key_positions: Any  # (B|1, S)
    past_key: Any  # (B, K, P, H) or None; with cache_length the caller's buffer (B, K, C, H)
    past_value: Any  # (B, K, P, V) or None; with cache_length (B, K, C, V)
    segment_ids: Any  # (T,) or (B, T), or None
    key_segment_ids: Any  # (S_total,) or (B, S_total)
    cache_length: int | None = None  # P of an in-place cache (past_key/past_value are buffers), else None
    past_key_positions: Any = None  # (B|1, P) the cached keys' positions, or None
    selected: bool = False  # topk_indices or config.indexer: mask4 holds the selection (the chunked core skips unselected blocks)
    selection: Any = None  # config.indexer's selection (B, T, k) or (B, K, T, k) int64, joined to mask4, or None
    topk: Any = None  # the selection that joined mask4 (topk_indices, or the indexer's) as an mx.array, or None
    present_index_keys: Any = None  # (B, P+S, J); with cache_length the caller's buffer (B, C, J)
    # kv_shared (issue 42): the cache's last S = T entries, the queries' own keys and values (B, K, S, H|V)
    shared_key: Any = None
    shared_value: Any = None

    def allowed(self, config: AttentionConfig, is_causal: bool, causal_alignment: str):
        """mask AND causal AND window AND local chunks AND segments over every key (rank 4), or None."""
        return F.allowed_mask(self.mask4, self.shapes.T, self.shapes.S_total, is_causal, causal_alignment,
                              window_left=config.window_left, window_right=config.window_right,
                              segment_ids=self.segment_ids, key_segment_ids=self.key_segment_ids,
                              local_chunk=config.local_chunk, positions=self.positions,
                              key_positions=self.every_key_position)

    @property
    def max_position(self) -> int | None:
        """The call's largest position (its queries' and new keys'): longrope's choice of table."""
        given = [int(x.max().item()) for x in (self.positions, self.key_positions) if x is not None and x.size]
        return max(given) if given else None

    def rope_tables(self, config: AttentionConfig):
        """weights.rope.rope_tables for this call (longrope picks its table by the call's largest position)."""
        return rope_tables(config.rope, self.max_position)

    @property
    def every_key_position(self):
        """(B|1, P+S): the cache's keys at past_key_positions (0..P-1 by default), then key_positions."""
        if self.key_positions is None:
            return None
        return F.all_key_positions(self.key_positions, self.shapes.P, self.past_key_positions)

    def temperature_positions(self, config: AttentionConfig):
        """(B|1, T): the positions the query temperature reads (functional.temperature_positions)."""
        return F.temperature_positions(self.positions, config.query_temperature.position, self.shapes.P,
                                       self.shapes.T)

    def alibi_bias(self, config: AttentionConfig):
        """ALiBi's (B|1, N, T, P+S) bias in compute dtype (functional.alibi_bias)."""
        return F.alibi_bias(self.params["alibi.slopes"], self.positions, self.every_key_position, self.dtype,
                            config.alibi_bias_dtype)

    @property
    def modern(self) -> bool:
        """Uses a cache, packed segments or a selection (the config's own features: config.is_modern)."""
        return self.past_key is not None or self.segment_ids is not None or self.selected


def _meta(x, name):  # check_call's shape and dtype arguments of one optional input
    return {f"{name}_shape": None if x is None else tuple(x.shape), f"{name}_dtype": None if x is None else dtype_name(x)}


def _ids(x):
    """An integer input (positions, segment ids) as an mx.array, or None."""
    return None if x is None else to_mx(x)


def prepare(config, params, query, key, value, *, mask, bias, dropout_mask, is_causal, causal_alignment,
            training, seed, return_weights, dtype, positions=None, key_positions=None, past_key=None,
            past_value=None, segment_ids=None, key_segment_ids=None, return_cache=False, cache_length=None,
            materializes_scores=True, past_key_positions=None, topk_indices=None, past_index_keys=None,
            trace: list | None = None) -> Call:
    """Validate a call in the reference's order and words and cast everything to the storage dtype. topk_indices
    joins the mask (mask4 = mask AND functional.selection_mask), as impl_numpy's: every path reads it there; with
    config.indexer its selection does (run_indexer), a trace receiving its stages first."""
    stored = check_params(config, params)
    np_storage = stored if dtype is None else dtype_from_name(dtype)
    query = _as_array(query)
    keys_given = key is not None or value is not None  # else self-attention: the keys are the queries
    key = query if key is None else _as_array(key)
    value = key if value is None else _as_array(value)
    optional = {name: None if x is None else _as_array(x) for name, x in (
        ("mask", mask), ("bias", bias), ("dropout_mask", dropout_mask), ("positions", positions),
        ("key_positions", key_positions), ("past_key", past_key), ("past_value", past_value),
        ("segment_ids", segment_ids), ("key_segment_ids", key_segment_ids),
        ("past_key_positions", past_key_positions), ("topk_indices", topk_indices))}
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not is_float(_np_dtype_of(x)):
            raise ValueError(f"{name} must be a float array: got dtype {dtype_name(x)}")
    meta = {}
    for name, x in optional.items():
        meta.update(_meta(x, name))
    shapes = check_call(
        config, query_shape=tuple(query.shape), key_shape=tuple(key.shape), value_shape=tuple(value.shape), **meta,
        is_causal=is_causal, causal_alignment=causal_alignment, training=training, seed=seed,
        return_weights=return_weights, return_cache=return_cache, cache_length=cache_length,
        materializes_scores=materializes_scores, scores_itemsize=compute_dtype(np_storage).itemsize,
        keys_given=keys_given,
    )
    check_input_values(query=to_numpy(query), key=None if key is query else to_numpy(key),
                       value=None if value is key else to_numpy(value))
    if optional["positions"] is not None:
        check_position_values(config, to_numpy(optional["positions"]))
    selection = optional["topk_indices"]
    if selection is not None:
        check_topk_values(to_numpy(selection), shapes.P, shapes.S)
    check_indexer_call(config, selection is not None, past_index_keys, shapes, cache_length)
    in_place = shapes.capacity is not None
    if in_place:
        past_key, past_value = past_key_buffers(optional["past_key"], optional["past_value"], np_storage)
    else:
        past_key, past_value = optional["past_key"], optional["past_value"]
        if past_key is not None:  # (an in-place cache is not checked: it would read the whole cache every token)
            check_input_values(past_key=to_numpy(past_key), past_value=to_numpy(past_value))
        past_key = None if past_key is None else to_mx(past_key, np_storage)
        past_value = None if past_value is None else to_mx(past_value, np_storage)
    bias4 = optional["bias"]
    if bias4 is not None:
        check_bias_values(to_numpy(bias4).astype(np.float64))
        bias4 = to_mx(bias4, compute_dtype(np_storage)).reshape(shapes.bias_shape)
    cast = {name: to_mx(t, np_storage) for name, t in params.items()}
    keep = optional["dropout_mask"]
    keep = None if keep is None else to_mx(keep).astype(mx.bool_)
    if training and keep is None and config.dropout > 0:
        keep = F.dropout_keep_mask((shapes.B, config.num_heads, shapes.T, shapes.S_total), config.dropout, seed)
    if not training:
        keep = None
    mask4 = optional["mask"]
    mask4 = None if mask4 is None else to_mx(mask4).astype(mx.bool_).reshape(shapes.mask_shape)
    if selection is not None:  # the selection joins the mask: (B, 1|N, T, S_total)
        selected = F.selection_mask(to_mx(selection), config.num_heads, shapes.S_total)
        mask4 = selected if mask4 is None else mask4 & selected
    segment_ids, key_segment_ids = _ids(optional["segment_ids"]), _ids(optional["key_segment_ids"])
    if segment_ids is not None and key_segment_ids is None:
        key_segment_ids = segment_ids  # self-attention without a cache: the keys are the queries (check_call)
    positioned = config.reads_positions  # RoPE, ALiBi, local chunks and the temperature read the positions
    call = Call(
        shapes=shapes, params=cast, query=to_mx(query, np_storage), key=to_mx(key, np_storage),
        value=to_mx(value, np_storage), mask4=mask4, bias4=bias4, keep=keep, dtype=to_mx_dtype(np_storage),
        positions=F.default_positions(_ids(optional["positions"]), shapes.P, shapes.T) if positioned else None,
        key_positions=F.default_positions(_ids(optional["key_positions"]), shapes.P, shapes.S) if positioned else None,
        past_key=past_key, past_value=past_value, segment_ids=segment_ids, key_segment_ids=key_segment_ids,
        cache_length=shapes.P if in_place else None,
        past_key_positions=F.default_positions(_ids(optional["past_key_positions"]), 0, shapes.P)
        if positioned and optional["past_key_positions"] is not None else None,
        selected=selection is not None or config.indexer is not None,
        topk=None if selection is None else to_mx(selection),
    )
    axes = None if config.rope is None else mrope_axes(config.rope)
    if axes is not None:  # multimodal RoPE: each rotating pair's position, (B|1, L, R/2); nothing reads the cache's
        call.positions = F.mrope_positions(_ids(optional["positions"]), shapes.P, shapes.T, axes)
        call.key_positions = F.mrope_positions(_ids(optional["key_positions"]), shapes.P, shapes.S, axes)
        call.past_key_positions = None
    if config.indexer is not None:
        run_indexer(config, call, is_causal, causal_alignment, optional["positions"], optional["key_positions"],
                    past_index_keys, rec=lambda stage, value: record(trace, stage, value))
    if config.kv_shared:
        share_cache(call)
    return call


def share_cache(call: Call) -> None:
    """kv_shared (issue 42; impl_numpy.attention.share_cache): the given cache's last S = T entries become
    call.shared_key / shared_value, read, never written; the cache before them is call.past_key / past_value (an
    in-place cache's buffers stay whole)."""
    P, S = call.shapes.P, call.shapes.S
    call.shared_key, call.shared_value = call.past_key[:, :, P:P + S], call.past_value[:, :, P:P + S]
    if call.cache_length is None:
        call.past_key, call.past_value = call.past_key[:, :, :P], call.past_value[:, :, :P]


def run_indexer(config: AttentionConfig, call: Call, is_causal: bool, causal_alignment: str, positions,
                key_positions, past_index_keys, rec=lambda stage, value: value) -> None:
    """impl_numpy.attention.run_indexer in MLX: the indexer's selection (impl_mlx.indexer) over the keys every
    other mask shows (call.allowed before the selection joins it, any head's), joined to call.mask4;
    call.selection and call.present_index_keys set (an in-place cache: the new index keys written into the
    caller's buffer at P..P+S-1 by slice assignment, the buffer whole). Under mx.stop_gradient: the selection is
    piecewise constant, and the indexer's tensors get no gradient from the output (zeros)."""
    T, S, P = call.shapes.T, call.shapes.S, call.shapes.P
    allowed = call.allowed(config, is_causal, causal_alignment)
    mask = None if allowed is None else mx.broadcast_to(mx.any(allowed, axis=1, keepdims=True),
                                                        (allowed.shape[0], 1, T, P + S))
    buffer = None
    past = None if past_index_keys is None else _as_array(past_index_keys)
    if past is not None and call.cache_length is not None:
        buffer = past
        if not isinstance(buffer, mx.array) or buffer.dtype != call.dtype:
            what = (f"a {type(buffer).__name__}" if not isinstance(buffer, mx.array) else
                    f"dtype {dtype_name(buffer)}")
            raise in_place_buffer_error("past_index_keys", f"be an mx.array of the storage dtype "
                                        f"{np_dtype(call.dtype).name}", what)
        past = buffer[:, :P]
    sg = mx.stop_gradient
    result = lightning_indexer(config, {n: sg(t) for n, t in call.params.items()}, sg(call.query), sg(call.key),
                               positions=positions, key_positions=key_positions,
                               past_index_keys=None if past is None else sg(to_mx(past)), mask=mask,
                               is_causal=False, dtype=np_dtype(call.dtype).name,
                               precision=config.indexer.scoring_precision,
                               fp8_scale_format=config.indexer.fp8_scale_format, rec=rec)
    present = result["present_index_keys"]
    if buffer is not None:
        buffer[:, P:P + S] = present[:, P:]  # the caller's array, written in place
        present = buffer
    call.selection, call.present_index_keys = result["topk_indices"], present
    call.topk = call.selection
    selected = F.selection_mask(call.selection, config.num_heads, call.shapes.S_total)
    call.mask4 = selected if call.mask4 is None else call.mask4 & selected


def past_key_buffers(past_key, past_value, dtype: np.dtype):
    """The buffers of an in-place cache (cache_length=), as given: mx.arrays of the storage dtype. A NumPy
    array or a cast would be written as a copy the caller never sees; an mx.array is written in place
    (slice assignment updates the caller's array)."""
    for name, buffer in (("past_key", past_key), ("past_value", past_value)):
        if not isinstance(buffer, mx.array) or np_dtype(buffer.dtype) != dtype:
            what = f"a {type(buffer).__name__}" if not isinstance(buffer, mx.array) else f"dtype {dtype_name(buffer)}"
            raise in_place_buffer_error(name, f"be an mx.array of the storage dtype {np.dtype(dtype).name}", what)
    return past_key, past_value
